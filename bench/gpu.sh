#!/usr/bin/env bash
# Everything of issue 5 that needs a GPU, in one command, from any directory:
#   bash bench/gpu.sh
# 1. the `gpu`-marked tests (Triton against the reference, wide shapes, every dtype);
# 2. bench/attention.py (Triton vs SDPA, decode and prefill; JSON in bench/results/).
# Needs a CUDA device with torch, triton, pytest and hypothesis installed; no network.
# Budget: under nine minutes on an H100 (each step has its own time limit below).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "bench/gpu.sh: no CUDA device visible to torch; nothing to run" >&2
    exit 1
}

status=0
echo "== gpu tests =="
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider || status=$?
echo "== bench/attention.py =="
timeout 220 python3 bench/attention.py || status=$?
exit "$status"
