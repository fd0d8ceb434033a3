"""GPU readiness without a GPU: every Triton kernel compiles ahead of time for sm_80 and sm_90.

On this project's CPU machines the kernels run under ``TRITON_INTERPRET=1``, which accepts
code a real GPU compiler rejects (a ``tl.dot`` tile below 16, a non-power-of-two
``tl.arange``, a type the backend cannot lower). So a subprocess without the interpreter
(``tests/triton_aot_cases.py``) compiles each kernel with ``triton.compile`` for a CUDA
``GPUTarget``, in every constexpr configuration its launcher uses, down to the cubin
(triton's wheel carries ``ptxas``), and these tests check every case: the stages exist, the
PTX names the target, the cubin is not empty. A negative control shows the check can fail:
a kernel the interpreter runs happily is rejected by the compiler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from triton_aot_cases import all_cases  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # the session's ahead-of-time compile takes about a minute on two cores
    pytest.mark.skipif(
        os.environ.get("TINYVLLM_AOT_IN_GPU_VENV") == "1",
        reason="CI compiles these in the GPU venv (.ci/gpu_venv_check), with the GPU machine's triton",
    ),
]

CASES = all_cases()


# Shared memory one program may use (A100: 163 KB, H100: 227 KB); over it a kernel compiles
# but fails to launch.
MAX_SHARED_BYTES = {80: 163 * 1024, 90: 227 * 1024}


def _env_without_interpreter(cache_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)  # a fresh cache: every run really compiles, nothing lands in $HOME
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, dict]:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "triton_aot_cases.py")],
        env=_env_without_interpreter(tmp_path_factory.mktemp("triton_cache")), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["id"]: r for r in results}


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_triton_aot_kernel_compiles_to_cubin(compiled, case):
    result = compiled[case["id"]]
    assert "error" not in result, f"{case['id']} does not compile for sm_{case['cc']}: {result['error']}"
    assert {"ttir", "ttgir", "llir", "ptx", "cubin"} <= set(result["stages"]), result
    assert result["target"] in (f".target sm_{case['cc']}", f".target sm_{case['cc']}a"), result["target"]
    assert result["cubin_bytes"] > 0
    assert result["shared_bytes"] <= MAX_SHARED_BYTES[case["cc"]], (
        f"{case['id']} needs {result['shared_bytes']} bytes of shared memory, sm_{case['cc']} has "
        f"{MAX_SHARED_BYTES[case['cc']]}"
    )


def test_triton_aot_matrix_covers_every_kernel_and_target():
    kinds = {(c["kernel"], c["cc"]) for c in CASES}
    kernels = ("attention", "merge", "kv_write", "rms_norm", "add_rms_norm", "rotary", "qk_norm_rotary", "silu_and_mul", "greedy")
    assert kinds == {(k, cc) for k in kernels for cc in (80, 90)}
    configs = {(c["dtype"], c["consts"]["QUERIES_PER_KV"], c["consts"]["NUM_SEGMENTS"]) for c in CASES
               if c["kernel"] == "attention" and c["cc"] == 90}  # fmt: skip
    assert len(configs) == 3 * 4 * 2  # every dtype x group x split at sm_90


@pytest.mark.parametrize("case", [c for c in CASES if "-sweep-" in c["id"]], ids=lambda c: c["id"])
def test_prefill_sweep_configs_are_software_pipelined_as_launched(compiled, case):
    """With the alignment a launch specializes, the K/V loads become asynchronous copies
    (cp.async): the kernel really is pipelined, so ``num_stages`` is a real choice to sweep."""
    assert compiled[case["id"]]["async_copies"] > 0, case["id"]


@pytest.mark.parametrize("case", [c for c in CASES if "-sweep-" in c["id"]], ids=lambda c: c["id"])
def test_prefill_configs_keep_copies_in_flight_from_3_stages(compiled, case):
    """triton_kernels.py NOTES 1 and 3: neither the step's rows nor the cache walk's full tiles
    load anything but K and V in their loop, so the pipeliner prefetches tiles ahead: some wait
    leaves at least ``num_stages - 1`` copy groups in flight. With 2 stages a tile's K and V are
    both needed at once, and every wait drains them: the test tells the two apart."""
    stages, left = case["options"]["num_stages"], compiled[case["id"]]["copies_left_in_flight"]
    assert left >= stages - 1 if stages > 2 else left == 0, (case["id"], left)


@pytest.mark.parametrize("case", [c for c in CASES if "-sweep-" in c["id"]], ids=lambda c: c["id"])
def test_only_descriptor_configs_copy_with_tma_and_only_on_sm_90(compiled, case):
    """triton_kernels.py NOTE 4: with ``KV_DESC`` the step's full tiles are TMA copies
    (``cp.async.bulk.tensor``) on sm_90; sm_80 has no TMA and gets ordinary loads; without it,
    none."""
    tma = compiled[case["id"]]["tma_copies"]
    assert (tma > 0) == (case["consts"]["KV_DESC"] and case["cc"] == 90), (case["id"], tma)


@pytest.mark.parametrize("case", [c for c in CASES if c["kernel"] == "silu_and_mul"], ids=lambda c: c["id"])
def test_silu_and_mul_calls_libdevices_expf_and_divides_correctly_rounded(compiled, case):
    """activation.py NOTE 1: torch's CUDA silu calls ``expf`` and divides with IEEE rounding;
    the kernel as compiled has libdevice's ``expf`` inlined (its ``ex2.approx.ftz`` core, not
    the plain ``ex2.approx`` of Triton's own ``tl.exp``) and ``div.rn``, no approximate division."""
    r = compiled[case["id"]]
    assert r["div_rn"] > 0 and r["div_approx"] == 0 and r["ex2_ftz"] > 0 and r["ex2_plain"] == 0, r


@pytest.mark.parametrize(
    "case", [c for c in CASES if c["kernel"] in ("rotary", "qk_norm_rotary") and not c.get("control")],
    ids=lambda c: c["id"],
)  # fmt: skip
def test_rotary_compiles_without_fused_multiply_adds(compiled, case):
    """rotary.py NOTE 2: the torch ops round each product before the add; a fused multiply-add
    rounds once, so the kernels that rotate (``rotary.py``, ``qk_norm_rotary.py``), as their
    launchers compile them (``enable_fp_fusion=False``), have none."""
    assert compiled[case["id"]]["fused_multiply_adds"] == 0


def test_rotary_with_fusion_on_would_fuse_even_in_bfloat16(compiled):
    """The control: with fusion left on, the compiler narrows the float32 arithmetic to
    bfloat16 (exactly) and then fuses each multiply with its add, which rounds differently."""
    assert compiled["rotary-sm90-bfloat16-h16-kv8-d128-fusion-on"]["fused_multiply_adds"] > 0


@pytest.mark.parametrize("case", [c for c in CASES if c.get("pdl")], ids=lambda c: c["id"])
def test_a_dependent_launch_waits_before_any_global_memory_access(compiled, case):
    """dependent_launch.py NOTE 1: the wait, then the trigger, ahead of every load and store,
    in the PTX a sm_90 launch with launch_pdl runs; no loop holds a wait (no load hoisted above it)."""
    result = compiled[case["id"]]
    assert result["pdl_waits"] == 1 and result["pdl_triggers"] == 1, result
    assert result["memory_ops_before_wait"] == 0, result


def test_every_kernel_has_a_dependent_case_and_the_others_no_griddepcontrol(compiled):
    assert {c["kernel"] for c in CASES if c.get("pdl")} == {c["kernel"] for c in CASES}
    plain = [c["id"] for c in CASES if not c.get("pdl")]
    with_griddepcontrol = [i for i in plain if compiled[i].get("pdl_waits", 0) + compiled[i].get("pdl_triggers", 0)]
    assert with_griddepcontrol == [], "with USE_PDL off a kernel must compile no griddepcontrol"


@triton.jit
def _interpreter_only_kernel(x_ptr, out_ptr):
    """Runs under the interpreter, but ``tl.dot`` needs tiles of at least 16 on a GPU."""
    rows = tl.arange(0, 8)
    a = tl.load(x_ptr + rows[:, None] * 8 + rows[None, :])  # [8, 8]
    tl.store(out_ptr + rows[:, None] * 8 + rows[None, :], tl.dot(a, a))


NEGATIVE_CONTROL = '''
import sys, triton
sys.path.insert(0, sys.argv[1])
from test_triton_aot import _interpreter_only_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
try:
    triton.compile(ASTSource(_interpreter_only_kernel, {"x_ptr": "*fp16", "out_ptr": "*fp16"}, {}),
                   target=GPUTarget("cuda", 90, 32))
except Exception as exc:
    print("rejected:", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    sys.exit(0)
print("compiled")
sys.exit(1)
'''


def test_triton_aot_negative_control_rejects_an_interpreter_only_kernel(tmp_path):
    x = torch.arange(64, dtype=torch.float16).reshape(8, 8)
    if not torch.cuda.is_available():  # the interpreter runs it (tests/conftest.py sets TRITON_INTERPRET=1)
        out = torch.empty_like(x)
        _interpreter_only_kernel[(1,)](x, out)
        torch.testing.assert_close(out, x @ x)
    proc = subprocess.run(
        [sys.executable, "-c", NEGATIVE_CONTROL, str(Path(__file__).parent)],
        env=_env_without_interpreter(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"the compiler accepted a tl.dot on an 8x8 tile:\n{proc.stdout}{proc.stderr[-2000:]}"
    assert proc.stdout.startswith("rejected:"), proc.stdout
