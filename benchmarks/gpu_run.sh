#!/usr/bin/env bash
# `make gpu`: on a GPU machine that starts bare (its own python3 with torch + CUDA, no internet),
# install what travels and run benchmarks/gpu_proof.py; on a machine without CUDA the same
# command is the dry rehearsal. hpcml itself is not pip-installed: src/ goes on PYTHONPATH, so
# nothing resolves dependencies against (or replaces) the machine's own torch.
#   OUT=DIR make gpu        results into DIR (default benchmarks/results/gpu; a dry rehearsal:
#                           a temporary folder)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && ! "$PY" -c "import torch" 2>/dev/null; then PY=.venv/bin/python; fi
if compgen -G ".whl/*.whl" > /dev/null \
   && "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  # The wheels `make gpu-wheels` put here: only what the image lacks, no dependency resolution.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hpcml-site .whl/*.whl
  export PYTHONPATH="/tmp/hpcml-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_proof.py ${OUT:+--out "$OUT"} "$@"
