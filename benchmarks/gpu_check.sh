#!/usr/bin/env bash
# The device check, one command (under 8 minutes on one H200; see benchmarks/gpu_check.py):
#   bash benchmarks/gpu_check.sh [--device cpu] [--out DIR] [gpu_check.py options]
# On a bare accelerator machine (its own Python and torch, no network): carry `.whl` and `.device`
# (made here by `bash benchmarks/device_prepare.sh`); what is missing or too old there is installed
# from the carried wheels into /tmp/pdserve-site, first on PYTHONPATH (benchmarks/device_env.sh). Nothing
# is downloaded: the models are built there with random weights from real configs. Results: a table,
# and gpu-check.json under --out (default $OUT when set). `--device cpu` is the dry run the test suite runs.
set -euo pipefail
source "$(dirname "$0")/device_env.sh" "$@"
exec timeout 900 "$PYTHON" benchmarks/gpu_check.py "$@"
