#!/usr/bin/env bash
# Debian's prometheus package: promtool for the tests that check /metrics and the alerting
# rules, and the prometheus server that test_observe_prometheus.py runs on
# loopback. Idempotent: does nothing when both are already installed.
set -euo pipefail
if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# --no-install-recommends: only the binaries, no service setup beyond the package's own.
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool
