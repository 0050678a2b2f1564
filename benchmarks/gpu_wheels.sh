#!/usr/bin/env bash
# `make gpu-wheels`: download, here, the wheels of benchmarks/gpu_wheels.txt for the GPU image's
# Python (3.12, x86-64 manylinux) into .whl/ (git-ignored), which `make gpu` installs there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
rm -rf .whl && mkdir .whl
grep -v '^#' benchmarks/gpu_wheels.txt | grep -v '^$' | while read -r req; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$req"
done
ls -la .whl
