"""A step that raises leaves the engine serving: its requests are aborted, no block leaks,
and no later request hits a block whose KV the failed step never wrote.

Faults are injected where a real one would come from: the model's forward, the sampler, a
logits processor (in ``apply`` and in ``update_state``), ``KeyboardInterrupt`` included."""

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.request import Request
from tinyvllm.sample.logits_processors import LogitsProcessor

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PREFIX = [(13 * i + 7) % 400 + 20 for i in range(40)]  # 10 full blocks of 4


class Boom(Exception):
    pass


class Fault:
    """Raises ``exc`` the ``at``-th time it is triggered (1-based), once."""

    def __init__(self, at: int = 1, exc: BaseException | type = Boom):
        self.at, self.calls, self.exc = at, 0, exc

    def trigger(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise self.exc if isinstance(self.exc, BaseException) else self.exc("injected fault")


class FaultyProcessor(LogitsProcessor):
    """A logits processor that raises in ``apply`` or in ``update_state``."""

    def __init__(self, fault: Fault, where: str):
        self.fault, self.where = fault, where

    def apply(self, logits):
        if self.where == "apply":
            self.fault.trigger()
        return logits

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        if self.where == "update_state":
            self.fault.trigger()


def make_llm(folder, **kw):
    return LLM(str(folder), device="cpu", max_model_len=64, block_size=4, **kw)


def inject(llm, where: str, fault: Fault) -> None:
    runner = llm.engine.model_runner
    if where == "forward":
        forward = llm.model.forward

        def faulty_forward(*args, **kwargs):
            fault.trigger()
            return forward(*args, **kwargs)

        llm.model.forward = faulty_forward
    elif where == "sampler":
        sampler = runner.sampler

        def faulty_sampler(*args):
            fault.trigger()
            return sampler(*args)

        runner.sampler = faulty_sampler
    else:
        runner.input_batch.logitsprocs.non_argmax_invariant.append(FaultyProcessor(fault, where))


def assert_clean(llm):
    engine = llm.engine
    kv = engine.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests(), "a request of the failed call is left"
    assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks, "a block leaked"
    assert kv.uncommitted_blocks == []
    engine.check_invariants()  # the scheduler, the runner, and their copies of each request
    # Finished requests' runner states go when the next step tells the runner; nothing else stays.
    assert set(engine.model_runner.requests) <= engine.scheduler.finished_req_ids
    assert engine.output_processor.request_states == {}


@pytest.fixture(scope="module")
def fresh(tiny_model_dirs):
    """What a fresh engine answers, per prompt (greedy, so a cache hit changes nothing)."""
    llm = make_llm(tiny_model_dirs["qwen3"], enable_prefix_caching=False)
    cache = {}

    def answer(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        return cache[key]

    return answer


@pytest.mark.parametrize("where", ["forward", "sampler", "apply", "update_state"])
@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_failed_step_aborts_its_requests_and_the_engine_serves_on(tiny_model_dirs, fresh, where, exc):
    llm = make_llm(tiny_model_dirs["qwen3"])
    inject(llm, where, Fault(at=2, exc=exc))
    prompts = [PREFIX + [1, 2, 3], PREFIX[:20] + [9], [5, 6, 7]]
    with pytest.raises(exc):
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_clean(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [fresh(p) for p in prompts]
    assert_clean(llm)


@pytest.mark.seed("002:2.3")
def test_blocks_of_a_failed_first_forward_never_serve_a_hit(tiny_model_dirs, fresh):
    """The dangerous case: blocks are cached when allocated, before the forward writes
    them. After a failed forward, a prompt with the same prefix must not hit them."""
    llm = make_llm(tiny_model_dirs["qwen3"])
    inject(llm, "forward", Fault(at=1))
    with pytest.raises(Boom):
        llm.generate({"prompt_token_ids": PREFIX + [1]}, GREEDY, use_tqdm=False)
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.block_pool.cached_block_hash_to_block == {}, "unwritten blocks stayed in the prefix cache"
    [out] = llm.generate({"prompt_token_ids": PREFIX + [2]}, GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == fresh(PREFIX + [2])
    [again] = llm.generate({"prompt_token_ids": PREFIX + [3]}, GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == 40, "blocks written by a finished step must still be shared"
    assert again.outputs[0].token_ids == fresh(PREFIX + [3])


def test_blocks_committed_before_the_failure_stay_cached(tiny_model_dirs, fresh):
    """A chunked prompt: the first chunk's step finishes (its blocks are written), the
    second chunk's step fails. Only the second chunk's blocks leave the cache."""
    llm = make_llm(tiny_model_dirs["qwen3"], max_num_batched_tokens=24)
    inject(llm, "forward", Fault(at=2))
    with pytest.raises(Boom):
        llm.generate({"prompt_token_ids": PREFIX + [1]}, GREEDY, use_tqdm=False)
    assert_clean(llm)
    [out] = llm.generate({"prompt_token_ids": PREFIX + [2]}, GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 24, "the first chunk's 6 written blocks should be hits"
    assert out.outputs[0].token_ids == fresh(PREFIX + [2])


def test_requests_the_failed_step_did_not_schedule_carry_on(tiny_model_dirs, fresh):
    """With one request at a time, B waits while A's step fails: A is aborted, B runs to
    the fresh-engine output."""
    llm = make_llm(tiny_model_dirs["qwen3"], max_num_seqs=1)
    engine = llm.engine
    engine.add_request("A", PREFIX[:9], GREEDY)
    engine.add_request("B", [5, 6, 7], GREEDY)
    engine.step()  # A's prefill
    inject(llm, "sampler", Fault(at=1))
    with pytest.raises(Boom):
        engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["B"] and not engine.scheduler.running
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step()}
    assert finished == {"B": fresh([5, 6, 7])}
    assert_clean(llm)


def test_kv_cache_manager_commit_and_rollback():
    kv = KVCacheManager(block_size=4, num_gpu_blocks=8, max_model_len=32, enable_caching=True)
    a = Request("a", list(range(10)), SamplingParams())
    assert kv.allocate_slots(a, 10) is not None
    assert [b.block_id for b in kv.uncommitted_blocks] == [0, 1]  # the two full blocks
    kv.commit_step()
    assert kv.uncommitted_blocks == []
    a.num_computed_tokens = 10
    a.append_output_token_ids([10, 11])
    kv.allocate_slots(a, 2)
    assert [b.block_id for b in kv.uncommitted_blocks] == [2]  # tokens 8..11 fill block 2
    with pytest.raises(AssertionError, match="still held"):
        kv.rollback_step()  # its holder has not been aborted
    kv.free(a)
    kv.uncommitted_blocks = [kv.block_pool.blocks[2]]
    assert kv.rollback_step() == [2]
    cached = {b.block_id for d in kv.block_pool.cached_block_hash_to_block.values() for b in d.values()}
    assert cached == {0, 1} and kv.block_pool.blocks[2].block_hash is None
    kv.check_invariants()


def test_input_batch_reset_empties_every_row_and_the_processors(tiny_model_dirs):
    llm = make_llm(tiny_model_dirs["qwen3"])
    batch = llm.engine.model_runner.input_batch
    batch.add_request("x", SamplingParams(min_tokens=3, seed=1), [1], [], eos_token_id=0, block_ids=[3])
    batch.add_request("y", SamplingParams(logit_bias={4: 2.0}), [1], [], block_ids=[5, 6])
    batch.refresh()
    batch.remove_request("x")  # a half-done step: a hole, nothing condensed
    batch.reset()
    assert batch.num_reqs == 0 and batch.req_ids == [] and batch.seeds == {}
    assert batch.block_table.num_blocks[:2] == [0, 0]
    batch.check_invariants()
    logits = torch.zeros(1, 512)
    batch.add_request("z", SamplingParams(), [1], [], block_ids=[1])
    batch.refresh()
    out = llm.engine.model_runner.sampler(logits, batch.make_sampling_metadata())
    assert out.sampled_token_ids.shape == (1,)  # the processors hold no stale rows


class StubbornProcessor(LogitsProcessor):
    """Raises in ``update_state`` on calls ``first`` and ``first + 1``: in a step's refresh,
    then again in the failed step's recovery (``InputBatch.reset``)."""

    def __init__(self, first: int, message: str = "injected fault"):
        self.first, self.calls, self.message, self.rows = first, 0, message, set()

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        self.calls += 1
        if self.calls in (self.first, self.first + 1):
            raise Boom(f"{self.message} #{self.calls}")


def test_a_recovery_that_raises_again_still_ends_the_steps_requests(tiny_model_dirs, fresh):
    """The first error is the one raised, with the second attached as a note; every request
    of the step ends; every other processor still drops its rows; the engine serves on."""
    llm = make_llm(tiny_model_dirs["qwen3"])
    engine = llm.engine
    stubborn = StubbornProcessor(first=2)
    batch = engine.model_runner.input_batch
    batch.logitsprocs.non_argmax_invariant.insert(0, stubborn)  # before MinTokens and LogitBias
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("b", PREFIX[:9], SamplingParams(temperature=0.0, max_tokens=5, min_tokens=3))
    engine.step()  # update_state call 1: both requests enter the batch
    with pytest.raises(Boom, match="injected fault #2") as info:
        engine.step()  # call 2 raises; the recovery's reset makes call 3, which raises too
    assert any("injected fault #3" in note for note in getattr(info.value, "__notes__", []))
    assert engine.unfinished_request_ids() == set()
    assert_clean(llm)
    min_tokens = next(p for p in batch.logitsprocs.all if type(p).__name__ == "MinTokensLogitsProcessor")
    assert not min_tokens.min_toks, "MinTokens kept the rows of the failed step"
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == fresh([5, 6, 7])
    assert_clean(llm)


# -- a failure late in a step: after the sampled tokens reached the scheduler ----------------

SPEC = {"num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
LOOP = [5, 6, 7, 8] * 4  # the n-gram proposer drafts for it at once


def inject_late(llm, where: str, fault: Fault, monkeypatch) -> None:
    """A fault after ``update_from_output``: in the proposer, the detokenizer, the stop-string
    search, or the making of an output (``KeyboardInterrupt`` too)."""
    engine = llm.engine
    if where == "proposer":
        propose = engine.proposer.propose_batch
        monkeypatch.setattr(engine.proposer, "propose_batch", lambda *a: (fault.trigger(), propose(*a))[1])
    elif where == "detokenizer":
        from tinyvllm.engine import detokenizer

        update = detokenizer.IncrementalDetokenizer.update
        monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "update", lambda self, ids: (fault.trigger(), update(self, ids))[1])
    elif where == "stop_strings":
        search = engine.output_processor._update_text
        monkeypatch.setattr(engine.output_processor, "_update_text", lambda *a: (fault.trigger(), search(*a))[1])
    else:
        make = engine.output_processor._make_output
        monkeypatch.setattr(engine.output_processor, "_make_output", lambda *a: (fault.trigger(), make(*a))[1])


LATE = ["proposer", "detokenizer", "stop_strings", "output"]


@pytest.mark.parametrize("where", LATE)
@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_a_failure_late_in_a_step_is_undone_like_an_early_one(tiny_model_dirs, fresh, monkeypatch, where, exc):
    """Issue: an exception after the scheduler took the step's tokens (the proposer, the
    detokenizer, the stop-string search, the outputs, a Ctrl-C) must abort the step's
    requests as a failed forward does: a caller that keeps stepping gets no completion with
    a token missing, the engine passes ``check_invariants`` and serves on."""
    llm = make_llm(tiny_model_dirs["qwen3"], speculative_config=SPEC if where == "proposer" else None)
    engine = llm.engine
    with_stop = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, stop=["never in this text"])
    engine.add_request("short", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, stop=["x y z"]))
    engine.add_request("long", LOOP, with_stop)
    inject_late(llm, where, Fault(at=1, exc=exc), monkeypatch)
    with pytest.raises(exc):
        while engine.has_unfinished_requests():
            engine.step()
    assert_clean(llm)
    done = {}
    engine.add_request("again", LOOP, with_stop)  # the fault has fired: the engine serves as new
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step()}
    assert done["again"].outputs[0].token_ids == fresh(LOOP)
    assert_clean(llm)


def test_an_async_consumer_of_a_request_finished_in_a_late_failing_step_gets_the_error(tiny_model_dirs, monkeypatch):
    """The request finishes (max_tokens=1) in the step whose output processing fails: its
    ``generate`` must end with the step's error, not wait forever."""
    import asyncio

    from tinyvllm.engine.async_llm import AsyncLLM

    llm = make_llm(tiny_model_dirs["qwen3"])
    inject_late(llm, "detokenizer", Fault(at=1), monkeypatch)  # before the engine forgets the request

    async def main():
        engine = AsyncLLM(llm.engine)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, stop=["x y z"])
        try:
            with pytest.raises(Boom):
                await asyncio.wait_for(anext(engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "r")), timeout=20)
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert_clean(llm)
