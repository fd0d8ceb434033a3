#!/usr/bin/env bash
# Everything that needs a GPU, in one command that fits eight minutes, from any directory:
#   bash bench/gpu.sh [--out DIR] [--quick] [--dry-run] [--wheels DIR] [--tests-left-in SUMMARY]
# Steps, each with its own time budget (bench/gpu_check.py has them and says what each one
# measures): the environment; `pytest -m gpu`; throughput on nano-vllm's workload against
# transformers; decode latency per cudagraph_mode against NONE; prefix caching on / off.
# Leaves gpu_summary.json and gpu.log in DIR (default bench/results/). --dry-run runs the
# same steps on the CPU with the tiny model (CI does); --quick halves every workload;
# --tests-left-in SUMMARY runs only the gpu tests an earlier run's gpu_summary.json left for time.
# Needs torch, triton, transformers, pytest and hypothesis; no network, nothing to install. The
# wheels in .whl/ (bench/fetch_gpu_wheels.sh; the device tool's carry: [".whl"]), if any, are
# unpacked first into a temporary folder on every step's path: xgrammar, for structured outputs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec python3 bench/gpu_check.py "$@"
