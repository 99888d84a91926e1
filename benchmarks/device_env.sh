# Sourced by the device checks (gpu_check.sh, gpu_disagg_check.sh): the set-up they share on a bare
# accelerator machine (its own Python and torch, no network). From the repository root, it picks the
# Python ($PYTHON, else .venv's, else python3), installs from the carried `.whl` what is missing or
# too old into /tmp/pdserve-site (benchmarks/device_deps.py; the wheels are made here by
# `bash benchmarks/device_prepare.sh`), puts that folder and the repository first on PYTHONPATH, and
# prints the GPU unless the arguments hold `--device cpu` (the dry run).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
site="$("$PYTHON" benchmarks/device_deps.py --wheels .whl --target /tmp/pdserve-site)"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ " $* " != *" --device cpu "* ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
