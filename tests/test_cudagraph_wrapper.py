"""The CUDA-graph wrapper and the forward context (seed 000, "CUDAGraphWrapper" and
"嵌套 Wrapper 设计"), emulated on the CPU: pass-through, capture then replay on the captured
buffers, every check a real graph silently assumes, and the nested FULL/PIECEWISE design."""

import contextlib
from dataclasses import dataclass

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tinyvllm.worker.cuda_graph import (
    CUDAGraphWrapper,
    EmulatedPool,
    describe_arguments,
    forbid_host_reads,
    get_forward_context,
    set_forward_context,
    weak_ref_tensors,
)
from tinyvllm.worker.cudagraph_dispatcher import BatchDescriptor, CUDAGraphMode

M = CUDAGraphMode
D4 = BatchDescriptor(4)


@dataclass(frozen=True)
class Params:
    weight: torch.Tensor
    bias: float


class Counting:
    """``f(x, params) = x * weight + bias``, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, params):
        self.calls += 1
        return x * params.weight + params.bias


@pytest.mark.seed("000:wrapper")
def test_cudagraph_forward_context_nests_and_validates():
    assert get_forward_context() is None
    with set_forward_context(M.FULL, D4) as outer:
        assert get_forward_context() is outer and outer.batch_descriptor == D4
        with set_forward_context(M.NONE, None):
            assert get_forward_context().runtime_mode == M.NONE
        assert get_forward_context() is outer
    assert get_forward_context() is None
    with pytest.raises(ValueError, match="FULL_AND_PIECEWISE"):
        with set_forward_context(M.FULL_AND_PIECEWISE, D4):
            pass
    with pytest.raises(ValueError, match="PIECEWISE needs a batch descriptor"):
        with set_forward_context(M.PIECEWISE, None):
            pass


@pytest.mark.seed("000:wrapper")
def test_cudagraph_wrapper_binds_a_single_graph_mode():
    for mode in (M.NONE, M.FULL_AND_PIECEWISE):
        with pytest.raises(ValueError, match="PIECEWISE or FULL"):
            CUDAGraphWrapper(Counting(), mode, emulate=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA unless emulate=True"):
            CUDAGraphWrapper(Counting(), M.FULL)


@pytest.mark.seed("000:wrapper")
def test_cudagraph_wrapper_passes_through_without_its_mode():
    fn = Counting()
    wrapper = CUDAGraphWrapper(fn, M.FULL, emulate=True)
    x, params = torch.ones(4), Params(torch.full((4,), 2.0), 1.0)
    assert wrapper(x, params).tolist() == [3.0] * 4  # no context
    for mode, desc in ((M.NONE, None), (M.PIECEWISE, D4)):
        with set_forward_context(mode, desc):
            assert wrapper(x, params).tolist() == [3.0] * 4
    assert wrapper.entries == {} and fn.calls == 3


@pytest.mark.seed("000:wrapper")
def test_cudagraph_wrapper_captures_then_replays_on_the_captured_buffers():
    fn = Counting()
    wrapper = CUDAGraphWrapper(fn, M.PIECEWISE, emulate=True)
    x, params = torch.arange(4.0), Params(torch.full((4,), 2.0), 1.0)
    with set_forward_context(M.PIECEWISE, D4):
        first = wrapper(x, params)
        assert first.tolist() == [1.0, 3.0, 5.0, 7.0] and list(wrapper.entries) == [D4]
        x.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # in place: the graph sees it
        params.weight.fill_(3.0)
        second = wrapper(x, params)
    assert second is first  # the captured output tensor, overwritten
    assert second.tolist() == [31.0, 1.0, 1.0, 1.0]
    assert wrapper.entries[D4].num_replays == 1
    wrapper.check_invariants()


@pytest.mark.seed("000:wrapper")
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, p: (x.clone(), p), "argument x changed since capture: tensor"),
        (lambda x, p: (x, Params(p.weight.clone(), p.bias)), "argument params.weight changed"),
        (lambda x, p: (x, Params(p.weight, 2.0)), r"argument params.bias changed since capture: value was \(1.0,\)"),
        (lambda x, p: (x[:2], p), r"argument x changed since capture"),
        (lambda x, p: (x.double(), p), "argument x changed"),
        (lambda x, p: (x.view(2, 2)[:, 0], p), "argument x changed"),
    ],
)
def test_cudagraph_wrapper_refuses_what_a_real_graph_would_get_wrong(change, message):
    wrapper = CUDAGraphWrapper(Counting(), M.FULL, emulate=True)
    x, params = torch.arange(4.0), Params(torch.ones(4), 1.0)
    with set_forward_context(M.FULL, D4):
        wrapper(x, params)
        with pytest.raises(RuntimeError, match=message):
            wrapper(*change(x, params))
        assert wrapper(x, params).tolist() == [1.0, 2.0, 3.0, 4.0]  # still usable afterwards


def test_cudagraph_wrapper_checks_inside_lists_and_dicts():
    wrapper = CUDAGraphWrapper(lambda caches, opts: caches[0] + opts["k"], M.FULL, emulate=True)
    caches, opts = [torch.zeros(2), torch.zeros(2)], {"k": torch.ones(2)}
    with set_forward_context(M.FULL, D4):
        wrapper(caches, opts)
        with pytest.raises(RuntimeError, match=r"argument caches\[1\] changed"):
            wrapper([caches[0], torch.zeros(2)], opts)
        with pytest.raises(RuntimeError, match=r"argument opts\['k'\] changed"):
            wrapper(caches, {"k": torch.ones(2)})
        with pytest.raises(RuntimeError, match=r"argument caches changed"):
            wrapper(caches[:1], opts)


def test_cudagraph_replay_takes_a_new_view_of_the_same_memory_and_keywords_for_positions():
    """The fast comparison (``cuda_graph.py`` NOTE 1) accepts what a real graph would read
    the same way: another tensor object at the captured address, shape, stride and dtype, and
    the same arguments passed by keyword; what it refuses, the named check names."""
    wrapper = CUDAGraphWrapper(Counting(), M.FULL, emulate=True)
    buffer = torch.arange(8.0)
    params = Params(torch.ones(4), 1.0)
    with set_forward_context(M.FULL, D4):
        wrapper(buffer[:4], params)
        assert wrapper(buffer[:4], Params(params.weight[:], 1.0)).tolist() == [1.0, 2.0, 3.0, 4.0]
        assert wrapper(x=buffer[:4], params=params).tolist() == [1.0, 2.0, 3.0, 4.0]
        with pytest.raises(RuntimeError, match="argument x changed since capture"):
            wrapper(buffer[4:], params)
    assert wrapper.entries[D4].num_replays == 2


def test_cudagraph_describe_arguments_flattens_structures():
    t = torch.zeros(2, 3)
    sig = describe_arguments({"a": [t, 3]}, "arg")
    assert sig["arg['a'][0]"] == ("tensor", t.data_ptr(), (2, 3), (3, 1), torch.float32)
    assert sig["arg['a'][1]"] == ("value", 3)


@pytest.mark.seed("000:wrapper")
def test_cudagraph_emulated_capture_forbids_host_reads():
    def syncs(x):
        return x[x > 0]  # boolean mask: the output shape depends on the values

    def reads_item(x):
        return x * x.sum().item()

    for fn in (syncs, reads_item):
        wrapper = CUDAGraphWrapper(fn, M.FULL, emulate=True)
        with set_forward_context(M.FULL, D4), pytest.raises(RuntimeError, match="reads a tensor's value on the host"):
            wrapper(torch.ones(4))
        assert fn(torch.ones(4)).shape == (4,)  # eagerly it is fine
    with forbid_host_reads():
        total = torch.ones(3).add(1).sum(0, keepdim=True)  # device-side arithmetic is fine
        with pytest.raises(RuntimeError, match=r"Tensor.tolist\(\) reads"):
            total.tolist()
        with pytest.raises(RuntimeError, match=r"Tensor.numpy\(\) reads"):
            total.numpy()
    assert total.tolist() == [6.0]  # restored on exit


@pytest.mark.seed("000:nested")
def test_cudagraph_nested_wrappers_full_outer_piecewise_inner():
    """The seed's nested design: in a FULL step the pieces pass through, in a PIECEWISE step
    the outer wrapper does, with NONE both do."""
    piece_a, piece_b = Counting(), Counting()
    params = Params(torch.full((4,), 2.0), 1.0)
    inner = [CUDAGraphWrapper(piece_a, M.PIECEWISE, emulate=True), CUDAGraphWrapper(piece_b, M.PIECEWISE, emulate=True)]

    def forward(x):
        y = inner[0](x, params)
        y = y * 1.0  # the "attention" between the pieces, always eager
        return inner[1](y, params)

    outer = CUDAGraphWrapper(forward, M.FULL, emulate=True)
    x = torch.arange(4.0)
    expected = ((x * 2 + 1) * 2 + 1).tolist()
    with set_forward_context(M.FULL, BatchDescriptor(4, 4, True)):
        assert outer(x).tolist() == expected
    assert len(outer.entries) == 1 and inner[0].entries == {} and inner[1].entries == {}
    with set_forward_context(M.PIECEWISE, D4):
        assert outer(x).tolist() == expected
    assert len(outer.entries) == 1 and list(inner[0].entries) == [D4] and list(inner[1].entries) == [D4]
    with set_forward_context(M.NONE, None):
        assert outer(x).tolist() == expected
    assert len(outer.entries) == 1 and len(inner[0].entries) == 1


def test_cudagraph_an_unchanged_nan_scalar_is_no_change():
    wrapper = CUDAGraphWrapper(lambda x, s: x * 2, M.FULL, emulate=True)
    x = torch.ones(2)
    with set_forward_context(M.FULL, D4):
        wrapper(x, float("nan"))
        assert wrapper(x, float("nan")).tolist() == [2.0, 2.0]  # another NaN object: equal here
        with pytest.raises(RuntimeError, match=r"argument s changed"):
            wrapper(x, 1.0)


# -- NOTE 5: on CUDA a captured graph's outputs are not kept alive by the wrapper ---------


@pytest.mark.seed("000:capture")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_cudagraph_weak_ref_tensors_alias_without_owning(dtype):
    base = torch.arange(24).to(dtype)
    qkv = base.view(4, 6)
    q, v = qkv[:, :2], qkv[:, 4:]  # views at offsets 0 and 4 of one storage, like llama's q and v
    weak_q, (weak_v, n), weak_d = weak_ref_tensors(q), weak_ref_tensors((v, 3)), weak_ref_tensors({"v": v})
    for weak, strong in ((weak_q, q), (weak_v, v), (weak_d["v"], v)):
        assert weak.data_ptr() == strong.data_ptr() and weak.untyped_storage().data_ptr() == base.data_ptr()
        assert (weak.shape, weak.stride(), weak.storage_offset(), weak.dtype) == (
            strong.shape, strong.stride(), strong.storage_offset(), strong.dtype
        )  # fmt: skip
        assert torch.equal(weak, strong)
    assert n == 3
    base[5] = 99  # one memory: a write through either name is seen through the other
    assert weak_v[0, 1].item() == 99
    weak_q[1, 0] = 7
    assert qkv[1, 0].item() == 7
    owner = StorageWeakRef(base.untyped_storage())
    del base, qkv, q, v, strong  # (the loop kept the last view)
    assert owner.expired(), "a weak reference kept the memory alive"


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """The wrapper's CUDA path on the CPU: a graph whose capture runs the callable eagerly
    and whose replay does nothing (enough to see what the wrapper keeps alive)."""

    class FakeGraph:
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())


@pytest.mark.seed("000:capture")
def test_cudagraph_cuda_entry_keeps_no_output_alive(fake_cuda_graphs):
    piece = CUDAGraphWrapper(lambda x: (x * 2, x + 1), M.PIECEWISE, pool=object())
    x = torch.arange(4.0)
    with set_forward_context(M.PIECEWISE, D4):
        doubled, plus_one = piece(x)  # the capture call: the caller owns what it returns
    assert torch.equal(doubled, x * 2) and torch.equal(plus_one, x + 1)
    with set_forward_context(M.PIECEWISE, D4):
        replayed = piece(x)  # a replay: the same addresses, so the next piece's check holds
    assert [t.data_ptr() for t in replayed] == [doubled.data_ptr(), plus_one.data_ptr()]
    owners = [StorageWeakRef(t.untyped_storage()) for t in (doubled, plus_one)]
    del doubled, plus_one, replayed
    # Only the caller held them: the memory goes back to the shared pool for the next capture.
    assert all(o.expired() for o in owners), "the wrapper kept a captured output alive"


@pytest.mark.seed("000:capture")
def test_cudagraph_cuda_entry_keeps_no_input_alive(fake_cuda_graphs):
    """The replay check's record of the captured arguments (NOTE 1) owns none of them: a piece's
    input is the last piece's output, which must go back to the pool once the capture's forward
    ends (NOTE 5). The H200 run of 2026-11-30 at 17:56 found the record holding every input of
    every size: 2.13 GB of graphs for Qwen3-0.6B where 65 MB had sufficed."""
    first = CUDAGraphWrapper(lambda x: x * 2, M.PIECEWISE, pool=object())
    second = CUDAGraphWrapper(lambda h: h + 1, M.PIECEWISE, pool=object())
    x = torch.arange(4.0)
    with set_forward_context(M.PIECEWISE, D4):
        h = first(x)
        out = second(h)  # h: an input the wrapper records for its replay check
    owners = [StorageWeakRef(t.untyped_storage()) for t in (h, out)]
    with set_forward_context(M.PIECEWISE, D4):
        assert second(h).data_ptr() == out.data_ptr()  # the very input object: replays
    del h, out
    assert all(o.expired() for o in owners), "the wrapper kept a captured input alive"


@pytest.mark.seed("000:capture")
def test_cudagraph_emulated_entry_keeps_its_outputs():
    # Emulation has no pool: a replay copies into the captured outputs, so they must stay alive.
    piece = CUDAGraphWrapper(lambda x: x * 2, M.PIECEWISE, emulate=True)
    x = torch.arange(4.0)
    with set_forward_context(M.PIECEWISE, D4):
        first = piece(x)
    owner, address = StorageWeakRef(first.untyped_storage()), first.data_ptr()
    del first
    assert not owner.expired()
    x += 1
    with set_forward_context(M.PIECEWISE, D4):
        again = piece(x)
    assert again.data_ptr() == address and torch.equal(again, x * 2)


@pytest.mark.seed("000:capture")
def test_cudagraph_emulated_pool_overwrites_what_other_shapes_returned():
    """NOTE 5 under emulation: on CUDA the graphs of every size share one pool and own none of
    their outputs, so replaying one shape may overwrite what another shape's replay
    returned. The emulated pool does that visibly (NaN), so a caller that keeps a graph's
    output past a forward of another shape fails in a CPU test, not silently on a GPU."""
    pool = EmulatedPool()
    first = CUDAGraphWrapper(lambda x: (x * 2, torch.arange(len(x))), M.PIECEWISE, emulate=True, pool=pool)
    second = CUDAGraphWrapper(lambda h, i: h + i, M.PIECEWISE, emulate=True, pool=pool)
    full = CUDAGraphWrapper(lambda x: x + 1, M.FULL, emulate=True, pool=pool)
    x4, x8 = torch.arange(4.0), torch.arange(8.0)
    D8 = BatchDescriptor(8)

    def pieces(x):  # two pieces of one forward: the second reads the first's outputs
        h, i = first(x)
        return h, i, second(h, i)

    with set_forward_context(M.PIECEWISE, D4):
        h4, i4, out4 = pieces(x4)
    assert torch.equal(out4, x4 * 2 + torch.arange(4)) and torch.equal(h4, x4 * 2)  # one shape: nothing lost
    with set_forward_context(M.PIECEWISE, D8):
        out8 = pieces(x8)[2]
    assert out4.isnan().all() and h4.isnan().all(), "another shape ran: its memory may hold anything"
    assert (i4 == torch.iinfo(torch.int64).min).all()
    with set_forward_context(M.PIECEWISE, D8):
        again = pieces(x8)[2]  # the same shape again: rewritten with real values, not poisoned
    assert torch.equal(again, x8 * 3) and again.data_ptr() == out8.data_ptr()
    with set_forward_context(M.FULL, D8):
        plus_one = full(x8)
    assert out8.isnan().all() and torch.equal(plus_one, x8 + 1)
    with set_forward_context(M.PIECEWISE, D4):
        assert torch.equal(pieces(x4)[2], x4 * 3)
    assert plus_one.isnan().all()
    for wrapper in (first, second, full):
        wrapper.check_invariants()
