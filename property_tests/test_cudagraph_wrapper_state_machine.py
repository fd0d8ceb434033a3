"""A state machine for the emulated CUDA-graph wrapper, and nested-wrapper examples.

Concept: ``CUDAGraphWrapper(emulate=True)`` must behave like a real CUDA graph on a CPU:
capture once per ``BatchDescriptor``, replay on the captured storage (so in-place updates
of the persistent inputs are seen and the captured output tensors are returned,
overwritten), pass through in any other mode, and refuse loudly whatever a real graph
would silently get wrong: a tensor with other storage, another shape, stride or dtype,
a changed Python value. The machine drives one wrapper around ``cudagraph_toy_forward``
(a tensor, a dataclass holding a tensor, a dict and a list of tensors, and a Python
float) over persistent inputs of three sizes, one descriptor each, and checks every call
against the plain function called on the same values.

Follows: seed 000, vLLM design doc "CUDA Graphs" (based on vLLM PR #20059), sections
"CUDAGraphWrapper" (capture, replay, pass-through, the checks of NOTE 1 in
``worker/cuda_graph.py``) and "嵌套 Wrapper 设计" (a FULL wrapper around the whole forward
and PIECEWISE wrappers around the pieces: each passes through in the other's step).

Checked by the machine: a call in the wrapper's own mode captures the first time and
replays later, returning the very tuple and tensor objects of the capture, with values
equal to the plain function on the current inputs (also after in-place updates) and the
inputs left untouched; calls with no context, with NONE or with the other mode pass
through (fresh tensors, no new entry); a replay with a tensor of other storage, a view of
another shape, stride or dtype, a list of another length, or a changed Python scalar
raises ``RuntimeError`` naming the argument, leaves the entries and replay counts alone,
and the next correct call still replays correctly. Invariants: ``check_invariants()``;
the entries are exactly the descriptors captured in the model, each holding the output
objects of its capture, each replayed as often as the model says; no forward context is
left set. Examples: nested FULL and PIECEWISE wrappers around a two-piece model equal the
eager model in both kinds of step; a fresh tensor between pieces is refused;
``forbid_host_reads`` raises on ``.item()`` and boolean-mask indexing during an emulated
capture and replay, not on an integer gather; context and constructor validation.
Two gaps this file found are closed and pinned here: outputs inside a dataclass are
refreshed by an emulated replay; ``.tolist()`` and ops with a data-dependent output size
(``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``) are refused by
``forbid_host_reads``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tinyvllm.worker.cuda_graph import (
    CUDAGraphWrapper,
    EmulatedPool,
    forbid_host_reads,
    get_forward_context,
    set_forward_context,
)
from tinyvllm.worker.cudagraph_dispatcher import BatchDescriptor, CUDAGraphMode

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
H = 3  # hidden size of the toy function
SIZES = (1, 2, 4)  # one persistent input set, and one descriptor, per size
VALUES = st.integers(-9, 9).map(float)  # exact in float32: equal results are bit-equal
SCALES = st.sampled_from([0.5, 1.5, -2.0, 3.25])


@dataclass
class ToyParams:
    w: torch.Tensor  # [H]
    extra: dict = field(default_factory=dict)  # {"b": [n, 1]}
    taps: list = field(default_factory=list)  # [[n]]


def cudagraph_toy_forward(x: torch.Tensor, params: ToyParams, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The wrapped callable: pure, and every output depends on every input."""
    y = x * params.w * scale + params.extra["b"]  # [n, H]
    return y, y.sum(dim=1) + params.taps[0]  # [n, H], [n]


@dataclass
class PersistentInputs:
    """One size's persistent buffers (what the runner keeps) and its baked-in scalar."""

    x: torch.Tensor
    params: ToyParams
    scale: float

    def tensors(self) -> dict[str, torch.Tensor]:
        p = self.params
        return {"x": self.x, "params.w": p.w, "params.extra['b']": p.extra["b"], "params.taps[0]": p.taps[0]}


def draw_tensor(data, shape: tuple[int, ...]) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    return torch.tensor(data.draw(st.lists(VALUES, min_size=numel, max_size=numel)), dtype=torch.float32).view(shape)


def shapes(n: int) -> dict[str, tuple[int, ...]]:
    return {"x": (n, H), "params.w": (H,), "params.extra['b']": (n, 1), "params.taps[0]": (n,)}


def replace_at(inp: PersistentInputs, path: str, new) -> tuple:
    """The call arguments (x, params, scale) with the tensor at ``path`` replaced by ``new``."""
    p = inp.params
    w, b, tap, x = p.w, p.extra["b"], p.taps[0], inp.x
    if path == "x":
        x = new
    elif path == "params.w":
        w = new
    elif path == "params.extra['b']":
        b = new
    elif path == "params.taps[0]":
        tap = new
    else:
        raise AssertionError(path)
    return x, ToyParams(w, {"b": b}, [tap]), inp.scale  # a new dataclass, dict and list each time


def same_entries(before: dict, after: dict) -> bool:
    """The same descriptors, each still holding the very same entry object."""
    return before.keys() == after.keys() and all(after[k] is v for k, v in before.items())


# ---------------------------------------------------------------------------------------
# The state machine
# ---------------------------------------------------------------------------------------


class CudagraphWrapperMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from([PIECEWISE, FULL]), data=st.data())
    def setup(self, mode, data):
        self.mode = mode
        self.other_mode = FULL if mode == PIECEWISE else PIECEWISE
        self.wrapper = CUDAGraphWrapper(cudagraph_toy_forward, mode, emulate=True)
        self.inputs: dict[int, PersistentInputs] = {}
        for n in SIZES:
            t = {path: draw_tensor(data, shape) for path, shape in shapes(n).items()}
            params = ToyParams(t["params.w"], {"b": t["params.extra['b']"]}, [t["params.taps[0]"]])
            self.inputs[n] = PersistentInputs(t["x"], params, data.draw(SCALES))
        self.captured: dict[BatchDescriptor, tuple] = {}  # descriptor -> the output tuple of its capture
        self.captured_tensors: dict[BatchDescriptor, tuple] = {}  # ... and its tensors, held separately
        self.replays: dict[BatchDescriptor, int] = {}

    def desc(self, n: int) -> BatchDescriptor:
        """The key the dispatcher would give a batch of ``n`` tokens in this wrapper's mode."""
        return BatchDescriptor(n) if self.mode == PIECEWISE else BatchDescriptor(n, n)

    def captured_sizes(self) -> list[int]:
        return sorted(d.num_tokens for d in self.captured)

    def run_own(self, n: int, by_keyword: bool = False) -> None:
        """A correct call in the wrapper's own mode: capture or replay, checked."""
        inp, d = self.inputs[n], self.desc(n)
        want = cudagraph_toy_forward(inp.x, inp.params, inp.scale)
        before = {path: t.clone() for path, t in inp.tensors().items()}
        with set_forward_context(self.mode, d):
            if by_keyword:
                got = self.wrapper(inp.x, params=inp.params, scale=inp.scale)
            else:
                got = self.wrapper(inp.x, inp.params, inp.scale)
        if d in self.captured:
            assert got is self.captured[d], f"replay of {d} returned a new object, not the captured output"
            for i, (g, c) in enumerate(zip(got, self.captured_tensors[d], strict=True)):
                assert g is c, f"replay of {d}: output {i} is not the tensor returned at capture"
            self.replays[d] += 1
        else:
            assert isinstance(got, tuple) and len(got) == 2, f"capture of {d} returned {type(got)}"
            self.captured[d], self.captured_tensors[d], self.replays[d] = got, tuple(got), 0
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"{self.mode.name} {d} output {i}: got {g.tolist()}, plain function {w.tolist()}"
        for path, t in inp.tensors().items():
            was = before[path].tolist()
            assert torch.equal(t, before[path]), f"{d}: the call changed input {path}: {was} -> {t.tolist()}"

    def expect_refusal(self, n: int, args: tuple, path: str, kwargs: dict | None = None) -> None:
        """A replay with a wrong argument raises naming ``path`` and leaves the wrapper usable."""
        d = self.desc(n)
        event(f"refused {path}")
        entries_before = dict(self.wrapper.entries)
        with pytest.raises(RuntimeError, match=re.escape(f"argument {path} ")) as excinfo:
            with set_forward_context(self.mode, d):
                self.wrapper(*args, **(kwargs or {}))
        assert str(d) in str(excinfo.value), f"the error does not name the graph {d}: {excinfo.value}"
        assert same_entries(entries_before, self.wrapper.entries), f"a refused call changed the entries of {d}"
        assert self.wrapper.entries[d].num_replays == self.replays[d], "a refused call counted as a replay"
        self.run_own(n)  # still replays correctly

    # -- rules ----------------------------------------------------------------------------

    @rule(n=st.sampled_from(SIZES), by_keyword=st.booleans())
    def run_in_own_mode(self, n, by_keyword):
        self.run_own(n, by_keyword)

    @rule(n=st.sampled_from(SIZES), data=st.data())
    def update_inputs_in_place_then_run(self, n, data):
        inp = self.inputs[n]
        for path, t in inp.tensors().items():
            t.copy_(draw_tensor(data, tuple(t.shape)))  # same storage, new values
        self.run_own(n, data.draw(st.booleans(), label="by_keyword"))

    @rule(n=st.sampled_from(SIZES), how=st.sampled_from(["no context", "NONE", "other mode"]))
    def run_passing_through(self, n, how):
        inp = self.inputs[n]
        want = cudagraph_toy_forward(inp.x, inp.params, inp.scale)
        entries_before = dict(self.wrapper.entries)
        if how == "no context":
            got = self.wrapper(inp.x, inp.params, inp.scale)
        else:
            mode, d = (NONE, None) if how == "NONE" else (self.other_mode, self.desc(n))  # a captured key, maybe
            with set_forward_context(mode, d):
                got = self.wrapper(inp.x, inp.params, inp.scale)
        assert same_entries(entries_before, self.wrapper.entries), f"pass-through ({how}) changed the entries"
        held = [t for outs in self.captured_tensors.values() for t in outs]
        assert all(g is not t for g in got for t in held), f"pass-through ({how}) returned captured output tensors"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"pass-through ({how}) output {i}: got {g.tolist()}, want {w.tolist()}"

    @precondition(lambda self: self.captured)
    @rule(data=st.data(), path=st.sampled_from(["x", "params.w", "params.extra['b']", "params.taps[0]"]))
    def replay_with_other_storage(self, data, path):
        n = data.draw(st.sampled_from(self.captured_sizes()), label="n")
        inp = self.inputs[n]
        clone = inp.tensors()[path].clone()  # same shape, stride, dtype and values; other storage
        self.expect_refusal(n, replace_at(inp, path, clone), path)

    @precondition(lambda self: self.captured)
    @rule(data=st.data(), delta=st.sampled_from([0.5, -1.0, 1e-3]), by_keyword=st.booleans())
    def replay_with_changed_scalar(self, data, delta, by_keyword):
        n = data.draw(st.sampled_from(self.captured_sizes()), label="n")
        inp = self.inputs[n]
        if by_keyword:
            self.expect_refusal(n, (inp.x, inp.params), "scale", {"scale": inp.scale + delta})
        else:
            self.expect_refusal(n, (inp.x, inp.params, inp.scale + delta), "scale")

    @precondition(lambda self: self.captured)
    @rule(
        data=st.data(),
        view=st.sampled_from(["x[:-1]", "x.view(-1)", "x.unsqueeze(0)", "x with other stride", "x as int32",
                              "w[:-1]", "b.view(-1)", "taps twice"]),
    )  # fmt: skip
    def replay_with_wrong_view(self, data, view):
        n = data.draw(st.sampled_from(self.captured_sizes()), label="n")
        inp = self.inputs[n]
        x, p = inp.x, inp.params
        if view == "x[:-1]":  # same address and stride, shorter
            args, path = replace_at(inp, "x", x[:-1]), "x"
        elif view == "x.view(-1)":
            args, path = replace_at(inp, "x", x.view(-1)), "x"
        elif view == "x.unsqueeze(0)":
            args, path = replace_at(inp, "x", x.unsqueeze(0)), "x"
        elif view == "x with other stride":  # same address, shape and dtype
            args, path = replace_at(inp, "x", x.as_strided(x.shape, (1, n))), "x"
        elif view == "x as int32":  # same address, shape and stride
            args, path = replace_at(inp, "x", x.view(torch.int32)), "x"
        elif view == "w[:-1]":
            args, path = replace_at(inp, "params.w", p.w[:-1]), "params.w"
        elif view == "b.view(-1)":
            args, path = replace_at(inp, "params.extra['b']", p.extra["b"].view(-1)), "params.extra['b']"
        else:  # the list holds the right tensor, and one more
            args, path = (x, ToyParams(p.w, dict(p.extra), [p.taps[0], p.taps[0]]), inp.scale), "params.taps"
        self.expect_refusal(n, args, path)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def entries_match_model(self):
        self.wrapper.check_invariants()
        entries = self.wrapper.entries
        assert set(entries) == set(self.captured), f"entries {sorted(entries)} != captured {sorted(self.captured)}"
        assert len(entries) == len(self.captured)
        for d, out in self.captured.items():
            assert entries[d].output is out, f"entry {d} no longer holds the output of its capture"
            got, want = entries[d].num_replays, self.replays[d]
            assert got == want, f"{d}: {got} replays, the model counts {want}"

    @invariant()
    def no_forward_context_left(self):
        assert get_forward_context() is None, f"a forward context leaked: {get_forward_context()}"


TestCudagraphWrapperStateMachine = pytest.mark.seed("000:wrapper")(CudagraphWrapperMachine.TestCase)


# ---------------------------------------------------------------------------------------
# Nested wrappers (seed 000, "嵌套 Wrapper 设计")
# ---------------------------------------------------------------------------------------


def cudagraph_piece_in(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 + 1.0


def cudagraph_piece_out(h: torch.Tensor) -> torch.Tensor:
    return torch.sin(h) * 3.0 - h


class CudagraphTwoPieceModel:
    """piece_in -> an eager "attention" op that writes a persistent buffer -> piece_out.

    Like the runner's model: ``pieces`` may be PIECEWISE wrappers; ``forward`` is what a
    FULL wrapper wraps. The eager op between pieces writes into ``attn_out``, as vLLM's
    attention writes into a preallocated output, so the second piece always sees the same
    storage. With ``fresh_between=True`` it returns a new tensor instead.
    """

    def __init__(self, n: int, fresh_between: bool = False) -> None:
        self.pieces = [cudagraph_piece_in, cudagraph_piece_out]
        self.attn_out = torch.zeros(n, H)
        self.fresh_between = fresh_between

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        if self.fresh_between:
            return torch.cumsum(h, dim=0)
        return torch.cumsum(h, dim=0, out=self.attn_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pieces[1](self.attention(self.pieces[0](x)))

    __call__ = forward


def cudagraph_eager_two_piece(x: torch.Tensor) -> torch.Tensor:
    return cudagraph_piece_out(torch.cumsum(cudagraph_piece_in(x), dim=0))


@pytest.mark.seed("000:nested")
def test_cudagraph_nested_wrappers_pass_through_each_others_steps():
    n = 4
    model = CudagraphTwoPieceModel(n)
    pool = EmulatedPool()  # one pool, as the runner's: a step of one mode poisons the other's outputs
    inner = [CUDAGraphWrapper(p, PIECEWISE, emulate=True, pool=pool) for p in model.pieces]
    model.pieces = inner
    outer = CUDAGraphWrapper(model, FULL, emulate=True, pool=pool)
    x = torch.arange(n * H, dtype=torch.float32).view(n, H) / 7.0  # the persistent input buffer
    pw_desc, full_desc = BatchDescriptor(n), BatchDescriptor(n, n)

    def step(mode, desc):
        with set_forward_context(mode, desc):
            return outer(x)

    outputs = {}
    for round_ in range(3):
        for mode, desc in ((PIECEWISE, pw_desc), (FULL, full_desc), (NONE, None)):
            got, want = step(mode, desc), cudagraph_eager_two_piece(x)
            assert torch.allclose(got, want), f"round {round_} {mode.name}: {got.tolist()} != eager {want.tolist()}"
            if mode != NONE:
                if round_ == 0:
                    outputs[mode] = got
                assert got is outputs[mode], f"round {round_} {mode.name}: not the captured output object"
            else:
                assert all(got is not o for o in outputs.values()), "the eager step returned a captured output"
        assert list(outer.entries) == [full_desc], f"outer wrapper entries {list(outer.entries)}"
        for i, w in enumerate(inner):
            assert list(w.entries) == [pw_desc], f"inner wrapper {i} entries {list(w.entries)}"
        assert outer.entries[full_desc].num_replays == round_, f"outer replays {outer.entries[full_desc].num_replays}"
        assert all(w.entries[pw_desc].num_replays == round_ for w in inner), "inner replays"
        x.mul_(-1.5).add_(0.25)  # the runner refills its buffers in place between steps
    last_piece = inner[1].entries[pw_desc].output
    assert outputs[PIECEWISE] is last_piece, "a PIECEWISE step must return the last piece's graph output"
    assert outputs[FULL] is not outputs[PIECEWISE]


@pytest.mark.seed("000:nested")
def test_cudagraph_piecewise_replay_refuses_fresh_tensor_between_pieces():
    n = 2
    model = CudagraphTwoPieceModel(n, fresh_between=True)
    model.pieces = [CUDAGraphWrapper(p, PIECEWISE, emulate=True) for p in model.pieces]
    x = torch.ones(n, H)
    with set_forward_context(PIECEWISE, BatchDescriptor(n)):
        model(x)  # captures both pieces; the second on this step's fresh tensor
    with pytest.raises(RuntimeError, match=r"argument h changed since capture"):
        with set_forward_context(PIECEWISE, BatchDescriptor(n)):
            model(x)  # a new fresh tensor: a real graph would read the old address
    with set_forward_context(FULL, BatchDescriptor(n, n)):  # the pieces pass through in a FULL step
        assert torch.allclose(model(x), cudagraph_eager_two_piece(x))


# ---------------------------------------------------------------------------------------
# Host reads (NOTE 2 of worker/cuda_graph.py)
# ---------------------------------------------------------------------------------------


def cudagraph_reads_item(x: torch.Tensor) -> torch.Tensor:
    return x * x.sum().item()


def cudagraph_reads_bool_mask(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    out[x > 0] = 1.0
    return out


def cudagraph_gathers_by_index(x: torch.Tensor) -> torch.Tensor:
    return x[torch.tensor([1, 0])] * 2.0  # an integer gather needs no value on the host


@pytest.mark.parametrize(
    "fn, what",
    [(cudagraph_reads_item, r"_local_scalar_dense|item"), (cudagraph_reads_bool_mask, r"boolean-mask indexing")],
)
def test_cudagraph_emulated_capture_forbids_host_reads(fn, what):
    wrapper = CUDAGraphWrapper(fn, FULL, emulate=True)
    x = torch.tensor([1.0, -2.0, 3.0])
    with pytest.raises(RuntimeError, match=what):
        with set_forward_context(FULL, BatchDescriptor(3, 1)):
            wrapper(x)
    assert wrapper.entries == {}, f"a failed capture left an entry: {wrapper.entries}"
    assert get_forward_context() is None
    with set_forward_context(NONE, None):  # eager runs may read the host
        assert torch.equal(wrapper(x), fn(x))


def test_cudagraph_emulated_replay_forbids_host_reads_and_allows_gathers():
    calls = []

    def reads_host_on_replay(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * 2.0 if len(calls) == 1 else x * x.max().item()

    x = torch.tensor([1.0, 2.0])
    wrapper = CUDAGraphWrapper(reads_host_on_replay, PIECEWISE, emulate=True)
    with set_forward_context(PIECEWISE, BatchDescriptor(2)):
        wrapper(x)  # the capture reads nothing
    with pytest.raises(RuntimeError, match=r"_local_scalar_dense|item"):
        with set_forward_context(PIECEWISE, BatchDescriptor(2)):
            wrapper(x)

    gather = CUDAGraphWrapper(cudagraph_gathers_by_index, PIECEWISE, emulate=True)
    for _ in range(2):  # capture, then replay
        with set_forward_context(PIECEWISE, BatchDescriptor(2)):
            assert torch.equal(gather(x), torch.tensor([4.0, 2.0]))


@pytest.mark.parametrize(
    "op",
    [
        pytest.param(lambda x: torch.tensor(x.tolist()), id="tolist"),
        pytest.param(lambda x: torch.unique(x), id="unique"),
        pytest.param(lambda x: torch.bincount(x.long().abs()), id="bincount"),
        pytest.param(lambda x: torch.repeat_interleave(x.long().abs()), id="repeat_interleave"),
    ],
)
def test_cudagraph_forbid_host_reads_catches_data_dependent_ops(op):
    with pytest.raises(RuntimeError, match="host"):
        with forbid_host_reads():
            op(torch.tensor([1.0, 2.0, 2.0]))


# ---------------------------------------------------------------------------------------
# Outputs, context and construction
# ---------------------------------------------------------------------------------------


@dataclass
class CudagraphToyOutput:
    hidden: torch.Tensor


def test_cudagraph_emulated_replay_refreshes_dataclass_outputs():
    def forward(x: torch.Tensor) -> CudagraphToyOutput:
        return CudagraphToyOutput(x * 2.0)

    wrapper = CUDAGraphWrapper(forward, FULL, emulate=True)
    x = torch.ones(3)
    with set_forward_context(FULL, BatchDescriptor(3, 3)):
        first = wrapper(x)
    x.fill_(5.0)
    with set_forward_context(FULL, BatchDescriptor(3, 3)):
        second = wrapper(x)
    assert second is first, "replay returned a new output object"
    assert torch.equal(second.hidden, x * 2.0), f"replay output {second.hidden.tolist()}, want {(x * 2.0).tolist()}"


def test_cudagraph_forward_context_is_validated_and_restored():
    for bad in (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE):
        with pytest.raises(ValueError, match="runtime mode"):
            with set_forward_context(bad, BatchDescriptor(1)):
                pass
    for mode in (PIECEWISE, FULL):
        with pytest.raises(ValueError, match="batch descriptor"):
            with set_forward_context(mode, None):
                pass
    with set_forward_context(FULL, BatchDescriptor(2, 2)) as outer:
        with pytest.raises(KeyError):
            with set_forward_context(PIECEWISE, BatchDescriptor(2)):
                assert get_forward_context().runtime_mode == PIECEWISE
                raise KeyError("inside")
        assert get_forward_context() is outer, f"inner context not restored: {get_forward_context()}"
    assert get_forward_context() is None


def test_cudagraph_wrapper_is_bound_to_a_graph_mode():
    for bad in (NONE, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE):
        with pytest.raises(ValueError, match="PIECEWISE or FULL"):
            CUDAGraphWrapper(cudagraph_piece_in, bad, emulate=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="emulate=True"):
            CUDAGraphWrapper(cudagraph_piece_in, FULL)
