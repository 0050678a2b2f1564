#!/usr/bin/env bash
# Triton's perf_analyzer, for tests/integration/test_serve_clients.py (it measures `hpcml serve`
# over HTTP and gRPC). Idempotent: does nothing when perf_analyzer is already on PATH.
#
# From PyPI, with pip: the `perf-analyzer` wheels (2.58 and later) and the tritonclient wheels
# that bundled the binary from 2.52 on need glibc 2.38, newer than Debian 12's 2.36. The binary in
# tritonclient 2.51.0's wheel needs glibc 2.34 and is built with GPU support: it needs CUDA's
# runtime library libcudart.so.12 to start, but no GPU (CUDA is called only for CUDA shared
# memory, which HTTP and gRPC runs without --shared-memory do not use). NVIDIA's
# nvidia-cuda-runtime-cu12 wheel (3.5 MB, no torch) has that library. Both go into a folder of
# their own with --no-deps, away from the project's virtualenv (whose tritonclient is newer), and
# a wrapper on PATH points the binary at the library.
set -euo pipefail
TRITONCLIENT_VERSION=2.51.0
CUDA_RUNTIME_VERSION=12.9.79
if command -v perf_analyzer >/dev/null 2>&1; then
  exit 0
fi
DEST=/opt/hpcml-tools/perf-analyzer
BIN=/usr/local/bin
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
PYTHON=${PYTHON:-python3}
# libb64 (base64 for its HTTP client) is the one library of its own that Debian has to add.
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends libb64-0d >/dev/null
$SUDO "$PYTHON" -m pip install -q --no-deps --upgrade --target "$DEST" \
  "tritonclient==$TRITONCLIENT_VERSION" "nvidia-cuda-runtime-cu12==$CUDA_RUNTIME_VERSION"
$SUDO tee "$BIN/perf_analyzer" >/dev/null <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$DEST/nvidia/cuda_runtime/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" \\
  exec "$DEST/bin/perf_analyzer" "\$@"
EOF
$SUDO chmod 755 "$BIN/perf_analyzer"
perf_analyzer --version  # starts: every library it needs is found
command -v perf_analyzer
