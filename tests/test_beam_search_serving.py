"""Beam search served: ``AsyncLLM.beam_search`` against ``LLM.beam_search``, bad input
refused before the first step, and a search whose consumer goes away.

The tiny random Qwen3 rarely ends on its own EOS, so the module makes the likeliest
candidate token of a probe search an extra EOS (as ``test_beam_search.py`` does): beams
then finish with ``"stop"`` and finished beams of different lengths are ranked together.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest

from serve_fixtures import slow_steps
from tinyvllm import LLM
from tinyvllm.beam_search import BeamSearchParams
from tinyvllm.engine.async_llm import AsyncLLM

NAME = "tiny-beams"
TEXT = "def main():\n    return"
IDS = [(37 * i + 11) % 500 + 5 for i in range(9)]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]


def make_llm(folder: str, **kw) -> LLM:
    return LLM(folder, **{"device": "cpu", "max_model_len": 64, "block_size": 4, **kw})


@pytest.fixture(scope="module")
def folder(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["qwen3"])


@pytest.fixture(scope="module")
def eos_extra(folder) -> int:
    """The likeliest candidate token of a probe search: made an EOS, beams end on it."""
    probe = make_llm(folder)
    found = probe.beam_search([TEXT, {"prompt_token_ids": IDS}], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    seen = Counter(t for out in found for s in out.sequences for position in s.logprobs for t in position)
    return seen.most_common(1)[0][0]


def with_eos(llm: LLM, token: int) -> LLM:
    llm.engine.input_processor.extra_stop_token_ids = (token,)
    return llm


@pytest.fixture(scope="module")
def llm(folder, eos_extra) -> LLM:
    return with_eos(make_llm(folder), eos_extra)


async def collect(stream) -> list:
    return [out async for out in stream]


# -- AsyncLLM.beam_search ----------------------------------------------------------------------


def test_async_beam_search_returns_the_beams_of_llm_beam_search(llm, eos_extra):
    """Two searches at once on one AsyncLLM (a text prompt and salted token ids) give what
    ``LLM.beam_search`` gives for them: one finished output each, one completion per beam,
    best first, with its tokens (a final EOS kept), sum, logprobs, text and finish."""
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    prompts = [TEXT, {"prompt_token_ids": IDS, "cache_salt": "s1"}]
    expected = llm.beam_search(prompts, params)

    async def main():
        async_llm = AsyncLLM(llm.engine)
        try:
            return await asyncio.gather(*(collect(async_llm.beam_search(p, f"r{i}", params)) for i, p in enumerate(prompts)))
        finally:
            await async_llm.shutdown()

    got = asyncio.run(main())
    stops = 0
    for i, (want, outs) in enumerate(zip(expected, got)):
        (out,) = outs
        assert (out.request_id, out.finished, out.num_cached_tokens) == (f"r{i}", True, 0)
        prompt_ids = list(want.sequences[0].tokens[: want.sequences[0].num_prompt_tokens])
        assert out.prompt_token_ids == prompt_ids and out.prompt == (TEXT if i == 0 else None)
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == [list(s.output_token_ids) for s in want.sequences]
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([s.cum_logprob for s in want.sequences], abs=1e-5)
        assert [c.text for c in out.outputs] == [s.text for s in want.sequences]
        assert [(c.finish_reason, c.stop_reason) for c in out.outputs] == [(s.finish_reason, s.stop_reason) for s in want.sequences]
        for c, s in zip(out.outputs, want.sequences):
            assert [sorted(p) for p in c.logprobs] == [sorted(p) for p in s.logprobs]
            assert sum(p[t].logprob for p, t in zip(c.logprobs, c.token_ids)) == pytest.approx(c.cumulative_logprob)
            if c.finish_reason == "stop":
                stops += 1
                assert c.token_ids[-1] == c.stop_reason == eos_extra
        assert out.metrics.arrival_time <= out.metrics.first_token_time <= out.metrics.finished_time
    assert stops > 0, "no beam ended on the EOS: a weak test"
    assert not llm.engine.has_unfinished_requests()


def test_bad_input_is_refused_before_the_first_step(llm, monkeypatch):
    async def main():
        async_llm = AsyncLLM(llm.engine)
        calls = []
        monkeypatch.setattr(async_llm, "generate", lambda *a, **k: calls.append(a))
        cases = [
            (BeamSearchParams(beam_width=11, max_tokens=2), {"prompt_token_ids": IDS}, ValueError,
             "beam_width=11 needs 22 logprobs a step, more than the engine's max_logprobs 20"),
            (BeamSearchParams(beam_width=2, max_tokens=2), {"prompt_token_ids": list(range(5, 69))}, ValueError,
             "prompt 0 has 64 tokens: beam search needs room for one more within max_model_len 64"),
            (BeamSearchParams(beam_width=2, max_tokens=2), {"prompt_token_ids": []}, ValueError, "prompt 0 is empty"),
            (BeamSearchParams(beam_width=2, max_tokens=2), {"prompt_token_ids": [10**9]}, ValueError, "outside the vocabulary"),
            ({"beam_width": 2}, TEXT, TypeError, "params must be BeamSearchParams"),
        ]  # fmt: skip
        try:
            for params, prompt, error, match in cases:
                with pytest.raises(error, match=match):
                    await anext(async_llm.beam_search(prompt, "bad", params))
        finally:
            await async_llm.shutdown()
        return calls

    assert asyncio.run(main()) == []
    assert not llm.engine.has_unfinished_requests()


def test_a_search_cancelled_mid_way_leaves_no_request_in_the_engine(folder, monkeypatch):
    """One request runs at a time (``max_num_seqs=1``), so step 2's three requests
    (``c-beam-2-0`` to ``-2``) take turns and wait in the engine. The consumer is cancelled
    while two of them wait: those the step in flight does not finish are aborted, no later
    step adds a request, and the id can be used again at once."""
    llm = make_llm(folder, max_num_seqs=1)
    engine = llm.engine
    slow_steps(monkeypatch, llm, 0.01)
    added, aborted = [], []
    add, abort = engine.add_core_request, engine.abort_request
    monkeypatch.setattr(engine, "add_core_request", lambda request: added.append(request.request_id) or add(request))
    monkeypatch.setattr(engine, "abort_request", lambda ids: aborted.extend([ids] if isinstance(ids, str) else ids) or abort(ids))

    async def main():
        async_llm = AsyncLLM(engine)
        ids = lambda: async_llm.run_in_engine_thread(engine.unfinished_request_ids)  # noqa: E731
        try:
            params = BeamSearchParams(beam_width=3, max_tokens=40, ignore_eos=True)
            task = asyncio.ensure_future(anext(async_llm.beam_search({"prompt_token_ids": IDS}, "c", params)))
            seen = await ids()
            while len([r for r in seen if r.startswith("c-beam-2-")]) < 2:
                assert not task.done()
                await asyncio.sleep(0.002)
                seen = await ids()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            left = await ids()
            await asyncio.sleep(0.1)
            later = await ids()
            again = await collect(async_llm.beam_search({"prompt_token_ids": IDS}, "c", dataclasses.replace(params, max_tokens=2)))
            return seen, left, later, again
        finally:
            await async_llm.shutdown()

    seen, left, later, again = asyncio.run(main())
    waiting = {r for r in seen if r.startswith("c-beam-2-")}
    # at most one of those waiting ran in the step in flight at the cancel; the others were aborted
    assert len(waiting & set(aborted)) >= len(waiting) - 1 >= 1, (waiting, aborted)
    assert left == set() and later == set()
    assert not any(r.startswith("c-beam-3-") for r in added)
    assert len(again) == 1 and [len(c.token_ids) for c in again[0].outputs] == [2, 2, 2]
    engine.check_invariants()
