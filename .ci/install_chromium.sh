#!/usr/bin/env bash
# Debian's chromium, headless, for the test that renders `hpcml report`'s page and checks it
# loads with no console message and a non-blank screenshot. Idempotent.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
command -v chromium
