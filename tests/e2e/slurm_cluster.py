"""A real single-node SLURM cluster for tests: slurmctld + slurmd from Debian's slurm-wlm,
started in the foreground with AuthType=auth/none, SlurmUser=root, an absolute SLURM_CONF and
state/spool folders under a temp dir. Nothing outside that folder is touched."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd")
GPU_FILES = ("/dev/null", "/dev/zero")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")


def why_unavailable() -> str | None:
    """None when a cluster can be started here, else the reason (for pytest.skip)."""
    missing = [p for p in (*DAEMONS, *CLIENTS) if shutil.which(p) is None]
    if missing:
        return (
            f"SLURM is not installed ({', '.join(missing)} missing); run .ci/install_slurm.sh "
            "as root (apt-get install slurm-wlm)"
        )
    if os.geteuid() != 0:
        return "slurmd must run as root (SlurmUser=root) to start job steps"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.node = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.mem_mb = 1000
        self.gpus = len(GPU_FILES)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        cpus = self.cpus
        r = self.root
        (r / "gres.conf").write_text("".join(f"Name=gpu File={f}\n" for f in GPU_FILES))
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=hpcmltest",
                    # Two stand-in GPUs (device files that exist everywhere), so that a job's
                    # --gpus-per-node and --mem-per-gpu are checked by the real scheduler.
                    "GresTypes=gpu",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "AuthType=auth/none",
                    "CredType=cred/none",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    # No cgroups, systemd or accounting daemon in a container or CI runner.
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "SchedulerType=sched/builtin",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core_Memory",  # memory is a resource jobs ask for
                    "MpiDefault=none",
                    "SwitchType=switch/none",
                    "ReturnToService=2",
                    "JobRequeue=1",
                    "MinJobAge=600",
                    "KillWait=30",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={self.mem_mb} "
                    f"Gres=gpu:{self.gpus} State=UNKNOWN",
                    f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def start(self, timeout: float = 60) -> None:
        self.write_conf()
        for daemon in DAEMONS:
            log = open(self.root / "log" / f"{daemon}.out", "wb")  # noqa: SIM115 - lives with it
            self.procs.append(
                subprocess.Popen([daemon, "-D"], env=self.env, stdout=log, stderr=log)
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a SLURM daemon exited ({p.args}): {self.logs()}")
            if self.node_state().startswith("idle"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM node did not become idle in {timeout} s: {self.logs()}")

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"):
            path = self.root / "log" / name
            if path.exists():
                out.append(f"--- {name}\n" + path.read_text()[-2000:])
        return "\n".join(out)

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr or proc.stdout}")
        return proc

    def job_state(self, job_id: str) -> dict[str, str]:
        """JobState, Reason, Restarts... of `scontrol show job` as a dict."""
        text = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        fields: dict[str, str] = {}
        for token in text.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def batch_step_alive(self, job_id: str) -> bool:
        """Whether the slurmstepd of the job's batch step still runs on this (the only) node."""
        tag = f"[{job_id}.batch]".encode()
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if tag in cmdline.read_bytes():
                    return True
            except OSError:
                continue
        return False

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()

    def stop(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
