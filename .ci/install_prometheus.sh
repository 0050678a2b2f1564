#!/usr/bin/env bash
# promtool (Debian's prometheus package) for the test that checks /metrics with
# `promtool check metrics`. Idempotent: does nothing when promtool is already installed.
set -euo pipefail
if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# --no-install-recommends: only the binaries, no service setup beyond the package's own.
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool
