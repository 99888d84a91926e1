#!/usr/bin/env bash
# Regenerate the Python gRPC stubs of the pdserve.v1 wire contract.
#
# Usage: proto/generate.sh [OUT_DIR]
#   OUT_DIR defaults to the proto/ directory itself (the committed stubs).
#   Python: $PYTHON if set, else the repo's .venv/bin/python if present,
#   else python3. Works from any current directory.
# Generated modules import `from pdserve.v1 import ...`: put proto/ (or OUT_DIR)
# on sys.path. Never add proto/__init__.py (`proto` belongs to proto-plus).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
out="${1:-$here}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x "$repo/.venv/bin/python" ]]; then
  py="$repo/.venv/bin/python"
else
  py=python3
fi

cd "$repo"
"$py" -m grpc_tools.protoc -I proto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/pdserve/v1/*.proto
