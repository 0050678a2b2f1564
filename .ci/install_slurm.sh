#!/usr/bin/env bash
# Installs Debian's SLURM (slurm-wlm: slurmctld, slurmd and the client commands) for
# tests/e2e/test_slurm.py, which starts its own single-node cluster from a temp dir
# (AuthType=auth/none, SlurmUser=root): no service is enabled, no config written here.
# Runs as root on Debian; idempotent. Without it the SLURM test skips and says why.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
  echo "slurm already installed: $(slurmctld -V)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install_slurm.sh must run as root (apt-get)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurm-wlm >/dev/null
# The packages start daemons through systemd where there is one; the test runs its own.
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
  systemctl disable --now slurmctld slurmd munge >/dev/null 2>&1 || true
fi
echo "installed: $(slurmctld -V)"
