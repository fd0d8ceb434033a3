"""One rank of ``torchrun --nproc-per-node N tests/tp_torchrun_script.py MODEL OUT.json``:
every rank builds the same engine (``distributed_executor_backend="external_launcher"``) and
generates the same prompts greedily; rank 0 writes each prompt's token ids to OUT.json.
``tests/test_multiproc_executor.py`` runs it on the CPU (gloo) against a one-process run."""

from __future__ import annotations

import json
import os
import sys

from tinyvllm import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6]}, {"prompt_token_ids": [9, 8, 7]}]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def generate(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, device="cpu", torch_threads=1, **kwargs)
    try:
        return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()  # under torchrun: every rank waits for the others, then leaves the group


if __name__ == "__main__":
    model, out = sys.argv[1], sys.argv[2]
    world_size = int(os.environ["WORLD_SIZE"])
    tokens = generate(model, tensor_parallel_size=world_size, distributed_executor_backend="external_launcher")
    if int(os.environ["RANK"]) == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"world_size": world_size, "tokens": tokens}, f)
