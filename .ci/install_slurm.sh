#!/usr/bin/env bash
# Installs Debian's SLURM (slurm-wlm: slurmctld, slurmd and the client commands) for
# tests/e2e/test_slurm.py, which starts its own single-node cluster from a temp dir
# (AuthType=auth/none, SlurmUser=root): no service is enabled, no config written here.
# Runs as root on Debian; idempotent. Without it the SLURM test skips and says why.
set -euo pipefail
# Every program tests/e2e/slurm_cluster.py needs (DAEMONS and CLIENTS).
installed() {
  command -v slurmctld && command -v slurmd && command -v sbatch && command -v squeue \
    && command -v scontrol && command -v scancel && command -v sinfo && command -v srun
}
if installed >/dev/null; then
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
installed >/dev/null
echo "installed: $(slurmctld -V)"
