"""Properties of the CUDA-graph dispatcher and of the mode downgrade, over drawn configs.

Concept: ``CudagraphDispatcher`` is a pure decision (no torch), so every rule the seed
states about it can be checked against an expectation computed here, from the rules
alone, never by asking the code under test. Drawn: capture-size lists (empty, unsorted,
with duplicates), ``max_num_seqs``, every ``CUDAGraphMode``, the uniform decode query
length 1..4, token counts (capture sizes, their neighbours, and counts past the largest
size), the batch's uniform query length (none, 1, 1 + k or another) and the
cascade-attention flag.

Follows: seed 000, vLLM design doc "CUDA Graphs" (based on vLLM PR #20059), sections
"CudagraphModes", "BatchDescriptor", "CudagraphDispatcher" and "Attention 后端对 CUDA 图的
兼容性" (the downgrade of a mode to what the attention backend supports).

Checked: the padded size is the smallest capture size that holds the batch (the count
itself when the batch runs eagerly); a returned key is in ``cudagraph_keys[mode]``, the
mode a runtime mode; FULL is never passed over for PIECEWISE or NONE when a FULL key fits
the padded batch, and a uniform key of the batch's query length is preferred to the mixed
FULL one (uniform keys for lengths 1 and q, the dispatcher's NOTE 4); cascade attention
never gets FULL; the whole decision equals an independent decision table; the key sets
equal the ones built from the seed's rules (also after re-initialising with another
mode); ``check_invariants`` holds; ``get_capture_descs`` lists PIECEWISE before FULL,
largest first, exactly the key sets; the mode methods match their definition table.
``resolve_cudagraph_mode``: no FULL graphs with NEVER support, a FULL mixed routine only
with ALWAYS, no piecewise graphs when they are unavailable, no FULL graphs that were not asked
for, idempotent, and a mode the backend can run comes back unchanged; uniform keys of
more than one token per request only with UNIFORM_BATCH or better.

NOTE 1 (the downgrade is enumerated, not sampled): ``resolve_cudagraph_mode`` has
5 modes x 4 support levels x 2 x 4 query lengths = 160 inputs, so each of its properties
runs on all of them, which 25 Hypothesis examples would not.
NOTE 2 (what "a FULL key fits" means): the key of the padded batch itself, as the seed
defines it: for a uniform decode batch of ``u`` tokens per request
``BatchDescriptor(p, p // u, uniform=True)`` when ``u`` divides the padded size ``p``, for any batch the mixed FULL key
``BatchDescriptor(p, min(p, max_num_seqs))``. A FULL graph of a larger capture size is not
"fitting": the dispatcher pads to the smallest size only.
NOTE 3 (more examples for dispatch): the dispatch properties run at least 200 examples,
also under the bounded ``ci`` profile; each costs microseconds, and 25 derandomized
examples almost never reach a uniform FULL key.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tinyvllm.worker.cudagraph_dispatcher import (
    AttentionCGSupport,
    BatchDescriptor,
    CUDAGraphMode,
    CudagraphDispatcher,
    pad_to_capture_size,
    resolve_cudagraph_mode,
    uniform_decode_query_lens,
)

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
FULL_DECODE_ONLY, FULL_AND_PIECEWISE = CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE

# The seed's table, written out here (not read from the enum): (decode routine, mixed routine).
ROUTINES = {
    NONE: (NONE, NONE),
    PIECEWISE: (PIECEWISE, PIECEWISE),
    FULL: (FULL, FULL),
    FULL_DECODE_ONLY: (FULL, NONE),
    FULL_AND_PIECEWISE: (FULL, PIECEWISE),
}
SEPARATE = {FULL_DECODE_ONLY, FULL_AND_PIECEWISE}
assert set(ROUTINES) == set(CUDAGraphMode), "a CUDAGraphMode is missing from the test's table"


# ---------------------------------------------------------------------------------------
# Independent models
# ---------------------------------------------------------------------------------------


def smallest_size_holding(sizes: list[int], num_tokens: int) -> int | None:
    """The smallest capture size >= ``num_tokens``, by a linear scan; None past the largest."""
    holding = [s for s in sizes if s >= num_tokens]
    return min(holding) if holding else None


def expected_keys(sizes: list[int], max_num_seqs: int, mode: CUDAGraphMode, q: int) -> dict:
    """The key sets from the seed's rules (module header of ``cudagraph_dispatcher``)."""
    decode, mixed = ROUTINES[mode]
    piecewise, full = set(), set()
    for size in set(sizes):
        if mixed == PIECEWISE:
            piecewise.add(BatchDescriptor(size))
        elif mixed == FULL:
            full.add(BatchDescriptor(size, min(size, max_num_seqs)))
        for n in {1, q}:  # a step without drafts and one with k = q - 1 drafts per request
            if mode in SEPARATE and decode == FULL and n <= size <= n * max_num_seqs and size % n == 0:
                full.add(BatchDescriptor(size, size // n, uniform=True))
    return {PIECEWISE: piecewise, FULL: full}


def fitting_full_keys(keys: dict, padded: int, max_num_seqs: int, u: int) -> list:
    """NOTE 2: the FULL keys (uniform one first) that fit a batch padded to ``padded`` whose
    requests have ``u`` tokens each (0: a mixed batch)."""
    fits = []
    if u and padded % u == 0 and BatchDescriptor(padded, padded // u, uniform=True) in keys[FULL]:
        fits.append(BatchDescriptor(padded, padded // u, uniform=True))
    if BatchDescriptor(padded, min(padded, max_num_seqs)) in keys[FULL]:
        fits.append(BatchDescriptor(padded, min(padded, max_num_seqs)))
    return fits


def expected_dispatch(sizes, max_num_seqs, mode, q, num_tokens, uniform, cascade):
    """The whole decision as a table: FULL (uniform key first) > PIECEWISE > NONE."""
    padded = smallest_size_holding(sizes, num_tokens)
    eager = (NONE, BatchDescriptor(num_tokens))
    if padded is None or mode == NONE:
        return eager
    keys = expected_keys(sizes, max_num_seqs, mode, q)
    fits = fitting_full_keys(keys, padded, max_num_seqs, uniform)
    if fits and not cascade:
        return FULL, fits[0]
    if BatchDescriptor(padded) in keys[PIECEWISE]:
        return PIECEWISE, BatchDescriptor(padded)
    return eager


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

CAPTURE_SIZES = st.lists(st.integers(1, 24), min_size=0, max_size=8)  # unsorted, duplicates, empty
SOME_CAPTURE_SIZES = st.lists(st.integers(1, 24), min_size=1, max_size=8)  # unsorted, duplicates
MODES = st.sampled_from(list(CUDAGraphMode))
QUERY_LENS = st.integers(1, 4)


# NOTE 3: a dispatch example costs microseconds; 25 of them rarely reach a uniform FULL key.
MANY = settings(max_examples=max(200, settings.default.max_examples))
FULL_MODES = st.sampled_from([FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE])


@st.composite
def scenarios(draw, modes=MODES, cascade=st.integers(0, 3).map(lambda i: i == 0)):
    """A dispatcher config and one batch: (sizes, max_num_seqs, mode, q, num_tokens, uniform,
    cascade); ``uniform`` is the batch's tokens per request, 0 for a mixed batch."""
    q = draw(QUERY_LENS)
    sizes = draw(st.one_of(SOME_CAPTURE_SIZES, st.just([])) if draw(st.integers(0, 9)) == 0 else SOME_CAPTURE_SIZES)
    sizes += draw(st.lists(st.integers(1, 6).map(lambda r: r * q), max_size=3))  # sizes a uniform key can use
    max_num_seqs = draw(st.integers(1, 16))
    mode = draw(modes)
    top = max(sizes, default=1)
    # uniform decode batches are the common case: 1 + k tokens per request, or 1 (no drafts)
    uniform = draw(st.sampled_from([0, q, q, 1, 1, 2]))
    choices = [st.integers(1, top), st.integers(top + 1, top + 8)]  # the second: past the largest size
    if sizes:
        choices.append(st.sampled_from(sizes).flatmap(lambda s: st.sampled_from([s, max(1, s - 1), s + 1])))
    if uniform:  # a real uniform decode batch has num_reqs * uniform tokens
        choices += [st.integers(1, max(1, top // uniform)).map(lambda r: r * uniform)] * 2
    num_tokens = draw(st.one_of(*choices))
    return sizes, max_num_seqs, mode, q, num_tokens, uniform, draw(cascade)


def describe(sizes, max_num_seqs, mode, q, n, uniform, cascade) -> str:
    return f"sizes={sizes} max_num_seqs={max_num_seqs} mode={mode.name} q={q} n={n} uniform={uniform} cascade={cascade}"


def dispatch(dispatcher: CudagraphDispatcher, n: int, uniform: int, cascade: bool):
    """``dispatch`` for a batch of ``uniform`` tokens per request (0: mixed)."""
    return dispatcher.dispatch(n, uniform > 0, cascade, uniform_query_len=uniform or None)


def make_dispatcher(sizes, max_num_seqs, mode, q) -> CudagraphDispatcher:
    dispatcher = CudagraphDispatcher(sizes, max_num_seqs)
    dispatcher.initialize_cudagraph_keys(mode, uniform_decode_query_len=q)
    return dispatcher


# ---------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------


@pytest.mark.seed("000:dispatcher")
@MANY
@given(scenarios())
def test_cudagraph_dispatch_pads_to_smallest_size(scenario):
    sizes, max_num_seqs, mode, q, n, uniform, cascade = scenario
    got_mode, desc = dispatch(make_dispatcher(sizes, max_num_seqs, mode, q), n, uniform, cascade)
    padded = smallest_size_holding(sizes, n)
    event(f"{mode.name} dispatched {got_mode.name}")
    where = describe(sizes, max_num_seqs, mode, q, n, uniform, cascade)
    if padded is None or mode == NONE:
        assert (got_mode, desc) == (NONE, BatchDescriptor(n)), f"{where}: got {got_mode.name} {desc}, want eager"
    elif got_mode == NONE:
        assert desc == BatchDescriptor(n), f"{where}: eager run with {desc}, want the unpadded count {n}"
    else:
        assert desc.num_tokens == padded, f"{where}: {got_mode.name} key {desc} is not padded to {padded}"
    assert pad_to_capture_size(n, sorted(set(sizes))) == padded, f"{where}: pad_to_capture_size != {padded}"


@pytest.mark.seed("000:dispatcher")
@MANY
@given(scenarios())
def test_cudagraph_dispatch_key_is_in_key_set(scenario):
    sizes, max_num_seqs, mode, q, n, uniform, cascade = scenario
    dispatcher = make_dispatcher(sizes, max_num_seqs, mode, q)
    got_mode, desc = dispatch(dispatcher, n, uniform, cascade)
    assert got_mode in {NONE, PIECEWISE, FULL}, f"dispatch returned the non-runtime mode {got_mode.name}"
    assert got_mode in CUDAGraphMode.valid_runtime_modes(), f"{got_mode.name} not in valid_runtime_modes()"
    if got_mode != NONE:
        assert desc in dispatcher.cudagraph_keys[got_mode], (
            f"sizes={sizes} mode={mode.name} q={q} n={n}: key {desc} not in "
            f"cudagraph_keys[{got_mode.name}]={sorted(dispatcher.cudagraph_keys[got_mode])}"
        )
        assert got_mode in ROUTINES[mode], f"{mode.name} dispatched {got_mode.name}, a routine it does not have"


@pytest.mark.seed("000:dispatcher")
@MANY
@given(scenarios(modes=FULL_MODES, cascade=st.just(False)))
def test_cudagraph_dispatch_never_passes_over_full(scenario):
    sizes, max_num_seqs, mode, q, n, uniform, cascade = scenario
    got = dispatch(make_dispatcher(sizes, max_num_seqs, mode, q), n, uniform, cascade)
    padded = smallest_size_holding(sizes, n)
    if padded is None:
        return
    fits = fitting_full_keys(expected_keys(sizes, max_num_seqs, mode, q), padded, max_num_seqs, uniform)
    event(f"FULL fits: {[d.uniform for d in fits]}")
    if fits:
        where = describe(sizes, max_num_seqs, mode, q, n, uniform, cascade)
        assert got == (FULL, fits[0]), f"{where}: FULL keys {fits} fit, dispatch returned {got}"


@pytest.mark.seed("000:modes")
@MANY
@given(scenarios(cascade=st.just(True)))
def test_cudagraph_cascade_attention_never_gets_full(scenario):
    sizes, max_num_seqs, mode, q, n, uniform, _ = scenario
    dispatcher = make_dispatcher(sizes, max_num_seqs, mode, q)
    got_mode, desc = dispatch(dispatcher, n, uniform, True)
    assert got_mode != FULL, f"sizes={sizes} mode={mode.name} q={q} n={n} uniform={uniform}: cascade got FULL {desc}"
    padded = smallest_size_holding(sizes, n)
    if padded is not None and ROUTINES[mode][1] == PIECEWISE:  # a piecewise graph still serves it
        want = (PIECEWISE, BatchDescriptor(padded))
        assert (got_mode, desc) == want, f"cascade batch of {n}, mode {mode.name}: got {got_mode.name} {desc}"


@pytest.mark.seed("000:dispatcher")
@MANY
@given(scenarios())
def test_cudagraph_dispatch_matches_independent_decision_table(scenario):
    sizes, max_num_seqs, mode, q, n, uniform, cascade = scenario
    got = dispatch(make_dispatcher(sizes, max_num_seqs, mode, q), n, uniform, cascade)
    want = expected_dispatch(sizes, max_num_seqs, mode, q, n, uniform, cascade)
    where = describe(sizes, max_num_seqs, mode, q, n, uniform, cascade)
    assert got == want, f"{where}: dispatch gave {got}, the table says {want}"


@given(sizes=CAPTURE_SIZES, max_num_seqs=st.integers(1, 16))
def test_cudagraph_dispatch_before_keys_is_eager(sizes, max_num_seqs):
    dispatcher = CudagraphDispatcher(sizes, max_num_seqs)
    for n in range(1, max(sizes, default=1) + 2):
        got = dispatcher.dispatch(n, uniform_decode=True)
        assert got == (NONE, BatchDescriptor(n)), f"sizes={sizes}: dispatch({n}) before the keys exist gave {got}"


# ---------------------------------------------------------------------------------------
# Key sets
# ---------------------------------------------------------------------------------------


@given(sizes=CAPTURE_SIZES, max_num_seqs=st.integers(1, 16), q=QUERY_LENS)
def test_cudagraph_check_invariants_hold_for_every_mode(sizes, max_num_seqs, q):
    dispatcher = CudagraphDispatcher(sizes, max_num_seqs)
    for mode in CUDAGraphMode:  # also re-initialising one dispatcher, mode after mode
        dispatcher.initialize_cudagraph_keys(mode, uniform_decode_query_len=q)
        dispatcher.check_invariants()
        for n in range(1, max(sizes, default=1) + 2):  # dispatch must not disturb them
            dispatch(dispatcher, n, (1, 0, q)[n % 3], n % 4 == 0)
        dispatcher.check_invariants()
    assert dispatcher.capture_sizes == sorted(set(sizes)), f"{sizes} -> capture_sizes {dispatcher.capture_sizes}"


@pytest.mark.seed("000:dispatcher")
@given(
    sizes=CAPTURE_SIZES, max_num_seqs=st.integers(1, 16), mode=MODES, q=QUERY_LENS, before=MODES, q_before=QUERY_LENS
)
def test_cudagraph_key_sets_match_independent_model(sizes, max_num_seqs, mode, q, before, q_before):
    fresh = make_dispatcher(sizes, max_num_seqs, mode, q)
    reinit = make_dispatcher(sizes, max_num_seqs, before, q_before)
    reinit.initialize_cudagraph_keys(mode, uniform_decode_query_len=q)  # no key of `before` survives
    want = expected_keys(sizes, max_num_seqs, mode, q)
    for name, dispatcher in (("fresh", fresh), (f"re-initialised from {before.name}/q={q_before}", reinit)):
        got = dispatcher.cudagraph_keys
        assert set(got) == {PIECEWISE, FULL}, f"{name}: cudagraph_keys has modes {set(got)}"
        for m in (PIECEWISE, FULL):
            assert got[m] == want[m], (
                f"{name} sizes={sizes} max_num_seqs={max_num_seqs} mode={mode.name} q={q}: {m.name} keys "
                f"missing {sorted(want[m] - got[m])}, extra {sorted(got[m] - want[m])}"
            )


@pytest.mark.seed("000:capture")
@given(sizes=CAPTURE_SIZES, max_num_seqs=st.integers(1, 16), mode=MODES, q=QUERY_LENS)
def test_cudagraph_capture_descs_order_and_cover_key_sets(sizes, max_num_seqs, mode, q):
    descs = make_dispatcher(sizes, max_num_seqs, mode, q).get_capture_descs()
    want = expected_keys(sizes, max_num_seqs, mode, q)
    modes = [m for m, _ in descs]
    assert modes == [m for m in (PIECEWISE, FULL) if want[m]], f"mode={mode.name} sizes={sizes}: capture order {modes}"
    for m, listed in descs:
        counts = [d.num_tokens for d in listed]
        assert counts == sorted(counts, reverse=True), f"{m.name} captures not largest first: {counts}"
        assert len(listed) == len(set(listed)), f"{m.name} captures a key twice: {listed}"
        assert set(listed) == want[m], f"{m.name}: captures {sorted(listed)}, key set {sorted(want[m])}"


@pytest.mark.seed("000:modes")
def test_cudagraph_mode_methods_match_definition_table():
    for mode, (decode, mixed) in ROUTINES.items():
        assert (mode.decode_mode(), mode.mixed_mode()) == (decode, mixed), f"{mode.name} routines"
        assert mode.separate_routine() == (mode in SEPARATE), f"{mode.name}.separate_routine()"
        for single in (NONE, PIECEWISE, FULL):
            assert mode.has_mode(single) == (single in (decode, mixed)), f"{mode.name}.has_mode({single.name})"
        assert mode.has_full_cudagraphs() == (FULL in (decode, mixed)), f"{mode.name}.has_full_cudagraphs()"
        assert mode.has_piecewise_cudagraphs() == (PIECEWISE in (decode, mixed)), f"{mode.name}.has_piecewise"
    assert CUDAGraphMode.valid_runtime_modes() == {NONE, PIECEWISE, FULL}
    for tuple_mode in SEPARATE:
        try:
            FULL.has_mode(tuple_mode)
        except ValueError:
            continue
        raise AssertionError(f"has_mode({tuple_mode.name}) accepted a two-routine mode")


# ---------------------------------------------------------------------------------------
# resolve_cudagraph_mode (NOTE 1: all 160 inputs)
# ---------------------------------------------------------------------------------------

ALWAYS, UNIFORM_BATCH = AttentionCGSupport.ALWAYS, AttentionCGSupport.UNIFORM_BATCH
SINGLE_TOKEN, NEVER = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, AttentionCGSupport.NEVER
SUPPORT_RANK = {NEVER: 0, SINGLE_TOKEN: 1, UNIFORM_BATCH: 2, ALWAYS: 3}  # the seed's order
RESOLVE_INPUTS = list(itertools.product(CUDAGraphMode, AttentionCGSupport, (True, False), (1, 2, 3, 4)))


def backend_can_run(mode, support, piecewise_available, q) -> bool:
    """The seed's compatibility rules, from the routines table."""
    decode, mixed = ROUTINES[mode]
    if FULL in (decode, mixed) and support == NEVER:
        return False
    if mixed == FULL and support != ALWAYS:
        return False
    return piecewise_available or PIECEWISE not in (decode, mixed)


def resolve_failures(check) -> list:
    """The inputs (with their result) on which ``check(inputs, result)`` is False."""
    bad = []
    for mode, support, pw, q in RESOLVE_INPUTS:
        result = resolve_cudagraph_mode(mode, support, piecewise_available=pw, uniform_decode_query_len=q)
        if not check((mode, support, pw, q), result):
            bad.append(f"{mode.name}/{support.name}/piecewise={pw}/q={q} -> {result.name}")
    return bad


@pytest.mark.seed("000:cgsupport")
def test_cudagraph_resolve_result_is_runnable_by_backend():
    bad = resolve_failures(lambda inp, r: backend_can_run(r, inp[1], inp[2], inp[3]))
    assert not bad, f"resolve returned modes the backend cannot run: {bad}"


@pytest.mark.seed("000:cgsupport")
def test_cudagraph_resolve_no_full_graphs_with_never_support():
    bad = resolve_failures(lambda inp, r: inp[1] != NEVER or FULL not in ROUTINES[r])
    assert not bad, f"FULL graphs with NEVER support: {bad}"


@pytest.mark.seed("000:cgsupport")
def test_cudagraph_resolve_mixed_full_only_with_always():
    bad = resolve_failures(lambda inp, r: ROUTINES[r][1] != FULL or inp[1] == ALWAYS)
    assert not bad, f"a FULL mixed routine without ALWAYS support: {bad}"


@pytest.mark.seed("000:cgsupport")
def test_cudagraph_resolve_no_piecewise_when_unavailable():
    bad = resolve_failures(lambda inp, r: inp[2] or PIECEWISE not in ROUTINES[r])
    assert not bad, f"piecewise graphs although piecewise_available=False: {bad}"


@pytest.mark.seed("000:cgsupport")
def test_cudagraph_resolve_adds_no_full_graphs():
    bad = resolve_failures(lambda inp, r: FULL in ROUTINES[inp[0]] or FULL not in ROUTINES[r])
    assert not bad, f"FULL graphs that were not asked for: {bad}"


def test_cudagraph_resolve_is_idempotent():
    def again(inp, r):
        return resolve_cudagraph_mode(r, inp[1], piecewise_available=inp[2], uniform_decode_query_len=inp[3]) == r

    bad = resolve_failures(again)
    assert not bad, f"resolving the result again changes it: {bad}"


@pytest.mark.seed("000:cgsupport")
def test_cudagraph_resolve_keeps_a_mode_the_backend_can_run():
    bad = resolve_failures(lambda inp, r: not backend_can_run(*inp) or r == inp[0])
    assert not bad, f"a runnable mode was changed: {bad}"
    always = resolve_failures(lambda inp, r: inp[1] != ALWAYS or not inp[2] or r == inp[0])
    assert not always, f"ALWAYS support with piecewise graphs changed the mode: {always}"


@pytest.mark.seed("000:cgsupport")
def test_cudagraph_uniform_keys_of_several_tokens_only_with_uniform_batch():
    for support, q in itertools.product(AttentionCGSupport, (1, 2, 3, 4)):
        lens = uniform_decode_query_lens(q, support)
        multi = SUPPORT_RANK[support] >= SUPPORT_RANK[UNIFORM_BATCH] and q > 1
        assert lens == ((1, q) if multi else (1,)), f"{support.name}/q={q} -> {lens}"


def test_cudagraph_resolve_rejects_query_len_below_one():
    try:
        resolve_cudagraph_mode(FULL, ALWAYS, uniform_decode_query_len=0)
    except ValueError:
        return
    raise AssertionError("uniform_decode_query_len=0 was accepted")
