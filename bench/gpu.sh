#!/usr/bin/env bash
# Everything that needs a GPU, in one command, from any directory:
#   bash bench/gpu.sh
# 1. every `gpu`-marked test (Triton attention against the reference, wide shapes, every
#    dtype; the engine against transformers in float32 and bfloat16);
# 2. bench/attention.py   (Triton vs SDPA, decode and prefill; JSON in bench/results/);
# 3. bench/throughput.py  (nano-vllm's workload, tinyvllm vs transformers, 3 interleaved
#    repeats; JSON in bench/results/);
# 4. bench/cudagraphs.py  (decode latency and throughput under each cudagraph_mode, against NONE;
#    JSON in bench/results/);
# 5. bench/prefix_caching.py --gpu  (prefix caching on vs off at ~49% and ~37% hits: input
#    throughput and mean TTFT, as in vLLM PR #9668's table; JSON in bench/results/).
# Needs a CUDA device with torch, triton, transformers, pytest and hypothesis; no network,
# nothing to install. Each step has its own time limit; together they allow at most
# eighteen and a half minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "bench/gpu.sh: no CUDA device visible to torch; nothing to run" >&2
    exit 1
}

status=0
echo "== gpu tests =="
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider || status=$?
echo "== bench/attention.py =="
timeout 130 python3 bench/attention.py || status=$?
echo "== bench/throughput.py =="
timeout 340 python3 bench/throughput.py || status=$?
echo "== bench/cudagraphs.py =="
timeout 200 python3 bench/cudagraphs.py || status=$?
echo "== bench/prefix_caching.py --gpu =="
timeout 200 python3 bench/prefix_caching.py --gpu || status=$?
exit "$status"
