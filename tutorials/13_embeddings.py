"""Tutorial 13: one embedding, step by step (the pooling runner).

A pooling engine (``LLM(runner="pooling")``) on the shipped model, MEAN pooling, a token
budget of 8, so a 17-token prompt is computed in three chunks (8, 8, 1). After each step we print the
positions the step computed, how many positions the request's pooling state has summed, and
whether the vector was made. Then a second prompt that shares the first's 16 leading tokens:
MEAN takes no prefix-cache hit (it needs every position's hidden state), LAST reads the hit.
At the end: the vectors against transformers' base model, pooled by hand.

Run it from the repository root: ``python tutorials/13_embeddings.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from tinyvllm import LLM, PoolingParams  # noqa: E402
from tinyvllm.stdlib_tiny import STDLIB_TINY  # noqa: E402

torch.set_num_threads(1)
PROMPT = "def mean(values):\n    return sum(values) / len(values)\n"
COMMON = dict(device="cpu", max_num_batched_tokens=8, block_size=4, seed=0)


def run_one(llm: LLM, rid: str, ids: list[int]):
    """Add one request and step the engine until it is done, printing each step."""
    engine, runner = llm.engine, llm.engine.model_runner
    engine.add_request(rid, ids, PoolingParams())
    step, outputs = 0, []
    while engine.has_unfinished_requests():
        request = engine.scheduler.requests[rid]
        before = request.num_computed_tokens
        outputs += engine.step()
        step += 1
        after = request.num_computed_tokens
        state = runner.requests[rid].pooling_state  # the runner's: MEAN's running float32 sum
        summed = after if state.total is not None else 0  # every position computed so far is in it
        made = "yes" if outputs else "no"
        print(f"{step:4d} | {before:2d} .. {after - 1:2d}  | {after - before:5d} | {summed:13d} | {made}")
    return outputs[0]


def header(title: str) -> None:
    print(title)
    print("step | positions | count | summed so far | vector made")
    print("-----+-----------+-------+---------------+------------")


def main() -> None:
    mean = LLM(STDLIB_TINY, runner="pooling", pooler_config={"pooling_type": "MEAN"}, **COMMON)
    tok = mean.get_tokenizer()
    ids = tok(PROMPT).input_ids
    print(f"prompt ({len(ids)} tokens): {PROMPT!r}")
    print("MEAN pooling, token budget 8, blocks of 4\n")
    header("A: the prompt in three chunks")
    a = run_one(mean, "A", ids)
    shared = ids[:16] + tok(" + 1").input_ids
    print(f"\nB: A's first 16 tokens, then {tok.decode(shared[16:])!r} ({len(shared)} tokens)")
    b = mean.encode({"prompt_token_ids": shared}, use_tqdm=False)[0]
    print(f"MEAN: B found {b.num_cached_tokens} tokens in the prefix cache (it must compute every position)")
    last = LLM(STDLIB_TINY, runner="pooling", **COMMON)  # LAST, the default
    last.encode({"prompt_token_ids": ids}, use_tqdm=False)
    b_last = last.encode({"prompt_token_ids": shared}, use_tqdm=False)[0]
    print(f"LAST: B found {b_last.num_cached_tokens} tokens in the prefix cache (it needs the last position only)")

    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(STDLIB_TINY), dtype=torch.float32).eval()
    with torch.no_grad():
        states = {name: model(torch.tensor([p])).last_hidden_state[0] for name, p in (("A", ids), ("B", shared))}
    checks = [
        ("A, MEAN", a.outputs.data, states["A"].mean(dim=0)),
        ("B, MEAN", b.outputs.data, states["B"].mean(dim=0)),
        ("B, LAST", b_last.outputs.data, states["B"][-1]),
    ]
    print(f"\nvectors: {a.outputs.data.shape[0]} floats, unit length: {abs(a.outputs.data.norm().item() - 1) < 1e-5}")
    for name, ours, theirs in checks:
        diff = (ours - torch.nn.functional.normalize(theirs, dim=-1)).abs().max().item()
        print(f"{name}: the same as transformers' hidden states pooled by hand (max difference < 1e-5): {diff < 1e-5}")


if __name__ == "__main__":
    main()
