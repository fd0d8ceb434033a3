"""bench/attention_sass.py: its --quick run compiles one prefill config for sm_90 both ways,
disassembles it, and finds the loops the module header describes (no GPU needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_attention_sass_quick_counts_the_kv_tile_loops_both_ways(tmp_path):
    out = tmp_path / "attention_sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "bench" / "attention_sass.py"), "--quick", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    cache, rows, plain = record["rows"]
    assert (cache["step_kv"], rows["step_kv"], plain["kernel"]) == (False, True, "plain_flash") and record["target"] == "sm_90"
    assert (cache["block_m"], cache["kv_tile"], cache["num_stages"]) == (64, 32, 3)  # the default prefill config
    # the cache walk: the full tiles' loop nested in the loop over groups of block ids (NOTE 3), then the
    # diagonal tiles; with the step's rows, the context's walk the same way, then the step's two loops
    assert len(cache["kv_tile_loops"]) == 3 and len(rows["kv_tile_loops"]) == 5
    full_cache, groups, diagonal = cache["kv_tile_loops"]
    for loop in (full_cache, diagonal, rows["kv_tile_loops"][3]):
        # 64 rows x 32 keys, head size 128: Q K^T in 8 HGMMAs of k=16, P V in 2; an exp2 per score a thread
        assert loop["opcodes"]["HGMMA"] == 10 and loop["opcodes"]["MUFU"] >= 16
    assert groups["instructions"] > full_cache["instructions"]  # the group loop holds the tile loop
    # NOTE 3: the full tiles' loop copies K and V and nothing else, as the step's rows do; the
    # diagonal tiles' loop copies their block ids too
    step_full = rows["kv_tile_loops"][3]
    assert "LDG" not in full_cache["opcodes"]
    assert full_cache["opcodes"]["LDGSTS"] == step_full["opcodes"]["LDGSTS"] < diagonal["opcodes"]["LDGSTS"]
    assert max(cache["copy_waits"]) == max(rows["copy_waits"]) == 2  # 3 stages: two copy groups in flight
    # the plain baseline (bench/plain_flash.py) at the same config: its unmasked loop, then the diagonal's,
    # with the same matrix multiplies and exponentials a trip as the paged kernel's loops
    assert len(plain["kv_tile_loops"]) == 2 and max(plain["copy_waits"]) == 2
    assert all(loop["opcodes"]["HGMMA"] == 10 and loop["opcodes"]["MUFU"] >= 16 for loop in plain["kv_tile_loops"])
