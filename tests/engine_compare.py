"""Comparing two runs of the engine on the same prompts: the same greedy tokens, and logprobs
equal or within a bound (for the one-kernel tests: a kernel against the torch ops)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tinyvllm import LLM, SamplingParams


def generate_each_way(model_dir, monkeypatch, env: str, mode: str, check: Callable[[LLM, str], None]) -> dict:
    """For each of ``env``'s values "torch" and "triton": the tiny model at ``model_dir``, Triton
    attention, ``mode``'s emulated CUDA graphs, two prompts greedily with logprobs; ``check(llm,
    impl)`` first says the engine uses what ``env`` asked. Returns {impl: the outputs}."""
    prompts = [[5, 6, 7, 8, 9], [11, 3, 7]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    runs = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv(env, impl)
        llm = LLM(str(model_dir), device="cpu", max_model_len=64, attention_backend="triton",
                  compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4]})  # fmt: skip
        check(llm, impl)
        runs[impl] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return runs


def assert_same_tokens_and_logprobs(runs_a: list, runs_b: list, abs_tol: float | None = None) -> None:
    """Each request's tokens equal; its logprobs equal (``abs_tol`` None) or within ``abs_tol``."""
    assert len(runs_a) == len(runs_b)
    for a, b in zip(runs_a, runs_b):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if abs_tol is None:
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
            continue
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            (ta, pa), (tb, pb) = next(iter(la.items())), next(iter(lb.items()))
            assert ta == tb and pa.logprob == pytest.approx(pb.logprob, abs=abs_tol)
