#!/usr/bin/env bash
# The GPU check, one command on a CUDA machine (under 10 minutes on one GPU):
#   exactness tests on cuda, 1P1D on the GPU(s), TTFT/ITL and K/V hand-off bandwidth, then a table.
# Run from the repository root with pdserve's environment active:
#   bash benchmarks/gpu_check.sh            # writes benchmarks/reports/gpu-check-<UTC date>.json
# Extra arguments go to benchmarks/gpu_check.py (e.g. --only exactness kv, --dtype float16).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/proto${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python}"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device visible')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
mkdir -p benchmarks/reports
out="benchmarks/reports/gpu-check-$(date -u +%Y-%m-%dT%H%M).json"
timeout 600 "$PYTHON" benchmarks/gpu_check.py --out "$out" "$@"
echo "rows written to $out"
