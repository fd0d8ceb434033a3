"""Speculative decoding through the engine (n-gram prompt lookup): greedy output equals greedy
output without it, token for token, under chunked prefill, preemption, prefix hits, aborts
and every cudagraph_mode; seeded sampling is reproducible; MinTokens and the thinking
budget act on draft positions as they would one token at a time."""

from __future__ import annotations

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.config import CUDAGraphMode, SpeculativeConfig

from spec_workload import LOOP, PROMPTS, SPEC, run_rounds_with_an_abort


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def make_llm(folder, spec: dict | None = SPEC, **kw) -> LLM:
    kw = {"device": "cpu", "max_model_len": 96, "block_size": 4, **kw}
    llm = LLM(str(folder), speculative_config=spec, **kw)
    if llm.engine.proposer is not None:  # these batches are small: search them in numpy all the same
        llm.engine.proposer.min_batch_tokens = 0
    return llm


def run(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_greedy_with_speculation_equals_greedy_without(tiny_model_dirs, family):
    folder = tiny_model_dirs[family]
    expected = run(make_llm(folder, None), PROMPTS, greedy())
    spec = make_llm(folder)
    assert run(spec, PROMPTS, greedy()) == expected
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # drafts were verified and kept


@pytest.mark.parametrize(
    "kw",
    [
        {"max_num_batched_tokens": 7},  # chunked prefills, and drafts cut to what the budget leaves
        {"num_gpu_blocks_override": 26, "max_num_seqs": 4},  # preemption with drafts in flight
        {"enable_prefix_caching": True},  # the second round hits the first round's blocks
    ],
    ids=["chunked", "preemption", "prefix_hits"],
)
def test_greedy_equivalence_under_the_schedulers_corner_cases(tiny_model_dirs, kw):
    folder = tiny_model_dirs["qwen3"]
    expected = run(make_llm(folder, None), PROMPTS, greedy(24))
    spec = make_llm(folder, **kw)
    for _ in range(2):
        assert run(spec, PROMPTS, greedy(24)) == expected
    scheduler = spec.engine.scheduler
    if "num_gpu_blocks_override" in kw:
        assert scheduler.num_preemptions > 0
    if kw.get("enable_prefix_caching"):
        assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_failed_verification_step_leaves_the_engine_serving(tiny_model_dirs, where):
    """A step that raises while it verifies drafts: its requests are aborted, no block leaks,
    and nothing it wrote (drafts' KV included) is found later; the engine answers the same
    prompts as a fresh one, with speculation still on."""
    from test_engine_failures import Boom, Fault, assert_clean

    folder = tiny_model_dirs["qwen3"]
    expected = run(make_llm(folder, None), PROMPTS, greedy(12))
    spec = make_llm(folder)
    runner, fault, in_flight = spec.engine.model_runner, Fault(at=1), []
    schedule = spec.engine.scheduler.schedule

    def watch():
        out = schedule()
        in_flight.append(sum(map(len, out.scheduled_spec_decode_tokens.values())))
        return out

    spec.engine.scheduler.schedule = watch
    # the fault fires in the first step that verifies drafts
    if where == "forward":
        forward = spec.model.forward
        spec.model.forward = lambda *a, **kw: (in_flight[-1] and fault.trigger()) or forward(*a, **kw)
    else:  # the sampler's steps, on the rows of the drafts (SamplingMetadata.expand)
        sample = runner.sampler.sample
        runner.sampler.sample = lambda *a: (in_flight[-1] and fault.trigger()) or sample(*a)
    with pytest.raises(Boom):
        run(spec, PROMPTS, greedy(12))
    assert in_flight[-1] > 0, "the failed step verified no drafts"
    spec.engine.scheduler.schedule = schedule
    assert_clean(spec)
    assert run(spec, PROMPTS, greedy(12)) == expected
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_clean(spec)


def test_an_abort_with_drafts_in_flight_frees_everything_and_the_rest_carry_on(tiny_model_dirs):
    folder = tiny_model_dirs["qwen3"]
    expected = run(make_llm(folder, None), PROMPTS[1:], greedy(20))
    spec = make_llm(folder)
    engine = spec.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(20))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.requests["0"].spec_token_ids  # the aborted one carries drafts
    engine.abort_request("0")
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step()}
    assert [finished[str(i)] for i in range(1, 4)] == expected
    kv = engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks


WHOLE_WORKLOAD = dict(attention_backend="triton", block_size=16, max_num_seqs=4, max_num_batched_tokens=12,
                      num_gpu_blocks_override=6, max_model_len=96, enable_prefix_caching=True)  # fmt: skip


@pytest.fixture(scope="module")
def whole_workload_expected(tiny_model_dirs) -> list[list[int]]:
    """The reference of the whole-workload test: no speculation, no graphs. It does not depend
    on the mode, so it is run once for the five modes, not once per mode."""
    return run(make_llm(tiny_model_dirs["qwen3"], None, **WHOLE_WORKLOAD), PROMPTS[1:], greedy(12))


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
@pytest.mark.slow
def test_greedy_equivalence_on_the_whole_workload_under_every_cudagraph_mode(tiny_model_dirs, whole_workload_expected, mode):
    """Chunked prefill, preemption, prefix hits and an abort with drafts in flight, together,
    with emulated CUDA graphs over the Triton backend: the tokens of every request that is not
    aborted equal those of an engine without speculation and without graphs."""
    folder = tiny_model_dirs["qwen3"]
    common, expected = WHOLE_WORKLOAD, whole_workload_expected
    config = {"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8, 12]}
    spec = make_llm(folder, compilation_config=config, **common)
    engine = spec.engine
    dispatches = []
    run_rounds_with_an_abort(engine, greedy(12), expected, on_step=lambda e: dispatches.append(e.model_runner.last_dispatch))
    scheduler = engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    assert scheduler.spec_stats.num_accepted_tokens > 0
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks
    # Few steps here are uniform (every request verifying 3 drafts): the mixed routine serves
    # the rest. The FULL decode routine on drafts is test_greedy_equivalence_under_every_cudagraph_mode's.
    mixed = CUDAGraphMode[mode].mixed_mode()
    if mixed != CUDAGraphMode.NONE:
        assert engine.model_runner.cudagraph_stats[mixed] > 0, engine.model_runner.cudagraph_stats
    # A step in which no request has drafts (one token each, at most 4 requests: a capture
    # size) replays a FULL graph wherever the mode has one for decodes: the uniform key of 1
    # token per request under a separate decode routine (cudagraph_dispatcher.py NOTE 4).
    draftless = [d for d in dispatches if d is not None and d.num_tokens == d.num_reqs]
    assert draftless, "the workload had no step without drafts"
    for d in draftless:
        got = (d.runtime_mode, d.batch_descriptor.uniform_query_len)
        if CUDAGraphMode[mode].separate_routine():
            assert got == (CUDAGraphMode.FULL, 1), d
        else:
            assert d.runtime_mode == CUDAGraphMode[mode].decode_mode(), d


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
@pytest.mark.slow
def test_greedy_equivalence_under_every_cudagraph_mode(tiny_model_dirs, mode):
    """Emulated graphs on the CPU, the Triton backend (ALWAYS): a batch in which every request
    verifies k drafts is a uniform decode of 1 + k tokens per request, served by FULL graphs."""
    folder = tiny_model_dirs["qwen3"]
    common = dict(block_size=16, attention_backend="triton", max_num_seqs=2)
    prompts = [LOOP]  # alone, so that every step with 3 drafts is a uniform batch
    expected = run(make_llm(folder, None, **common), prompts, greedy(16))
    config = {"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8]}
    spec = make_llm(folder, compilation_config=config, **common)
    runner = spec.engine.model_runner
    assert runner.uniform_decode_query_len == 4
    assert run(spec, prompts, greedy(16)) == expected
    if mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        assert runner.cudagraph_stats[runner.cudagraph_mode.decode_mode()] > 0


def test_a_step_without_drafts_replays_the_full_graph_of_one_token_per_request(tiny_model_dirs):
    """Speculation with 3 drafts under FULL_AND_PIECEWISE (emulated, Triton backend): a
    decode step in which the request has no drafts is uniform at 1 token per request and
    replays that FULL graph; one with 3 drafts replays the graph of 4 tokens per request; one
    with fewer drafts is mixed (PIECEWISE). Greedy output equals the engine's without
    speculation and without graphs."""
    folder = tiny_model_dirs["qwen3"]
    common = dict(block_size=16, attention_backend="triton", max_num_seqs=2)
    prompt = list(range(50, 62))  # no repeats: the first decode steps have no drafts
    expected = run(make_llm(folder, None, **common), [prompt], greedy(16))
    config = {"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]}
    engine = make_llm(folder, compilation_config=config, **common).engine
    keys = engine.model_runner.dispatcher.cudagraph_keys[CUDAGraphMode.FULL]
    assert {k.uniform_query_len for k in keys} == {1, 4}
    engine.add_request("r", prompt, greedy(16))
    got, runs = None, []
    while engine.has_unfinished_requests():
        got = next((o.outputs[0].token_ids for o in engine.step() if o.finished), got)
        d = engine.model_runner.last_dispatch
        runs.append((d.num_tokens, d.runtime_mode, d.batch_descriptor.uniform_query_len))
    assert got == expected[0]
    decodes = runs[1:]  # after the prefill
    assert (1, CUDAGraphMode.FULL, 1) in decodes and (4, CUDAGraphMode.FULL, 4) in decodes, runs
    for n, mode, query_len in decodes:  # 1 or 4 tokens: FULL of that length; 2 or 3: mixed
        assert (mode, query_len) == ((CUDAGraphMode.FULL, n) if n in (1, 4) else (CUDAGraphMode.PIECEWISE, None)), runs


@pytest.mark.seed("000:cgsupport")
@pytest.mark.parametrize("support", ["UNIFORM_BATCH", "UNIFORM_SINGLE_TOKEN_DECODE"])
@pytest.mark.slow
def test_a_backend_without_uniform_batch_gets_no_full_graph_for_verification(tiny_model_dirs, monkeypatch, caplog, support):
    """Seed 000's UNIFORM_BATCH: a verification batch has 1 + k tokens per request, so a
    backend that captures only single-token decodes keeps the mode but only the FULL graphs of
    1 token per request (one line logged): its steps without drafts replay them, its steps
    with drafts run PIECEWISE (cudagraph_dispatcher.py NOTE 4). One that declares UNIFORM_BATCH
    serves both from FULL graphs. Greedy output is the same either way."""
    import dataclasses
    import logging

    from tinyvllm.attention.cudagraph_support import AttentionCGSupport
    from tinyvllm.config import CUDAGraphMode
    from tinyvllm.models import llama

    backend = llama.ATTENTION_BACKENDS["triton"]
    declared = dataclasses.replace(backend, cudagraph_support=AttentionCGSupport[support])
    monkeypatch.setitem(llama.ATTENTION_BACKENDS, "triton", declared)
    folder = tiny_model_dirs["qwen3"]
    common = dict(block_size=16, attention_backend="triton", max_num_seqs=2)
    prompt = list(range(50, 62))  # no repeats: steps without drafts first, then with drafts
    expected = run(make_llm(folder, None, **common), [prompt], greedy(16))
    config = {"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]}
    with caplog.at_level(logging.WARNING):
        spec = make_llm(folder, compilation_config=config, **common)
    runner = spec.engine.model_runner
    assert runner.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    single = support == "UNIFORM_SINGLE_TOKEN_DECODE"
    assert runner.dispatcher.uniform_decode_query_lens == ((1,) if single else (1, 4))
    only_one = "decode batches of 4 tokens per request need UNIFORM_BATCH, not UNIFORM_SINGLE_TOKEN_DECODE"
    assert (only_one in caplog.text) == single
    engine, got, runs = spec.engine, None, []
    engine.add_request("r", prompt, greedy(16))
    while engine.has_unfinished_requests():
        got = next((o.outputs[0].token_ids for o in engine.step() if o.finished), got)
        runs.append((runner.last_dispatch.num_tokens, runner.last_dispatch.runtime_mode))
    assert got == expected[0]
    assert spec.engine.scheduler.spec_stats.num_drafts > 0
    assert (1, CUDAGraphMode.FULL) in runs, runs  # a step without drafts: FULL either way
    verify = CUDAGraphMode.PIECEWISE if single else CUDAGraphMode.FULL
    assert {mode for n, mode in runs if n == 4} == {verify}, runs


def test_a_seeded_stream_is_reproducible_under_speculation(tiny_model_dirs):
    folder = tiny_model_dirs["qwen3"]
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=20, ignore_eos=True, seed=11)
    first = run(make_llm(folder), [LOOP], params)
    crowded = make_llm(folder, max_model_len=48, num_gpu_blocks_override=14, max_num_seqs=4)
    again = run(crowded, [LOOP, PROMPTS[2], PROMPTS[3]], params)[0]
    assert crowded.engine.scheduler.num_preemptions > 0
    assert first == [again]


def test_min_tokens_masks_the_stop_token_on_each_draft_position(tiny_model_dirs):
    """Seed 001 ch. 10's ``apply_with_spec_decode``, reached by a real step: the EOS id that
    greedy would pick first is masked until ``min_tokens`` outputs, draft rows included."""
    folder = tiny_model_dirs["qwen3"]
    plain = make_llm(folder, None)
    [free] = run(plain, [LOOP], greedy(12))
    stop = free[0]  # what greedy writes first: MinTokens must hold it back for 6 tokens
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[stop])
    expected = run(plain, [LOOP], params)
    spec = make_llm(folder)
    calls = []
    proc = spec.engine.model_runner.input_batch.logitsprocs.non_argmax_invariant[0]
    original = proc.apply_with_spec_decode
    proc.apply_with_spec_decode = lambda logits, rows: calls.append(list(rows)) or original(logits, rows)
    got = run(spec, [LOOP], params)
    assert got == expected and stop not in got[0][:6] and len(got[0]) >= 6
    assert any(rows[0] > 1 for rows in calls)  # steps with drafts went through the per-position mask


def test_the_thinking_budget_forces_on_draft_positions(tiny_model_dirs):
    """Seed 001 ch. 13 / appendix T2: with drafts in flight the budget runs out at a draft
    position, which is forced there; the tokens equal those of a run without speculation."""
    folder = tiny_model_dirs["qwen3"]
    prompt = [1] + LOOP  # <think> (id 1) opens a section: the loop is thinking
    params = greedy(16, thinking_token_budget=5)
    expected = run(make_llm(folder, None), [prompt], params)
    spec = make_llm(folder)
    got = run(spec, [prompt], params)
    assert got == expected
    assert got[0][5] == 2  # </think> (id 2) forced as the sixth token: after exactly 5 thinking tokens
    assert spec.engine.scheduler.spec_stats.num_draft_tokens > 0


class ScriptedProposer:
    """Drafts as a script says: request ``prompt -> (its greedy continuation, how many drafts)``,
    so one step can hold exactly the layout a document draws."""

    def __init__(self, script: dict[tuple[int, ...], tuple[list[int], int]]) -> None:
        self.script = script

    def propose(self, token_ids):
        for prompt, (continuation, n) in self.script.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                return continuation[done : done + n]
        return []

    def propose_batch(self, requests):  # what the engine calls, for every decoding request
        return [self.propose(request.all_token_ids) for request in requests]

    def check_invariants(self):  # it keeps no state between steps
        return None


def test_seed001_layout_2_3_1_and_forcing_on_a_draft_row_in_real_steps(tiny_model_dirs):
    """Seed 001 ch. 10's ``[2, 3, 1]`` and appendix T2's layout, reached by engine steps:
    three decoding requests verify 1, 2 and 0 drafts, so MinTokens and the thinking budget
    see rows ``[2, 3, 1]`` (request 1 owns rows 2-4). Request 1 is thinking with a budget,
    so its end token is forced at a row inside its block, ``cu_num_tokens[1] + force_index``;
    every request's tokens equal those of a run without speculation."""
    from tinyvllm.sample.thinking_budget import FORCED_LOGIT

    folder = tiny_model_dirs["qwen3"]
    prompts = [[30, 31, 32, 33], [1, 40, 41, 42, 43], [50, 51, 52]]  # request 1 opens <think> (id 1)
    params = [greedy(10, min_tokens=4), greedy(10, thinking_token_budget=6), greedy(10)]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain = [o.outputs[0].token_ids for o in make_llm(folder, None).generate(inputs, params, use_tqdm=False)]
    assert 2 in plain[1], "the budget must end request 1's thinking with </think> (id 2)"
    spec = make_llm(folder)
    spec.engine.proposer = ScriptedProposer({tuple(p): (out, n) for p, out, n in zip(prompts, plain, (1, 2, 0))})
    batch = spec.engine.model_runner.input_batch
    layouts, forced = [], []
    min_tokens = batch.logitsprocs.non_argmax_invariant[0]
    apply_min = min_tokens.apply_with_spec_decode
    min_tokens.apply_with_spec_decode = lambda logits, rows: layouts.append(list(rows)) or apply_min(logits, rows)
    budget = batch.thinking_budget
    apply_budget = budget.apply_to_rows

    def spy(logits, rows):  # rows: None in a step without drafts (one row per request)
        out = apply_budget(logits, rows)
        layout = [1] * logits.shape[0] if rows is None else list(rows)
        forced.append((layout, (out.max(dim=-1).values >= FORCED_LOGIT).nonzero().flatten().tolist()))
        return out

    budget.apply_to_rows = spy
    got = [o.outputs[0].token_ids for o in spec.generate(inputs, params, use_tqdm=False)]
    assert got == plain
    assert [2, 3, 1] in layouts, layouts
    # 4 thinking tokens in the prompt + 2 outputs use the budget of 6: </think> is request 1's
    # third output, its second draft position in the first [2, 3, 1] step. T2's row:
    # cu_num_tokens[1] (2) + force_index (1) = 3, and no other row is forced in the run.
    assert plain[1][2] == 2
    assert [(rows, hits) for rows, hits in forced if hits] == [([2, 3, 1], [3])], forced


def same_logprobs(mine, theirs, tol=1e-4) -> bool:
    """Two positions' ``{token: Logprob}`` agree: the same tokens, ranks and (within ``tol``) values."""
    return mine.keys() == theirs.keys() and all(
        mine[t].rank == theirs[t].rank and abs(mine[t].logprob - theirs[t].logprob) <= tol for t in mine
    )


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_logprobs_with_speculation_equal_logprobs_without(tiny_model_dirs, family):
    """As vLLM since its PR #26060: the logprobs of every kept token (a draft the target
    agreed with, or the token it sampled) are the target's raw logprobs at that position, so
    they equal a run without speculation; prompt logprobs too. Run with drafts kept (looping
    prompts), chunked prefills and a ``max_tokens`` that cuts a step's kept tokens short."""
    folder = tiny_model_dirs[family]
    params = [greedy(n, logprobs=3, prompt_logprobs=2) for n in (16, 11, 13, 5)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    plain = make_llm(folder, None).generate(prompts, params, use_tqdm=False)
    spec = make_llm(folder, max_num_batched_tokens=9)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0
    for mine, theirs in zip(got, plain):
        a, b = mine.outputs[0], theirs.outputs[0]
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)
        assert all(same_logprobs(x, y) for x, y in zip(a.logprobs, b.logprobs))
        assert abs(a.cumulative_logprob - b.cumulative_logprob) <= 1e-3
        assert mine.prompt_logprobs[0] is None and len(mine.prompt_logprobs) == len(theirs.prompt_logprobs)
        assert all(same_logprobs(x, y) for x, y in zip(mine.prompt_logprobs[1:], theirs.prompt_logprobs[1:]))


def one_token_words(llm, token_ids) -> list[str]:
    """Words of the output that the engine's bad-words tokenization bans as that one token."""
    from tinyvllm.sample.bad_words import tokenize_bad_words

    tok = llm.get_tokenizer()
    words = [tok.decode([t]) for t in dict.fromkeys(token_ids)]
    return [w for w, t in zip(words, dict.fromkeys(token_ids)) if w.strip() and (t,) in tokenize_bad_words(tok, [w])]


@pytest.mark.parametrize("field", ["bad_words", "allowed_token_ids"])
def test_bad_words_and_allowed_ids_act_on_every_draft_row(tiny_model_dirs, field):
    """As vLLM's rejection sampler: a draft row is masked as the token after the drafts
    before it would be, so greedy output with speculation equals greedy output without, for
    a ban that changes the output and for allowed ids that keep the looping prompt's tokens."""
    folder = tiny_model_dirs["qwen3"]
    plain = make_llm(folder, None)
    free = run(plain, [LOOP], greedy(16))[0]
    if field == "bad_words":
        words = one_token_words(plain, free[2:])
        assert words, f"the greedy output {free} has no one-token word"
        value = words[:1]
    else:
        value = sorted(set(LOOP) | {free[0]})[:-1]  # the loop's tokens, less the largest one
    params = greedy(16, **{field: value})
    expected = run(plain, [LOOP, PROMPTS[3]], params)
    assert expected[0] != free  # the field changed the output
    spec = make_llm(folder)
    assert run(spec, [LOOP, PROMPTS[3]], params) == expected
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_a_bad_word_that_drafts_would_complete_is_rejected(tiny_model_dirs):
    """Drafts ``a b`` in one step, where ``a b`` is a bad word: the row after draft ``a`` must
    ban ``b`` (the output alone does not end in ``a``), so ``b`` is rejected and the target's
    next choice kept, as without speculation. The drafts are scripted to be the unbanned
    greedy continuation, so each step keeps 3 drafts and a bonus token: drafts at output
    positions 1-3, 5-7, ...; the bad word is a pair of the continuation inside one step."""
    from tinyvllm.sample.bad_words import tokenize_bad_words

    folder = tiny_model_dirs["qwen3"]
    plain = make_llm(folder, None)
    tok = plain.get_tokenizer()
    free = run(plain, PROMPTS, greedy(16))
    pairs = [
        (prompt, out, i, tok.decode(out[i : i + 2]))
        for prompt, out in zip(PROMPTS, free)
        for i in range(1, len(out) - 1)
        if i % 4 in (1, 2) and out[i - 1] != out[i] and tuple(out[i : i + 2]) not in zip(out[:i], out[1:i])
    ]
    cases = [(p, out, i, word) for p, out, i, word in pairs if tuple(out[i : i + 2]) in tokenize_bad_words(tok, [word])]
    assert cases, "no pair of the greedy outputs is a two-token bad word"
    prompt, out, i, word = cases[0]
    params = greedy(16, bad_words=[word])
    [expected] = run(plain, [prompt], params)
    assert expected[: i + 1] == out[: i + 1] and expected[i + 1] != out[i + 1]  # the ban acts at i + 1
    spec = make_llm(folder)
    spec.engine.proposer = ScriptedProposer({tuple(prompt): (out, 3)})
    assert run(spec, [prompt], params) == [expected]
    # every draft up to position i was kept (a included), b and all after it rejected
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens == sum(1 for j in range(1, i + 1) if j % 4)


def test_stop_strings_and_min_tokens_give_the_same_text_with_several_tokens_a_step(tiny_model_dirs):
    """A verification step keeps up to 4 tokens, so the ``min_tokens`` boundary often falls
    inside one step's tokens: the engine then detokenises the step in two parts
    (``OutputProcessor._update_text``), and a stop string counts only if it ends after the first
    ``min_tokens`` outputs, as one token at a time. Text, finish reason and stop reason
    equal a run without speculation for every boundary (the token ids may run past the
    stop string to the end of the step, as in vLLM)."""
    folder = tiny_model_dirs["qwen3"]
    plain, spec = make_llm(folder, None), make_llm(folder)
    prompts = [LOOP, PROMPTS[3]]  # greedy: " 1 1 1 ..." and 'ZZZZ"ateateate...', drafts kept 3 at a time
    for stop in (" 1 1", "1 1 1 1", "teat"):
        for min_tokens in range(9):
            params = greedy(24, stop=[stop], min_tokens=min_tokens)
            want = [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                    for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
            got = [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                   for o in spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
            assert got == want, (stop, min_tokens)
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("field, value", [("min_p", 0.1), ("logit_bias", {5: 1.0})])
def test_what_drafts_cannot_honour_is_refused(tiny_model_dirs, field, value):
    spec = make_llm(tiny_model_dirs["qwen3"])
    with pytest.raises(ValueError, match=f"{field}.*speculative decoding"):
        spec.generate({"prompt_token_ids": LOOP}, SamplingParams(max_tokens=2, **{field: value}), use_tqdm=False)
    assert not spec.engine.has_unfinished_requests()


def test_the_configuration_is_checked_up_front(tiny_model_dirs):
    folder = tiny_model_dirs["qwen3"]
    for bad, words in [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "method": "eagle"}, "'eagle'"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "4 > prompt_lookup_max 2"),
        ({"num_speculative_tokens": 2, "lookahead": 1}, "'lookahead'"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
    ]:
        with pytest.raises(ValueError, match=words):
            make_llm(folder, bad)
    with pytest.raises(TypeError, match="speculative_config"):
        make_llm(folder, "ngram")
    assert make_llm(folder, SpeculativeConfig(2)).speculative_config.prompt_lookup_max == 5


def test_stats_and_metrics_report_the_acceptance(tiny_model_dirs):
    """The scheduler's stats and ``/metrics`` (vLLM's ``vllm:spec_decode_*`` names) agree with
    the drafts verified and kept."""
    from serve_fixtures import require_serve_extra, running_server

    require_serve_extra()
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    spec = make_llm(tiny_model_dirs["qwen3"])
    with running_server(spec, "tiny") as (url, _app):
        response = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": LOOP, "max_tokens": 20,
                                                             "temperature": 0, "ignore_eos": True}, timeout=60)  # fmt: skip
        assert response.status_code == 200, response.text
        text = httpx.get(url + "/metrics").text
    samples = {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == stats.num_drafts
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))]
               for i in range(len(stats.num_accepted_tokens_per_pos))]  # fmt: skip
    assert per_pos == stats.num_accepted_tokens_per_pos and sum(per_pos) == stats.num_accepted_tokens
    report = spec.engine.scheduler.get_stats()
    assert report.spec_acceptance_rate == pytest.approx(stats.num_accepted_tokens / stats.num_draft_tokens)
    assert report.spec_mean_accepted_length == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--async-scheduling"]], ids=["sync", "async"])
def test_bench_spec_decode_dry_run_writes_its_record(tmp_path, flags):
    """``bench/spec_decode.py --dry-run``: both workloads at both batch sizes, the same greedy
    tokens with speculation on and off (the script refuses otherwise); figures mean nothing.
    ``--async-scheduling``: both engines schedule asynchronously, placeholder drafts."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "spec.json"
    proc = subprocess.run([sys.executable, str(root / "bench" / "spec_decode.py"), "--dry-run", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["dry_run"] is True and record["torch_threads"] == 1
    assert record["async_scheduling"] is bool(flags)
    assert set(record["workloads"]) == {"repeat", "random"}
    for by_batch in record["workloads"].values():
        assert set(by_batch) == {"batch_1", "batch_16"}
        for r in by_batch.values():
            assert r["output_tokens"] > 0 and r["speedup"] > 0 and 0 <= r["acceptance_rate"] <= 1
            assert r["accepted_tokens"] <= r["draft_tokens"]


# --8<-- [start:seeded_streams]
def seeded(max_tokens: int = 12, seed: int = 5, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.3, max_tokens=max_tokens, ignore_eos=True, seed=seed, **kw)


def test_a_prompt_chunk_gets_no_drafts_so_a_seeded_stream_ignores_its_neighbour(tiny_model_dirs):
    """The defect a fuzzer found: with a 10-token budget, a 10-token prompt beside a 1-token
    request is chunked 9 + 1; its last prompt token must be computed as a prefill, not
    verified with drafts proposed before it sampled anything, and its draws must be the
    ones it makes alone."""
    folder = tiny_model_dirs["qwen3"]
    target = LOOP[:10]
    alone = run(make_llm(folder, max_num_batched_tokens=10), [target], seeded())[0]
    llm = make_llm(folder, max_num_batched_tokens=10)
    drafted_in_prefill = []

    class Watch:  # every step: a request verifying drafts had its whole prompt computed before
        def on_step(self, engine, out, core_outputs, error):
            start = {c.req_id: c.num_computed_tokens for c in out.scheduled_cached_reqs}
            drafted_in_prefill.extend(rid for rid in out.scheduled_spec_decode_tokens if start[rid] < len(target))

    llm.engine.add_observer(Watch())
    outs = llm.generate([{"prompt_token_ids": [3]}, {"prompt_token_ids": target}], [greedy(4), seeded()], use_tqdm=False)
    assert drafted_in_prefill == []
    assert outs[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("budget", [2, 3, 64])
def test_a_seeded_stream_does_not_depend_on_how_many_drafts_the_budget_leaves(tiny_model_dirs, budget):
    """Each draw is keyed by the token's position in the request, so trimming a request's
    drafts (a budget of 2 leaves one draft, 3 two) or having none at all changes no token:
    the seeded stream with speculation equals the stream without it."""
    folder = tiny_model_dirs["qwen3"]
    without = run(make_llm(folder, None), [LOOP], seeded(16))[0]
    spec = make_llm(folder, max_num_batched_tokens=budget)
    assert run(spec, [LOOP], seeded(16))[0] == without
    assert spec.engine.scheduler.spec_stats.num_draft_tokens > 0
# --8<-- [end:seeded_streams]


def test_a_request_the_step_did_not_run_keeps_its_drafts(tiny_model_dirs):
    """The drafts of a request the budget left out of a step stay for the step that runs it: its
    tokens did not move, so they still guess its next ones. vLLM's runner proposes for the
    requests of its batch only, so theirs stay too (found by ``bench/vllm_scheduler_replay.py``);
    tinyvllm cleared every running request's drafts after each step. A proposer that always
    guesses three tokens makes the case: budget 8, three prompts of 3, 3 and 2 tokens all
    sample in step 0; in step 1 requests 0 and 1 take 1 + 3 tokens each, and 2 waits."""
    spec = make_llm(tiny_model_dirs["qwen3"], max_num_batched_tokens=8, max_num_seqs=3)
    engine, scheduler = spec.engine, spec.engine.scheduler
    engine.proposer.propose_batch = lambda requests: [[5, 6, 7] for _ in requests]
    for i, prompt in enumerate([[11, 12, 13], [21, 22, 23], [31, 32]]):
        engine.add_request(str(i), prompt, greedy(6))
    scheduled = []
    real_schedule = scheduler.schedule
    scheduler.schedule = lambda: scheduled.append(out := real_schedule()) or out
    engine.step()
    assert [scheduler.requests[str(i)].spec_token_ids for i in range(3)] == [[5, 6, 7]] * 3
    engine.step()
    assert dict(scheduled[1].num_scheduled_tokens) == {"0": 4, "1": 4}  # request 2 left out
    assert scheduler.requests["2"].spec_token_ids == [5, 6, 7]
    while "2" not in scheduled[-1].num_scheduled_tokens:
        engine.step()
    assert scheduled[-1].scheduled_spec_decode_tokens["2"] == (5, 6, 7)  # verified when it runs at last
