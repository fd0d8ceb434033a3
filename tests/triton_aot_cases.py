"""Compile every Triton kernel of the project ahead of time for CUDA targets (no GPU needed).

Run as a script by ``tests/test_triton_aot.py`` in a subprocess WITHOUT ``TRITON_INTERPRET``
(the test suite sets it on machines without CUDA, and under it ``@triton.jit`` kernels are
interpreted instead of compiled). Prints one JSON line per case: its id, the stages the
compiler produced, the PTX ``.target`` line, the cubin size, or the error.

The cases are the constexpr configurations the launchers really use (read from
``choose_query_tile`` and the launchers' own rules), cut to a matrix that compiles in about
a minute on two cores: every dtype x GQA group x tile x split at sm_90 (head size 128, block
16), the other head size and block size at sm_90 for bf16, bf16/fp32 at sm_80, and the tiny
test models' shape (head size 16, GQA 2) at sm_90 for bf16/fp32.
"""

from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

DTYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}
# models/tiny.py's models (4 heads, 2 KV heads of size 16) at the engine's default block size:
# the shapes every engine-level `gpu` test compiles first.
TINY_SHAPE = {"group": 2, "kv_heads": 2, "head": 16, "block": 16}


def attention_cases() -> list[dict]:
    from tinyvllm.attention.triton_attention import SPLIT_KV_SEGMENTS, choose_kv_tile, choose_query_tile, choose_step_kv

    cases = []

    def add(cc, dtype, group, decode, segments, head, block):
        block_q, block_m = choose_query_tile(group, decode_only=decode)
        fp32 = dtype == "float32"
        consts = dict(QUERIES_PER_KV=group, BLOCK_SIZE=block, TILE_N=choose_kv_tile(decode), HEAD_SIZE=head,
                      BLOCK_Q=block_q, BLOCK_M=block_m, NUM_SEGMENTS=segments, DOT_FP32=fp32, INPUT_PRECISION="ieee" if fp32 else "tf32",
                      STEP_KV=choose_step_kv(decode, segments), KV_DESC=False, key_desc=None, value_desc=None)  # fmt: skip
        tile = "decode" if decode else "prefill"
        cases.append(dict(id=f"attention-sm{cc}-{dtype}-g{group}-{tile}-seg{segments}-d{head}-s{block}",
                          kernel="attention", cc=cc, dtype=dtype, consts=consts))  # fmt: skip

    for dtype in DTYPES:
        for group in (1, 2, 4, 8):
            for decode in (True, False):
                for segments in (1, SPLIT_KV_SEGMENTS):
                    add(90, dtype, group, decode, segments, 128, 16)
    for head, block in ((64, 16), (128, 32), (64, 32)):
        add(90, "bfloat16", 4, True, SPLIT_KV_SEGMENTS, head, block)
        add(90, "bfloat16", 4, False, 1, head, block)
    for dtype in ("bfloat16", "float32"):
        for group in (1, 4):
            for decode in (True, False):
                for segments in (1, SPLIT_KV_SEGMENTS):
                    add(80, dtype, group, decode, segments, 128, 16)
    for dtype in ("bfloat16", "float32"):  # the tiny test models the `gpu` tests run (TINY_SHAPE)
        for decode in (True, False):
            for segments in (1, SPLIT_KV_SEGMENTS):
                add(90, dtype, TINY_SHAPE["group"], decode, segments, TINY_SHAPE["head"], TINY_SHAPE["block"])
    return cases


# What a real launch tells the compiler and the cases above do not: Triton specializes an int
# argument divisible by 16 and a 16-byte-aligned pointer, and only with that alignment known are
# the kernel's K/V loads software-pipelined (cp.async; without it ``num_stages`` changes nothing).
ATTENTION_DIVISIBLE_BY_16 = (
    "out_ptr", "part_acc_ptr", "part_max_ptr", "part_sum_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr",
    "query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr", "stride_q_n", "stride_q_h", "stride_o_n", "stride_o_h",
    "stride_k_b", "stride_k_s", "stride_k_h", "stride_v_b", "stride_v_s", "stride_v_h", "stride_bt_r",
    "key_ptr", "value_ptr", "stride_kn_n", "stride_kn_h", "stride_vn_n", "stride_vn_h",
)  # fmt: skip


def prefill_sweep_cases() -> list[dict]:
    """Corners of bench/attention.py's prefill sweep (the most shared memory that fits: 128 keys
    a tile at 3 stages, 64 at 4; 128 at 4 needs more than sm_90 has) as launched on an H100 (``ATTENTION_DIVISIBLE_BY_16``), Llama-3-8B's heads, bf16,
    reading the step's own rows as the engine's prefill does (triton_kernels.py NOTE 1), and the
    default prefill config for comparison: each must fit sm_90's shared memory. The default
    config once more reading every key from the cache (NOTE 3's walk). Three configs once more
    with the step's full tiles through tensor descriptors (NOTE 4, ``-desc``): on sm_90 TMA
    copies, on sm_80 (no TMA) ordinary loads."""
    from tinyvllm.attention.triton_attention import choose_query_tile

    cases = []
    configs = ((64, 32, 4, 3, True, False), (128, 128, 8, 3, True, False), (64, 64, 4, 4, True, False),
               (128, 64, 8, 2, True, False), (64, 32, 4, 3, False, False), (64, 32, 4, 3, True, True),
               (64, 64, 4, 2, True, True), (128, 64, 8, 3, True, True))  # fmt: skip
    for cc in (90, 80):
        for block_m, tile_n, warps, stages, step_kv, desc in configs if cc == 90 else configs[5:6]:
            block_q, rows = choose_query_tile(4, decode_only=False, rows=block_m)
            consts = dict(QUERIES_PER_KV=4, BLOCK_SIZE=16, TILE_N=tile_n, HEAD_SIZE=128, BLOCK_Q=block_q, BLOCK_M=rows,
                          NUM_SEGMENTS=1, DOT_FP32=False, INPUT_PRECISION="tf32", STEP_KV=step_kv, KV_DESC=desc)  # fmt: skip
            consts |= {} if desc else dict(key_desc=None, value_desc=None)
            name = f"attention-sm{cc}-bfloat16-g4-sweep-m{block_m}-n{tile_n}-w{warps}-s{stages}"
            name += ("" if step_kv else "-cache-only") + ("-desc" if desc else "")
            types = {n: f"tensordesc<bf16[{tile_n},128]>" for n in ("key_desc", "value_desc")} if desc else {}
            cases.append(dict(id=name, kernel="attention", cc=cc, dtype="bfloat16", consts=consts, types=types,
                              options=dict(num_warps=warps, num_stages=stages), divisible_by_16=ATTENTION_DIVISIBLE_BY_16))  # fmt: skip
    return cases


def merge_cases() -> list[dict]:
    from tinyvllm.attention.triton_attention import SPLIT_KV_SEGMENTS

    return [
        dict(id=f"merge-sm{cc}-{dtype}-d{head}", kernel="merge", cc=cc, dtype=dtype,
             consts=dict(NUM_SEGMENTS=SPLIT_KV_SEGMENTS, HEAD_SIZE=head))  # fmt: skip
        for cc in (80, 90) for dtype in DTYPES for head in (64, 128)
    ] + [
        dict(id=f"merge-sm90-{dtype}-d{TINY_SHAPE['head']}", kernel="merge", cc=90, dtype=dtype,
             consts=dict(NUM_SEGMENTS=SPLIT_KV_SEGMENTS, HEAD_SIZE=TINY_SHAPE["head"]))  # fmt: skip
        for dtype in ("bfloat16", "float32")
    ]


def write_cases() -> list[dict]:
    from triton import next_power_of_2

    from tinyvllm.attention.kv_cache_write import PAD_SLOT_ID

    return [
        dict(id=f"kv_write-sm{cc}-{dtype}-h{heads}-d{head}-s{block}", kernel="kv_write", cc=cc, dtype=dtype,
             consts=dict(NUM_KV_HEADS=heads, HEAD_SIZE=head, BLOCK_SIZE=block, HEADS_PADDED=next_power_of_2(heads),
                         PAD_SLOT=PAD_SLOT_ID))  # fmt: skip
        for cc in (80, 90) for dtype in DTYPES for heads, head, block in ((8, 128, 16), (3, 64, 32))
    ] + [
        dict(id=f"kv_write-sm90-{dtype}-h{t['kv_heads']}-d{t['head']}-s{t['block']}-tiny", kernel="kv_write", cc=90,
             dtype=dtype, consts=dict(NUM_KV_HEADS=t["kv_heads"], HEAD_SIZE=t["head"], BLOCK_SIZE=t["block"],
                                      HEADS_PADDED=next_power_of_2(t["kv_heads"]), PAD_SLOT=PAD_SLOT_ID))
        for dtype in ("bfloat16", "float32") for t in (TINY_SHAPE,)
    ]


def rms_norm_cases() -> list[dict]:
    """Qwen3-0.6B's hidden size and head size, a 7B's hidden size, the tiny models' head size."""
    sizes = {80: (1024, 128), 90: (1024, 128, 4096, TINY_SHAPE["head"])}
    return [
        dict(id=f"rms_norm-sm{cc}-{dtype}-n{size}", kernel="rms_norm", cc=cc, dtype=dtype,
             consts=dict(SIZE=size, BLOCK=size))  # fmt: skip
        for cc in (80, 90) for dtype in DTYPES for size in sizes[cc]
    ]


def add_rms_norm_cases() -> list[dict]:
    """The residual add fused into the norm (rms_norm.py NOTE 3): hidden sizes only."""
    sizes = {80: (1024,), 90: (1024, 4096, 64)}  # 64: the tiny models' hidden size
    return [
        dict(id=f"add_rms_norm-sm{cc}-{dtype}-n{size}", kernel="add_rms_norm", cc=cc, dtype=dtype,
             consts=dict(SIZE=size, BLOCK=size))  # fmt: skip
        for cc in (80, 90) for dtype in DTYPES for size in sizes[cc]
    ]


def rotary_cases() -> list[dict]:
    """Qwen3-0.6B's heads (16 q, 8 k, of 128), a Llama-3-8B's (32, 8), the tiny models' (4, 2,
    of 16); compiled with the launcher's ``enable_fp_fusion=False`` (rotary.py NOTE 2)."""
    from triton import next_power_of_2

    shapes = {80: ((16, 8, 128),), 90: ((16, 8, 128), (32, 8, 128), (4, 2, TINY_SHAPE["head"]))}
    cases = [
        dict(id=f"rotary-sm{cc}-{dtype}-h{h}-kv{kv}-d{d}", kernel="rotary", cc=cc, dtype=dtype,
             consts=dict(HALF=d // 2, BLOCK_HALF=next_power_of_2(d // 2), Q_HEADS=h, K_HEADS=kv) | NO_KV_WRITE,
             options=dict(enable_fp_fusion=False))  # fmt: skip
        for cc in (80, 90) for dtype in DTYPES for h, kv, d in shapes[cc]
    ]
    # The control: the same kernel with fusion left on, which must show fused multiply-adds.
    control = next(c for c in cases if c["id"] == "rotary-sm90-bfloat16-h16-kv8-d128")
    return cases + with_kv_write(cases, "h32-kv8-d128") + [
        dict(control, id=control["id"] + "-fusion-on", options=dict(enable_fp_fusion=True), control=True)]  # fmt: skip


# The rotating kernels' KV write (rotary.py NOTE 4, qk_norm_rotary.py NOTE 3): off, and on at block size 16.
NO_KV_WRITE = dict(WRITE_KV=False, BLOCK_SIZE=1, PAD_SLOT=-1)


def with_kv_write(cases: list[dict], shape: str) -> list[dict]:
    """The cases of ``shape`` once more with the KV write compiled in."""
    return [dict(case, id=case["id"] + "-write-kv", consts=case["consts"] | dict(WRITE_KV=True, BLOCK_SIZE=16),
                 write_kv=True) for case in cases if case["id"].endswith(shape)]  # fmt: skip


def qk_norm_rotary_cases() -> list[dict]:
    """Qwen3's fused q/k norm and rotary: Qwen3-0.6B's heads and the tiny Qwen3's; fusion off;
    and with the KV write (qk_norm_rotary.py NOTE 3) at Qwen3-0.6B's heads, block size 16."""
    from triton import next_power_of_2

    shapes = {80: ((16, 8, 128),), 90: ((16, 8, 128), (4, 2, TINY_SHAPE["head"]))}
    cases = [
        dict(id=f"qk_norm_rotary-sm{cc}-{dtype}-h{h}-kv{kv}-d{d}", kernel="qk_norm_rotary", cc=cc, dtype=dtype,
             consts=dict(HALF=d // 2, BLOCK_HALF=next_power_of_2(d // 2), Q_HEADS=h, K_HEADS=kv) | NO_KV_WRITE,
             options=dict(enable_fp_fusion=False))  # fmt: skip
        for cc in (80, 90) for dtype in DTYPES for h, kv, d in shapes[cc]
    ]
    return cases + with_kv_write(cases, "h16-kv8-d128")


def silu_and_mul_cases() -> list[dict]:
    """The MLP's activation: Qwen3-0.6B's intermediate size (3072, three blocks of 1024) and the
    tiny models' (128, one block), with libdevice's expf as the launcher compiles it on CUDA."""
    from tinyvllm.models.activation import BLOCK

    sizes = {80: (3072,), 90: (3072, 128)}
    return [
        dict(id=f"silu_and_mul-sm{cc}-{dtype}-i{size}", kernel="silu_and_mul", cc=cc, dtype=dtype,
             consts=dict(SIZE=size, BLOCK=min(BLOCK, size), LIBDEVICE=True))  # fmt: skip
        for cc in (80, 90) for dtype in DTYPES for size in sizes[cc]
    ]


def greedy_cases() -> list[dict]:
    """The greedy draw (sample/ops/greedy.py) on float32 scores, as the sampler hands them: the
    launcher's block for Qwen3's 151,936-id vocabulary (many blocks a row) and the tiny models' 512."""
    from tinyvllm.sample.ops.greedy import BLOCK, NO_TOKEN, NUM_WARPS

    return [
        dict(id=f"greedy-sm{cc}-float32-{vocab}", kernel="greedy", cc=cc, dtype="float32",
             consts=dict(BLOCK=block, NO_TOKEN_ID=NO_TOKEN), options=dict(num_warps=NUM_WARPS))  # fmt: skip
        for cc in (80, 90) for vocab, block in (("qwen3", BLOCK), ("tiny", 512))
    ]


# One case of each kernel, Qwen3-0.6B's shapes in bf16 at sm_90, once more launched dependent
# (dependent_launch.py): USE_PDL on and Triton's launch_pdl option, as a sm_90 launch passes them.
PDL_OF = ("attention-sm90-bfloat16-g2-decode-seg1-d128-s16", "attention-sm90-bfloat16-g2-decode-seg16-d128-s16",
          "attention-sm90-bfloat16-g2-prefill-seg1-d128-s16", "merge-sm90-bfloat16-d128", "kv_write-sm90-bfloat16-h8-d128-s16",
          "rms_norm-sm90-bfloat16-n1024", "add_rms_norm-sm90-bfloat16-n1024", "rotary-sm90-bfloat16-h16-kv8-d128",
          "rotary-sm90-bfloat16-h32-kv8-d128-write-kv", "qk_norm_rotary-sm90-bfloat16-h16-kv8-d128",
          "qk_norm_rotary-sm90-bfloat16-h16-kv8-d128-write-kv", "silu_and_mul-sm90-bfloat16-i3072", "greedy-sm90-float32-qwen3")  # fmt: skip


def pdl_cases(cases: list[dict]) -> list[dict]:
    by_id = {case["id"]: case for case in cases}
    return [dict(by_id[name], id=name + "-pdl", consts=by_id[name]["consts"] | dict(USE_PDL=True),
                 options=(by_id[name].get("options") or {}) | dict(launch_pdl=True), pdl=True) for name in PDL_OF]  # fmt: skip


def all_cases() -> list[dict]:
    cases = (attention_cases() + prefill_sweep_cases() + merge_cases() + write_cases() + rms_norm_cases() + add_rms_norm_cases()
             + rotary_cases() + qk_norm_rotary_cases() + silu_and_mul_cases() + greedy_cases())  # fmt: skip
    return cases + pdl_cases(cases)


def _kernel_and_types(case: dict):
    from tinyvllm.attention import kv_cache_write, triton_attention
    from tinyvllm.models import activation, qk_norm_rotary, rms_norm, rotary
    from tinyvllm.sample.ops import greedy

    t = DTYPES[case["dtype"]]
    if case["kernel"] == "attention":
        fn = triton_attention._paged_attention_kernel
        types = dict(out_ptr=t, part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", query_ptr=t,
                     key_cache_ptr=t, value_cache_ptr=t, key_ptr=t, value_ptr=t, query_start_loc_ptr="*i32",
                     seq_lens_ptr="*i32", block_table_ptr="*i32", scale="fp32")  # fmt: skip
    elif case["kernel"] == "merge":
        fn = triton_attention._merge_segments_kernel
        types = dict(out_ptr=t, part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32")
    elif case["kernel"] == "qk_norm_rotary":
        fn = qk_norm_rotary._qk_norm_rotary_kernel
        types = dict(q_ptr=t, k_ptr=t, q_weight_ptr=t, k_weight_ptr=t, cos_ptr=t, sin_ptr=t, eps="fp32")
        if case.get("write_kv"):  # the cache pointers it stores through (unread otherwise: i32 placeholders)
            types |= dict(v_ptr=t, key_cache_ptr=t, value_cache_ptr=t, slot_mapping_ptr="*i64")
    elif case["kernel"] == "rotary":
        fn = rotary._rotary_kernel
        types = dict(q_ptr=t, k_ptr=t, cos_ptr=t, sin_ptr=t)
        if case.get("write_kv"):
            types |= dict(v_ptr=t, key_cache_ptr=t, value_cache_ptr=t, slot_mapping_ptr="*i64")
    elif case["kernel"] == "add_rms_norm":
        fn = rms_norm._add_rms_norm_kernel
        types = dict(x_ptr=t, delta_ptr=t, weight_ptr=t, out_ptr=t, sum_ptr=t, eps="fp32")
    elif case["kernel"] == "greedy":
        fn = greedy._greedy_kernel
        types = dict(scores_ptr=t, tokens_ptr="*i64", no_token_ptr="*i1", host_ids_ptr="*i64")
    elif case["kernel"] == "silu_and_mul":
        fn = activation._silu_and_mul_kernel
        types = dict(x_ptr=t)
    elif case["kernel"] == "rms_norm":
        fn = rms_norm._rms_norm_kernel
        types = dict(x_ptr=t, weight_ptr=t, out_ptr=t, eps="fp32")
    else:
        fn = kv_cache_write._write_kv_cache_kernel
        types = dict(key_ptr=t, value_ptr=t, key_cache_ptr=t, value_cache_ptr=t, slot_mapping_ptr="*i64")
    return fn, types


# 16-bit constants that make an fma a single operation: -0.0 as the addend (a multiply) and
# 1.0 as a factor (an add), in bfloat16 and float16.
_NEGATIVE_ZERO_16 = {"0x8000"}
_ONE_16 = {"0x3f80", "0x3c00"}


def contracted_fmas(ptx: str) -> int:
    """The ``fma`` instructions that fuse a real multiply with a real add. sm_80 has no
    bfloat16 multiply or add, so the compiler writes a bfloat16 multiply as ``fma(a, b, -0.0)``
    and an add as ``fma(a, 1.0, b)``: each rounds once, as the plain operation would, and is
    not counted."""
    consts = {reg: value.lower() for reg, value in re.findall(r"mov\.b16\s+(%\w+),\s*(0x[0-9A-Fa-f]+);", ptx)}
    count = 0
    for a, b, c in re.findall(r"fma\.rn\.\S+\s+%\w+,\s*(%\w+),\s*(%\w+),\s*(%\w+);", ptx):
        single = consts.get(c) in _NEGATIVE_ZERO_16 or consts.get(a) in _ONE_16 or consts.get(b) in _ONE_16
        count += not single
    return count


def compile_case(case: dict) -> dict:
    """Compile one case for ``sm_<cc>``; every non-pointer, non-constexpr argument is an i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, types = _kernel_and_types(case)
    types |= case.get("types", {})  # a case's own: the attention kernel's tensor descriptors
    consts = dict(USE_PDL=False) | case["consts"]  # every kernel takes USE_PDL (dependent_launch.py); off unless a case says
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name], constexprs[(i,)] = "constexpr", consts[name]
        else:
            signature[name] = types.get(name, "i32")
            if name in case.get("divisible_by_16", ()):
                attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        kernel = triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", case["cc"], 32), options=case.get("options")
        )
    except Exception as exc:  # reported, not raised: the test names the case
        return dict(id=case["id"], error=f"{type(exc).__name__}: {str(exc)[:2000]}")
    ptx = kernel.asm["ptx"]
    target = next((line for line in ptx.splitlines() if line.startswith(".target")), "")
    return dict(id=case["id"], stages=sorted(kernel.asm), target=target, cubin_bytes=len(kernel.asm.get("cubin", b"")),
                shared_bytes=kernel.metadata.shared, fused_multiply_adds=contracted_fmas(ptx),
                async_copies=ptx.count("cp.async."), copies_left_in_flight=copies_left_in_flight(ptx),
                tma_copies=ptx.count("cp.async.bulk.tensor"), div_rn=ptx.count("div.rn.f32"),
                div_approx=ptx.count("div.full.f32") + ptx.count("div.approx.f32"),
                ex2_ftz=ptx.count("ex2.approx.ftz.f32"), ex2_plain=ptx.count("ex2.approx.f32"),
                pdl_waits=ptx.count("griddepcontrol.wait"), pdl_triggers=ptx.count("griddepcontrol.launch_dependents"),
                memory_ops_before_wait=memory_ops_before_wait(ptx))  # fmt: skip


# A load, store, asynchronous copy or atomic on global memory, in PTX.
GLOBAL_MEMORY_OP = re.compile(r"\b(?:ld|st)(?:\.\w+)*\.global\b|\bcp\.async\b|\b(?:atom|red)\.")


def memory_ops_before_wait(ptx: str) -> int | None:
    """The global-memory instructions before the first ``griddepcontrol.wait`` (None without one):
    a dependent launch must read and write nothing before it (dependent_launch.py NOTE 1)."""
    head, found, _ = ptx.partition("griddepcontrol.wait")
    return len(GLOBAL_MEMORY_OP.findall(head)) if found else None


def copies_left_in_flight(ptx: str) -> int:
    """The most asynchronous copy groups any ``cp.async.wait_group N`` lets stay in flight: 0 when
    every wait drains them all, so no load overlaps the math of the tile before it."""
    return max((int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)), default=0)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: under the interpreter @triton.jit kernels are not compiled")
    with ProcessPoolExecutor(max_workers=2) as pool:
        for result in pool.map(compile_case, all_cases()):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
