#!/usr/bin/env bash
# Debian's prometheus-alertmanager package: amtool, which tests/unit/test_observe_rules.py runs
# on the Alertmanager configuration `hpcml observe up` writes (check-config, and which receiver
# each alert routes to). Idempotent: does nothing when amtool is already installed.
set -euo pipefail
if command -v amtool >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# --no-install-recommends: only the binaries; no service is started by the tests.
$SUDO apt-get install -y -qq --no-install-recommends prometheus-alertmanager >/dev/null
command -v amtool
