"""Static count: the instructions of the Triton attention kernel's loops, compiled for sm_90.

What it measures: no time. For a few prefill configs (rows per query tile, keys per KV tile,
warps, stages) of Llama-3-8B's and Qwen3-0.6B's attention shapes (GQA 4 and 2, head size 128,
bf16, blocks of 16), the kernel is compiled for sm_90 as a launch on an H100 would specialize
it (16-byte aligned pointers, strides divisible by 16), once reading every key from the cache
and once reading the step's own keys from their rows (``triton_kernels.py`` NOTE 1). The cubin
is disassembled with the ``nvdisasm`` Triton ships, and each loop that holds the tile's matrix
multiplies (a backward branch and the instructions it jumps back over; an outer loop's count
includes the loop nested in it) is reported: its instruction count, the count of each opcode
(``HGMMA`` the tensor-core matrix multiplies, ``MUFU`` the exponentials, ``LDGSTS`` the
asynchronous copies, ``FMUL``/``FADD``/``IMAD``... the rest), and the PTX's
``cp.async.wait_group`` values: how many copy groups each wait leaves in flight (0: every load
is waited for before the tile's math, nothing overlaps).

Beside each config, the plainest causal flash attention (``plain_flash.py``, the prefill
sweep's baseline: one contiguous sequence, no paging, no packed heads) compiled the same way:
how many instructions a loop trip costs without the paged kernel's own work.

Why: a GPU run is scarce; the instruction mix of the loop that runs once per KV tile is what a
kernel change alters, and it can be read on any machine. It says nothing about latency or
occupancy; the GPU's own figures are ``bench/attention.py``'s.

Run: ``python3 bench/attention_sass.py`` (about a minute on two cores) writes
``bench/results/attention_sass.json``; ``--quick`` compiles one config (the test suite runs it).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, write_json  # noqa: E402

# (shape, GQA group, rows per query tile, keys per KV tile, warps, stages)
CONFIGS = [
    ("Llama-3-8B", 4, 64, 32, 4, 3),  # the default prefill config (--quick's)
    ("Qwen3-0.6B", 2, 64, 64, 4, 2),  # the H200 sweep's best at 4,096 tokens (2026-11-30)
    ("Llama-3-8B", 4, 128, 64, 8, 3),  # the same sweep's best for Llama-3-8B
]
POINTERS = ("out_ptr", "part_acc_ptr", "part_max_ptr", "part_sum_ptr", "query_ptr", "key_cache_ptr",
            "value_cache_ptr", "key_ptr", "value_ptr", "query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr")  # fmt: skip


def compile_attention(group: int, block_m: int, tile_n: int, num_warps: int, num_stages: int, step_kv: bool):
    """The kernel compiled for sm_90 with a launch's specialization (module header)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tinyvllm.attention.triton_attention import _paged_attention_kernel as kernel
    from tinyvllm.attention.triton_attention import choose_query_tile

    block_q, rows = choose_query_tile(group, decode_only=False, rows=block_m)
    consts = dict(QUERIES_PER_KV=group, BLOCK_SIZE=16, TILE_N=tile_n, HEAD_SIZE=128, BLOCK_Q=block_q, BLOCK_M=rows,
                  NUM_SEGMENTS=1, DOT_FP32=False, INPUT_PRECISION="tf32", STEP_KV=step_kv, KV_DESC=False,
                  USE_PDL=False, key_desc=None, value_desc=None)  # fmt: skip
    types = {name: "*bf16" for name in POINTERS} | {"part_acc_ptr": "*fp32", "part_max_ptr": "*fp32",
             "part_sum_ptr": "*fp32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "block_table_ptr": "*i32",
             "scale": "fp32"}  # fmt: skip
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name], constexprs[(i,)] = "constexpr", consts[name]
        else:
            signature[name] = types.get(name, "i32")
            if name in POINTERS or name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 64),
                          options=dict(num_warps=num_warps, num_stages=num_stages))  # fmt: skip


def compile_plain(group: int, block_m: int, tile_n: int, num_warps: int, num_stages: int):
    """``plain_flash.py``'s kernel, the prefill sweep's baseline, compiled the same way."""
    import triton
    from plain_flash import _plain_causal_flash_kernel as kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(GROUP=group, HEAD_SIZE=128, BLOCK_M=block_m, BLOCK_N=tile_n)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name], constexprs[(i,)] = "constexpr", consts[name]
        else:
            signature[name] = "*bf16" if name.endswith("_ptr") else "fp32" if name == "scale" else "i32"
            if name.endswith("_ptr") or name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 64),
                          options=dict(num_warps=num_warps, num_stages=num_stages))  # fmt: skip


def disassemble(cubin: bytes, folder: Path) -> str:
    import triton

    path = folder / "kernel.cubin"
    path.write_bytes(cubin)
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    return subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True, check=True).stdout


def sass_loops(sass: str) -> list[dict]:
    """Each backward branch's body, in address order: its length and opcode counts."""
    instructions, labels, pending = [], {}, []  # (offset, opcode, text); label -> offset
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if ins:
            offset, text = int(ins.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", ins.group(2).strip())
            instructions.append((offset, text.split()[0].split(".")[0] if text else "", text))
            labels.update((name, offset) for name in pending)
            pending = []
    loops = []
    for offset, opcode, text in instructions:
        target = re.search(r"\((\.L_x_\d+)\)", text) if opcode == "BRA" else None
        start = labels.get(target.group(1)) if target else None
        if start is not None and start < offset:
            body = [op for o, op, _ in instructions if start <= o <= offset]
            loops.append(dict(start=hex(start), instructions=len(body), opcodes=dict(collections.Counter(body).most_common())))
    return loops


def copy_waits(ptx: str) -> list[int]:
    """The PTX's ``cp.async.wait_group N`` values, in order: copy groups each leaves in flight."""
    return [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)]


def measure(config: tuple, step_kv: bool | None, folder: Path) -> dict:
    """One config's loops; ``step_kv`` None: the plain baseline's (``plain_flash.py``)."""
    shape, group, block_m, tile_n, warps, stages = config
    if step_kv is None:
        kernel = compile_plain(group, block_m, tile_n, warps, stages)
    else:
        kernel = compile_attention(group, block_m, tile_n, warps, stages, step_kv)
    loops = [loop for loop in sass_loops(disassemble(kernel.asm["cubin"], folder)) if "HGMMA" in loop["opcodes"]]
    return dict(shape=shape, group=group, block_m=block_m, kv_tile=tile_n, num_warps=warps, num_stages=stages,
                kernel="plain_flash" if step_kv is None else "paged", step_kv=step_kv, shared_bytes=kernel.metadata.shared, copy_waits=copy_waits(kernel.asm["ptx"]),
                kv_tile_loops=loops)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one config (the test suite's run)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "attention_sass.json")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: under the interpreter @triton.jit kernels are not compiled")
    import tempfile

    import triton

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in CONFIGS[:1] if args.quick else CONFIGS:
            for step_kv in (False, True, None):  # the cache only, the step's rows, the plain baseline
                rows.append(measure(config, step_kv, Path(tmp)))
    for r in rows:
        loops = " | ".join(f"{loop['instructions']} ({', '.join(f'{k} {v}' for k, v in list(loop['opcodes'].items())[:6])})"
                           for loop in r["kv_tile_loops"])  # fmt: skip
        print(f"{r['shape']} m{r['block_m']}-n{r['kv_tile']}-w{r['num_warps']}-s{r['num_stages']} "
              f"{ {False: 'cache only', True: 'step rows', None: 'plain flash'}[r['step_kv']]}: waits {sorted(set(r['copy_waits']))}; loops: {loops}")  # fmt: skip
    record = dict(benchmark="attention_sass", quick=args.quick, target="sm_90", triton=triton.__version__,
                  note="static: instructions per loop trip of the compiled kernel, no timing", rows=rows)  # fmt: skip
    write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
