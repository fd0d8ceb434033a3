"""The CUDA-graph dispatcher, rule by rule, as seed 000 (vLLM's "CUDA Graphs" design doc)
states them: the five modes, the key sets, dispatch priority and padding, cascade
attention, the downgrade table, capture order."""

import logging

import pytest

from tinyvllm.worker.cudagraph_dispatcher import (
    AttentionCGSupport,
    BatchDescriptor,
    CUDAGraphMode,
    CudagraphDispatcher,
    common_query_len,
    default_capture_sizes,
    pad_to_capture_size,
    resolve_cudagraph_mode,
    uniform_decode_query_lens,
)

M = CUDAGraphMode
S = AttentionCGSupport


# -- "CudagraphModes": single modes and the two dual modes ----------------------------------


@pytest.mark.seed("000:modes")
@pytest.mark.parametrize(
    "mode, decode, mixed, separate",
    [
        (M.NONE, M.NONE, M.NONE, False),
        (M.PIECEWISE, M.PIECEWISE, M.PIECEWISE, False),
        (M.FULL, M.FULL, M.FULL, False),
        (M.FULL_DECODE_ONLY, M.FULL, M.NONE, True),
        (M.FULL_AND_PIECEWISE, M.FULL, M.PIECEWISE, True),
    ],
)
def test_cudagraph_mode_routines(mode, decode, mixed, separate):
    assert (mode.decode_mode(), mode.mixed_mode(), mode.separate_routine()) == (decode, mixed, separate)


@pytest.mark.seed("000:modes")
def test_cudagraph_mode_values_are_vllms():
    assert [m.value for m in M] == [0, 1, 2, (2, 0), (2, 1)]
    assert M.valid_runtime_modes() == frozenset({M.NONE, M.PIECEWISE, M.FULL})


@pytest.mark.seed("000:modes")
@pytest.mark.parametrize(
    "mode, has_full, has_piecewise",
    [
        (M.NONE, False, False),
        (M.PIECEWISE, False, True),
        (M.FULL, True, False),
        (M.FULL_DECODE_ONLY, True, False),
        (M.FULL_AND_PIECEWISE, True, True),
    ],
)
def test_cudagraph_mode_has_mode(mode, has_full, has_piecewise):
    assert mode.has_full_cudagraphs() is has_full and mode.has_mode(M.FULL) is has_full
    assert mode.has_piecewise_cudagraphs() is has_piecewise and mode.has_mode(M.PIECEWISE) is has_piecewise
    assert mode.has_mode(M.NONE) is (mode in (M.NONE, M.FULL_DECODE_ONLY))
    with pytest.raises(ValueError, match="single mode"):
        mode.has_mode(M.FULL_AND_PIECEWISE)


@pytest.mark.seed("000:descriptor")
def test_cudagraph_batch_descriptor_defaults_and_hashing():
    desc = BatchDescriptor(8)
    assert desc == (8, None, False, False)
    assert {BatchDescriptor(8, 8, uniform=True): "a"}[BatchDescriptor(8, 8, True)] == "a"
    assert BatchDescriptor(8, 8, uniform=True) != BatchDescriptor(8, 8)


@pytest.mark.seed("000:descriptor")
def test_cudagraph_a_uniform_key_says_its_query_length():
    # 8 tokens as 8 single-token decodes, or as 2 requests verifying 3 drafts each: two keys
    assert BatchDescriptor(8, 8, uniform=True).uniform_query_len == 1
    assert BatchDescriptor(8, 2, uniform=True).uniform_query_len == 4
    assert BatchDescriptor(8, 8).uniform_query_len is None and BatchDescriptor(8).uniform_query_len is None


# -- padding -----------------------------------------------------------------------------------


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_pad_to_capture_size():
    sizes = [1, 2, 4, 8, 16]
    assert [pad_to_capture_size(n, sizes) for n in (1, 3, 4, 5, 16, 17)] == [1, 4, 4, 8, 16, None]


@pytest.mark.seed("000:usage")
def test_cudagraph_default_capture_sizes_are_vllms():
    sizes = default_capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-3:] == [480, 496, 512]
    assert 248 in sizes and 256 in sizes and 264 not in sizes  # step 8 below 256, then 16
    assert default_capture_sizes(10) == [1, 2, 4, 8]


# -- initialize_cudagraph_keys -----------------------------------------------------------------


def keys(mode, sizes=(1, 2, 4, 8), max_num_seqs=4, q=1):
    d = CudagraphDispatcher(sizes, max_num_seqs)
    d.initialize_cudagraph_keys(mode, q)
    return d, d.cudagraph_keys[M.PIECEWISE], d.cudagraph_keys[M.FULL]


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_keys_full_and_piecewise():
    _, piecewise, full = keys(M.FULL_AND_PIECEWISE)
    assert piecewise == {BatchDescriptor(n) for n in (1, 2, 4, 8)}  # num_reqs=None, uniform=False
    # uniform decode keys for 1 <= size <= 1 * max_num_seqs only: 8 tokens cannot be 8 decodes
    assert full == {BatchDescriptor(n, n, uniform=True) for n in (1, 2, 4)}


@pytest.mark.seed("000:dispatcher", "000:descriptor")
def test_cudagraph_keys_full_mixed_carry_the_request_count():
    _, piecewise, full = keys(M.FULL)
    assert piecewise == set()
    assert full == {BatchDescriptor(1, 1), BatchDescriptor(2, 2), BatchDescriptor(4, 4), BatchDescriptor(8, 4)}


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_keys_full_decode_only_and_spec_decode_query_len():
    _, piecewise, full = keys(M.FULL_DECODE_ONLY)
    assert piecewise == set() and full == {BatchDescriptor(n, n, uniform=True) for n in (1, 2, 4)}
    d, _, full = keys(M.FULL_DECODE_ONLY, sizes=(1, 2, 3, 4, 6, 8, 10), max_num_seqs=4, q=2)
    # NOTE 4: 1 + num_spec_tokens = 2 tokens per request (sizes 2..8 that are multiples of 2)
    # and 1 token per request, a step without drafts (sizes 1..4)
    assert d.uniform_decode_query_lens == (1, 2)
    spec = {BatchDescriptor(n, n // 2, uniform=True) for n in (2, 4, 6, 8)}
    assert full == spec | {BatchDescriptor(n, n, uniform=True) for n in (1, 2, 3, 4)}


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_keys_for_the_query_lengths_asked_for():
    d = CudagraphDispatcher((1, 2, 4, 8), 4)
    d.initialize_cudagraph_keys(M.FULL_DECODE_ONLY, 4, uniform_decode_query_lens=[4])
    assert d.uniform_decode_query_lens == (4,)
    assert d.cudagraph_keys[M.FULL] == {BatchDescriptor(4, 1, uniform=True), BatchDescriptor(8, 2, uniform=True)}
    d.initialize_cudagraph_keys(M.FULL_DECODE_ONLY, 4, uniform_decode_query_lens=[1])
    assert d.cudagraph_keys[M.FULL] == {BatchDescriptor(n, n, uniform=True) for n in (1, 2, 4)}
    with pytest.raises(ValueError, match="every uniform decode query length must be an int >= 1, got 0"):
        d.initialize_cudagraph_keys(M.FULL_DECODE_ONLY, 4, uniform_decode_query_lens=[0])
    with pytest.raises(ValueError, match=r"uniform_decode_query_lens must not be empty"):
        d.initialize_cudagraph_keys(M.FULL_DECODE_ONLY, 4, uniform_decode_query_lens=[])


@pytest.mark.seed("000:cgsupport")
def test_cudagraph_uniform_decode_query_lens_follow_the_backends_support():
    assert uniform_decode_query_lens(1, S.UNIFORM_SINGLE_TOKEN_DECODE) == (1,)
    assert uniform_decode_query_lens(4, S.UNIFORM_BATCH) == (1, 4)
    assert uniform_decode_query_lens(4, S.ALWAYS) == (1, 4)
    # NOTE 4: a single-token backend keeps its FULL graphs for steps without drafts
    assert uniform_decode_query_lens(4, S.UNIFORM_SINGLE_TOKEN_DECODE) == (1,)
    with pytest.raises(ValueError, match="uniform_decode_query_len must be >= 1, got 0"):
        uniform_decode_query_lens(0, S.ALWAYS)


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_keys_none_and_piecewise():
    _, piecewise, full = keys(M.NONE)
    assert piecewise == set() and full == set()
    _, piecewise, full = keys(M.PIECEWISE)
    assert piecewise == {BatchDescriptor(n) for n in (1, 2, 4, 8)} and full == set()


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_dispatcher_sizes_sorted_unique_and_checked():
    d = CudagraphDispatcher([8, 2, 4, 2, 1], 4)
    assert d.capture_sizes == [1, 2, 4, 8]
    for bad in ([0], [-4], [2.5], [True]):
        with pytest.raises(ValueError, match="capture size"):
            CudagraphDispatcher(bad, 4)
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1, got 0"):
        CudagraphDispatcher([1], 0)


# -- dispatch: FULL > PIECEWISE > NONE --------------------------------------------------------


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_dispatch_priority_and_padding():
    d, _, _ = keys(M.FULL_AND_PIECEWISE)
    assert d.dispatch(3, uniform_decode=True) == (M.FULL, BatchDescriptor(4, 4, uniform=True))
    assert d.dispatch(3) == (M.PIECEWISE, BatchDescriptor(4))  # mixed: pieces only
    assert d.dispatch(5) == (M.PIECEWISE, BatchDescriptor(8))  # mixed, padded to 8
    assert d.dispatch(9) == (M.NONE, BatchDescriptor(9))  # past the largest size: eager, unpadded
    # 5 decodes need max_num_seqs >= 5 (with 4 they cannot occur). Padded to 8 they have no
    # uniform key: 8 decodes would be more than 5 requests.
    d, _, _ = keys(M.FULL_AND_PIECEWISE, max_num_seqs=5)
    assert d.dispatch(5, uniform_decode=True) == (M.PIECEWISE, BatchDescriptor(8))


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_dispatch_picks_the_uniform_key_of_the_batchs_query_length():
    """Speculation with 3 drafts: a step in which every request verifies 3 drafts takes the
    key of 4 tokens per request, a step in which no request has drafts the key of 1."""
    d, _, _ = keys(M.FULL_AND_PIECEWISE, q=4)
    assert d.dispatch(8, uniform_decode=True) == (M.FULL, BatchDescriptor(8, 2, uniform=True))
    assert d.dispatch(8, uniform_decode=True, uniform_query_len=4) == (M.FULL, BatchDescriptor(8, 2, uniform=True))
    assert d.dispatch(3, uniform_decode=True, uniform_query_len=1) == (M.FULL, BatchDescriptor(4, 4, uniform=True))
    assert d.dispatch(4, uniform_decode=True, uniform_query_len=1) == (M.FULL, BatchDescriptor(4, 4, uniform=True))
    assert d.dispatch(3) == (M.PIECEWISE, BatchDescriptor(4))  # mixed: as before
    # a length with no keys (2 tokens per request: one draft left by the budget) is mixed
    assert d.dispatch(4, uniform_decode=True, uniform_query_len=2) == (M.PIECEWISE, BatchDescriptor(4))
    with pytest.raises(ValueError, match="uniform_query_len=1 needs uniform_decode=True"):
        d.dispatch(4, uniform_query_len=1)
    with pytest.raises(ValueError, match="uniform_query_len must be an int >= 1, got 0"):
        d.dispatch(4, uniform_decode=True, uniform_query_len=0)


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_dispatch_uniform_batch_may_take_a_mixed_full_graph():
    d, _, _ = keys(M.FULL)
    assert d.dispatch(3, uniform_decode=True) == (M.FULL, BatchDescriptor(4, 4))
    assert d.dispatch(6) == (M.FULL, BatchDescriptor(8, 4))


@pytest.mark.seed("000:modes", "000:dispatcher")
def test_cudagraph_dispatch_full_decode_only_runs_mixed_batches_eagerly():
    d, _, _ = keys(M.FULL_DECODE_ONLY)
    assert d.dispatch(2, uniform_decode=True) == (M.FULL, BatchDescriptor(2, 2, uniform=True))
    assert d.dispatch(2) == (M.NONE, BatchDescriptor(2))


@pytest.mark.seed("000:modes")
def test_cudagraph_dispatch_cascade_attention_never_gets_full():
    d, _, _ = keys(M.FULL_AND_PIECEWISE)
    assert d.dispatch(2, uniform_decode=True, use_cascade_attn=True) == (M.PIECEWISE, BatchDescriptor(2))
    d, _, _ = keys(M.FULL)
    assert d.dispatch(2, use_cascade_attn=True) == (M.NONE, BatchDescriptor(2))


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_dispatch_mode_none_and_uninitialised():
    d = CudagraphDispatcher([1, 2, 4], 4)
    assert d.dispatch(3, uniform_decode=True) == (M.NONE, BatchDescriptor(3))  # keys not initialised
    d.initialize_cudagraph_keys(M.NONE)
    assert d.dispatch(3) == (M.NONE, BatchDescriptor(3))
    with pytest.raises(ValueError, match="num_tokens must be an int >= 1, got 0"):
        d.dispatch(0)


# -- capture order -----------------------------------------------------------------------------


@pytest.mark.seed("000:capture")
def test_cudagraph_capture_descs_piecewise_first_largest_first():
    d, _, _ = keys(M.FULL_AND_PIECEWISE)
    assert d.get_capture_descs() == [
        (M.PIECEWISE, [BatchDescriptor(8), BatchDescriptor(4), BatchDescriptor(2), BatchDescriptor(1)]),
        (M.FULL, [BatchDescriptor(4, 4, True), BatchDescriptor(2, 2, True), BatchDescriptor(1, 1, True)]),
    ]
    d, _, _ = keys(M.FULL_DECODE_ONLY, sizes=(1, 2, 4), q=2)  # both lengths at 2 and 4 tokens
    assert d.get_capture_descs() == [
        (M.FULL, [BatchDescriptor(4, 4, True), BatchDescriptor(4, 2, True), BatchDescriptor(2, 2, True),
                  BatchDescriptor(2, 1, True), BatchDescriptor(1, 1, True)]),
    ]  # fmt: skip
    d, _, _ = keys(M.NONE)
    assert d.get_capture_descs() == []


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_check_invariants_checks_each_uniform_key_against_its_own_length():
    d, _, full = keys(M.FULL_DECODE_ONLY, q=2)
    d.check_invariants()
    full.add(BatchDescriptor(8, 2, uniform=True))  # 4 tokens per request: not a length of this dispatcher
    with pytest.raises(AssertionError, match="query length 4"):
        d.check_invariants()


# -- "Attention 后端对 CUDA 图的兼容性": the downgrade table --------------------------------------


@pytest.mark.parametrize(
    "mode, support, piecewise, q, expected",
    [
        # ALWAYS keeps everything
        (M.FULL, S.ALWAYS, True, 1, M.FULL),
        (M.FULL_AND_PIECEWISE, S.ALWAYS, True, 1, M.FULL_AND_PIECEWISE),
        # uniform-only backends: FULL -> FULL_AND_PIECEWISE, or FULL_DECODE_ONLY without pieces
        (M.FULL, S.UNIFORM_BATCH, True, 1, M.FULL_AND_PIECEWISE),
        (M.FULL, S.UNIFORM_BATCH, False, 1, M.FULL_DECODE_ONLY),
        (M.FULL, S.UNIFORM_SINGLE_TOKEN_DECODE, True, 1, M.FULL_AND_PIECEWISE),
        (M.FULL_AND_PIECEWISE, S.UNIFORM_SINGLE_TOKEN_DECODE, True, 1, M.FULL_AND_PIECEWISE),
        (M.FULL_DECODE_ONLY, S.UNIFORM_SINGLE_TOKEN_DECODE, True, 1, M.FULL_DECODE_ONLY),
        # NEVER: any FULL-containing mode -> PIECEWISE, or NONE without pieces
        (M.FULL, S.NEVER, True, 1, M.PIECEWISE),
        (M.FULL_AND_PIECEWISE, S.NEVER, True, 1, M.PIECEWISE),
        (M.FULL_DECODE_ONLY, S.NEVER, True, 1, M.PIECEWISE),
        (M.FULL_DECODE_ONLY, S.NEVER, False, 1, M.NONE),
        (M.PIECEWISE, S.NEVER, True, 1, M.PIECEWISE),
        # spec decode (query length 3): the mode stays, a single-token backend's FULL decode
        # graphs serve the steps without drafts (uniform_decode_query_lens, NOTE 4)
        (M.FULL_AND_PIECEWISE, S.UNIFORM_SINGLE_TOKEN_DECODE, True, 3, M.FULL_AND_PIECEWISE),
        (M.FULL_DECODE_ONLY, S.UNIFORM_SINGLE_TOKEN_DECODE, False, 3, M.FULL_DECODE_ONLY),
        (M.FULL_AND_PIECEWISE, S.UNIFORM_BATCH, True, 3, M.FULL_AND_PIECEWISE),
        # no piecewise graphs at all
        (M.PIECEWISE, S.ALWAYS, False, 1, M.NONE),
        (M.FULL_AND_PIECEWISE, S.ALWAYS, False, 1, M.FULL_DECODE_ONLY),
        (M.NONE, S.NEVER, False, 1, M.NONE),
    ],
)
@pytest.mark.seed("000:cgsupport")
def test_cudagraph_resolve_mode_downgrade_table(mode, support, piecewise, q, expected):
    assert resolve_cudagraph_mode(mode, support, piecewise, q) == expected


@pytest.mark.seed("000:cgsupport")
def test_cudagraph_resolve_mode_logs_one_line_per_downgrade(caplog):
    with caplog.at_level(logging.WARNING, logger="tinyvllm.worker.cudagraph_dispatcher"):
        assert resolve_cudagraph_mode(M.FULL, S.UNIFORM_BATCH) == M.FULL_AND_PIECEWISE
    assert len(caplog.records) == 1
    assert "FULL -> FULL_AND_PIECEWISE" in caplog.text and "UNIFORM_BATCH" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tinyvllm.worker.cudagraph_dispatcher"):
        resolve_cudagraph_mode(M.FULL_AND_PIECEWISE, S.ALWAYS)
    assert caplog.records == []
    with pytest.raises(ValueError, match="uniform_decode_query_len must be >= 1, got 0"):
        resolve_cudagraph_mode(M.FULL, S.ALWAYS, True, 0)


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_common_query_len_of_a_batch():
    assert common_query_len([4, 4, 4], (1, 4)) == 4  # every request verifies 3 drafts
    assert common_query_len([1, 1], (1, 4)) == 1  # no request has drafts this step
    assert common_query_len([4, 1], (1, 4)) is None  # some have drafts, some not: mixed
    assert common_query_len([2, 2], (1, 4)) is None  # a length with no keys (drafts cut by the budget)
    assert common_query_len([], (1, 4)) is None
