#!/usr/bin/env bash
# Debian's PostgreSQL server, for tests/integration/test_tune_postgres.py, which starts its own
# server from a temp dir (initdb + pg_ctl as the `postgres` user, loopback only): no service is
# enabled and no cluster is made here. Debian keeps initdb and pg_ctl in
# /usr/lib/postgresql/<version>/bin; they are linked into /usr/local/bin. Runs as root;
# idempotent. Without it the test skips (under CI=true it fails) and says why.
set -euo pipefail
installed() {
  command -v initdb && command -v pg_ctl && command -v postgres && id -u postgres
}
if installed >/dev/null 2>&1; then
  echo "postgresql already installed: $(postgres --version)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install_postgres.sh must run as root (apt-get)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi
# The package starts a cluster through systemd where there is one; the test runs its own.
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
  systemctl disable --now postgresql >/dev/null 2>&1 || true
fi
bindir=$(dirname "$(ls -d /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")
for program in initdb pg_ctl postgres; do
  ln -sf "$bindir/$program" "/usr/local/bin/$program"
done
installed >/dev/null
echo "installed: $(postgres --version)"
