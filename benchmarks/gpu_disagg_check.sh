#!/usr/bin/env bash
# Disaggregation on one GPU, one command (under 8 minutes on one H200; see benchmarks/gpu_disagg_check.py):
#   bash benchmarks/gpu_disagg_check.sh [--device cpu] [--out DIR] [gpu_disagg_check.py options]
# K/V hand-off bandwidth (cuda_ipc and pinned-host staging against a device-to-device copy), 1P1D
# against one colocated worker on an interference workload, and a kill -9 of a prefill worker with
# transfers in flight. Same set-up as the device check (benchmarks/device_env.sh): carry `.whl` and
# `.device` (made here by `bash benchmarks/device_prepare.sh`); nothing is downloaded. Results: a table,
# and gpu-disagg-check.json under --out (default $OUT). `--device cpu` is the dry run the suite runs.
set -euo pipefail
source "$(dirname "$0")/device_env.sh" "$@"
limit=480  # the device run's bound; the CPU dry run shares a loaded machine with test suites
[[ " $* " == *" --device cpu "* ]] && limit=900
exec timeout "$limit" "$PYTHON" benchmarks/gpu_disagg_check.py "$@"
