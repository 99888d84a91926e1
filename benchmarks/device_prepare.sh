#!/usr/bin/env bash
# Prepare, here, what the device check carries to a bare accelerator machine (no network there):
#   .whl/              cp312 manylinux wheels of what that machine lacks or has too old (grpcio,
#                      its health and reflection services, protobuf: the versions of constraints.txt)
#   .device/tokenizer/ the default model's tokenizer files and config (a few MB; no weights: the
#                      check builds random-weight models there from configs)
# Both folders are ignored by git. Then, on the device machine, with `.whl` and `.device` carried:
#   bash benchmarks/gpu_check.sh --out "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
pin() { grep -i "^$1==" constraints.txt | cut -d= -f3; }
mkdir -p .whl .device/tokenizer
for name in grpcio grpcio-health-checking grpcio-reflection protobuf; do
    version="$(pin "$name")"
    [[ -n "$version" ]] || { echo "device_prepare: $name is not pinned in constraints.txt" >&2; exit 1; }
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$name==$version"
done
model="$("$PY" -m pdserve.engine.model_fetch)"
for f in tokenizer.json tokenizer_config.json chat_template.jinja config.json special_tokens_map.json; do
    [[ -f "$model/$f" ]] && cp "$model/$f" .device/tokenizer/
done
du -sh .whl .device | sed 's/^/device_prepare: /' >&2
ls .whl >&2
