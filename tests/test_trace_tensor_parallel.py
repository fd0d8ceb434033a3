"""``tinyvllm trace --tensor-parallel-size 2``: the ranks' runners read through the executor.

The recorder reads the persistent batch, the dispatch and the slots with one
``collective_rpc(runner_state)`` a step (``recorder.py`` NOTE 7), so an engine whose runners
live in two worker processes records as one with a runner in this process:

- on the tiny Qwen3 (two KV heads) the trace of N = 2 equals N = 1's step for step (the
  scheduled and sampled tokens, the batch rows and updates, the dispatch, the slots, the
  blocks), with async scheduling too; only the description differs, by one line per rank;
  the command leaves no worker process behind;
- the ranks' states are compared: a rank whose runner differs from rank 0's stops the
  recording (the engine's run goes on), naming the ranks.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import re

import pytest

from tinyvllm import LLM, SamplingParams, cli
from tinyvllm.trace import record
from tinyvllm.trace.runner_state import runner_state
from tinyvllm.trace.workloads import tiny_model_folder


def _trace(tmp_path, model: str, size: int, *extra: str) -> dict:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\ndef main():\nclass A:\n", encoding="utf-8")
    out = tmp_path / f"tp{size}.json"
    argv = ["trace", "--prompts", str(prompts), "--model", model, "--device", "cpu", "--threads", "1",
            "--max-tokens", "6", "--max-model-len", "64", "--num-gpu-blocks-override", "24", "--block-size", "4",
            "--max-num-batched-tokens", "16", "--tensor-parallel-size", str(size), "--out", str(tmp_path / f"tp{size}.html"),
            "--json", str(out), *extra]  # fmt: skip
    assert cli.main(argv) == 0
    return json.loads(out.read_text(encoding="utf-8"))


def test_two_ranks_record_the_same_steps_as_one_and_say_what_each_rank_holds(tiny_model_dirs, tmp_path):
    qwen3 = str(tiny_model_dirs["qwen3"])
    one, two = _trace(tmp_path, qwen3, 1), _trace(tmp_path, qwen3, 2)
    assert not multiprocessing.active_children()  # the command shut its workers down
    assert two["steps"] == one["steps"]  # every scheduled and sampled token, row, dispatch, slot and block
    assert {k: v for k, v in two.items() if k != "description"} == {k: v for k, v in one.items() if k != "description"}
    steps = one["steps"]
    assert len(steps) == 7 and steps[0]["scheduler"]["scheduled"][0]["kind"] in ("prefill", "chunk")
    # under async scheduling too: step 0's launch picture and each step's runner parts are read
    # through the executor's step messages (step_replies.py), and equal one rank's
    async_one, async_two = _trace(tmp_path, qwen3, 1, "--async-scheduling"), _trace(tmp_path, qwen3, 2, "--async-scheduling")
    assert async_two["steps"] == async_one["steps"] and async_one["steps"][0]["launched"] is True
    assert not multiprocessing.active_children()
    assert sum(len(s["new_token_ids"]) for step in steps for s in step["scheduler"]["scheduled"]) == 3 * 6
    assert {len(step["batch"]["rows"]) for step in steps} >= {3} and any(step["slots"] for step in steps)
    first, *ranks = two["description"].split("\n")
    assert first == one["description"] and "\n" not in one["description"]
    assert len(ranks) == 2
    for rank, line in enumerate(ranks):  # the tiny Qwen3's two KV heads: one a rank; every rank the same 24 blocks
        assert re.fullmatch(rf"rank {rank} of 2: weights [\d.]+ KiB, KV heads 1 of 2, KV cache 24 blocks \([\d.]+ KiB\)", line), line
    html = (tmp_path / "tp2.html").read_text(encoding="utf-8")
    assert "<br>rank 0 of 2: weights" in html  # a line each in the viewer's header


def test_a_rank_whose_runner_differs_stops_the_recording_and_names_it(monkeypatch):
    llm = LLM(tiny_model_folder(), device="cpu", max_model_len=32, block_size=4, num_gpu_blocks_override=16)
    executor = llm.engine.model_executor
    real = executor.collective_rpc

    def two_ranks(method, args=(), kwargs=None):  # a rank 1 that wrote one slot fewer than rank 0
        results = real(method, args, kwargs)
        if method is not runner_state:
            return results
        return [results[0], dataclasses.replace(results[0], slots=results[0].slots[:-1])]

    monkeypatch.setattr(executor, "collective_rpc", two_ranks)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with pytest.warns(RuntimeWarning, match=r"the runners of ranks \[1\] differ from rank 0's"):
        with record(llm) as recorder:
            outputs = llm.generate(["import os"], params, use_tqdm=False)
    assert recorder.steps == [] and isinstance(recorder.error, ValueError)
    assert len(outputs[0].outputs[0].token_ids) == 3  # the engine's run is the recorder's no concern
    monkeypatch.undo()
    with record(llm) as recorder:  # the same engine, its one real rank: recorded
        llm.generate(["import os"], params, use_tqdm=False)
    assert len(recorder.steps) == 3 and recorder.error is None
