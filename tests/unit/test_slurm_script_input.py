"""User strings that `hpcml launch slurm` writes into an sbatch script cannot add lines to it
(issue 29): sbatch stops reading `#SBATCH` lines at the first line that is not one, so a job
name with a line break silently dropped every directive after it (and a second line could run
a command). Each is refused in one sentence (LaunchError, exit 2) before a script is written;
the CLI path is checked end to end once."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import ROOT, run_hpcml

from hpcml.errors import LaunchError
from hpcml.launch.slurm import SlurmJob, render_sbatch

BASE = {"config": Path("c.yaml"), "nodes": 1, "time": "01:00:00"}


@pytest.mark.parametrize(
    "field,value",
    [
        ("job_name", "train\n#SBATCH --partition=free"),
        ("job_name", "two words"),
        ("partition", "gpu\nrm -rf ~"),
        ("account", "ml'"),
        ("sbatch_extra", ["--qos=high\n--exclusive"]),
        ("sbatch_extra", ["qos=high"]),
        ("run_dir", Path("runs/a\nb")),
    ],
)
def test_a_string_that_would_add_a_line_is_refused(
    tmp_path: Path, field: str, value: object
) -> None:
    fields: dict[str, object] = {**BASE, "run_dir": tmp_path, field: value}
    with pytest.raises(LaunchError) as refused:
        SlurmJob(**fields)  # type: ignore[arg-type]
    assert "\n" not in refused.value.message


def test_accepted_strings_stay_on_their_directive_line(tmp_path: Path) -> None:
    job = SlurmJob(
        **BASE,  # type: ignore[arg-type]
        run_dir=tmp_path,
        job_name="llm-7b_v2.1",
        partition="gpu,gpu-long",
        account="proj@site",
        sbatch_extra=["--qos=high", "--exclusive"],
    )
    lines = render_sbatch(job).splitlines()
    for want in ("--job-name=llm-7b_v2.1", "--partition=gpu,gpu-long", "--account=proj@site"):
        assert f"#SBATCH {want}" in lines
    assert "#SBATCH --qos=high" in lines and "#SBATCH --exclusive" in lines


def test_the_cli_refuses_a_job_name_with_a_line_break(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model: {name: mlp}\ntrain: {checkpoint_every: 10}\n")
    proc = run_hpcml(
        "launch", "slurm", str(config), "--run-dir", str(tmp_path / "run"), "--nodes", "1",
        "--time", "01:00:00", "--cpus-per-task", "2", "--mem", "1G",
        "--job-name", "a\n#SBATCH --exclusive", check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("error: --job-name") and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "job.sbatch").exists()


def test_the_tune_array_script_runs_one_numbered_tune_worker_per_task(tmp_path: Path) -> None:
    """`--tune-workers 4`: a job array of 4 tasks, each `hpcml tune` on the study folder with
    its trials on `--nproc-per-node` processes, numbered by the array task id (each sampler
    gets its own seed); no training job's requeue or warning signal."""
    from hpcml.launch.slurm import render_tune_sbatch

    job = SlurmJob(**BASE, run_dir=tmp_path / "study", nproc_per_node=2, cpus_per_task=4)  # type: ignore[arg-type]
    lines = render_tune_sbatch(job, 4, []).splitlines()
    directives = [ln for ln in lines if ln.startswith("#SBATCH ")]
    assert "#SBATCH --array=0-3" in directives
    assert f"#SBATCH --output={(tmp_path / 'study').resolve()}/slurm-%A_%a.out" in directives
    assert not [d for d in directives if d.startswith(("#SBATCH --signal", "#SBATCH --requeue"))]
    (command,) = [ln for ln in lines if ln.startswith("exec ")]
    study = str((tmp_path / "study").resolve())
    assert (
        f" -m hpcml tune {Path('c.yaml').resolve()} --out {study} --workers 1 --nproc 2 " in command
    )
    assert command.endswith(' --first-worker "$SLURM_ARRAY_TASK_ID" --json')


def test_the_cli_refuses_tune_workers_on_several_nodes(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from hpcml.cli.app import app

    res = CliRunner().invoke(app, [
        "launch", "slurm", str(ROOT / "examples" / "tune_digits.yaml"), "--run-dir",
        str(tmp_path / "study"), "--nodes", "2", "--time", "01:00:00", "--cpus-per-task", "2",
        "--mem", "1G", "--tune-workers", "2",
    ])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert (
        res.output.startswith("error: --nodes 2 with --tune-workers")
        and "Traceback" not in res.output
    )
    assert not (tmp_path / "study").exists()
def test_multi_node_gpu_jobs_ask_for_whole_nodes_and_gpu_near_cores(tmp_path: Path) -> None:
    # Issue 29: another job on the same nodes shares their GPUs' links and the network the
    # collectives use; and cores far from the GPUs slow every host-to-device copy.
    gpu = {**BASE, "run_dir": tmp_path, "cpus_per_task": 32, "mem_per_gpu": "60G"}
    wanted = ["#SBATCH --exclusive", "#SBATCH --gres-flags=enforce-binding"]

    def lines(**kw: object) -> list[str]:
        return render_sbatch(SlurmJob(**{**gpu, **kw})).splitlines()  # type: ignore[arg-type]

    assert all(w in lines(nodes=2, gpus_per_node=4) for w in wanted)
    one_node = lines(nodes=1, gpus_per_node=4)
    assert not any(w in one_node for w in wanted)  # a single-node job may share its node
    assert all(w in lines(nodes=1, gpus_per_node=4, exclusive=True) for w in wanted)
    assert not any(w in lines(nodes=2, gpus_per_node=4, exclusive=False) for w in wanted)
    cpu = lines(nodes=2, gpus_per_node=0, mem_per_gpu=None, mem="8G", exclusive=True)
    assert "#SBATCH --exclusive" in cpu and "#SBATCH --gres-flags=enforce-binding" not in cpu
    # Given already through --sbatch: written once.
    twice = lines(nodes=2, gpus_per_node=4, sbatch_extra=["--exclusive"])
    assert twice.count("#SBATCH --exclusive") == 1
