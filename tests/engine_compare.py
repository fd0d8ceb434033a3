"""Comparing two runs of the engine on the same prompts: the same greedy tokens, and logprobs
equal or within a bound (for the one-kernel tests: a kernel against the torch ops)."""

from __future__ import annotations

import pytest


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
