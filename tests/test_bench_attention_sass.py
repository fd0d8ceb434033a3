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
    cache, rows = record["rows"]
    assert (cache["step_kv"], rows["step_kv"]) == (False, True) and record["target"] == "sm_90"
    # the cache walk: full then diagonal tiles; with the step's rows, the context's two loops and the step's two
    assert len(cache["kv_tile_loops"]) == 2 and len(rows["kv_tile_loops"]) == 4
    for loop in cache["kv_tile_loops"] + rows["kv_tile_loops"]:
        # 64 rows x 64 keys, head size 128: Q K^T in 8 HGMMAs of k=16, P V in 4; one exp2 per score a thread
        assert loop["opcodes"]["HGMMA"] == 12 and loop["opcodes"]["MUFU"] >= 32
    # the step's full tiles need no block id: fewer instructions a tile than the cache's full tiles
    assert rows["kv_tile_loops"][2]["instructions"] < cache["kv_tile_loops"][0]["instructions"]
    assert "LDG" in cache["kv_tile_loops"][0]["opcodes"] and "LDG" not in rows["kv_tile_loops"][2]["opcodes"]
