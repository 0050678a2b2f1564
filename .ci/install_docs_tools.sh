#!/usr/bin/env bash
# Debian's curl, jq and openssl, which the docs' own commands use (curl to talk to a server,
# jq to pick fields from JSON, openssl to make an admin token): every command of the docs runs
# in tests/integration/test_docs_commands.py. Idempotent: does nothing when all three are here.
set -euo pipefail
if command -v curl >/dev/null 2>&1 && command -v jq >/dev/null 2>&1 \
    && command -v openssl >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends ca-certificates curl jq openssl >/dev/null
command -v curl && command -v jq && command -v openssl
