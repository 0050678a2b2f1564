"""`launch slurm` and the time a preempted run needs (issue 29): after SLURM's USR1 the ranks
agree on the stop within `fault.stop_check_s`, then save; a `--signal-lead` shorter than both
is refused in one sentence, and `--mtbf` plans Daly's interval from the durable save time and
the measured restart (load) time of the run folder, printing both."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from hpcml.cli.app import app

MEASURED = {"total_s_median": 40.0, "stall_s_median": 2.0, "load_s": 12.5, "count": 3}
"""What summary.json's fault.checkpoints holds after a run that saved and resumed (the fields
are written by a real run in tests/integration/test_checkpoint_interval_measured.py)."""


def test_signal_lead_covers_the_stop_check_and_the_save_and_mtbf_uses_the_restart(
    tmp_path: Path,
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model: {name: mlp}\ntrain: {checkpoint_every: 0}\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"fault": {"checkpoints": MEASURED}}))
    base = ["launch", "slurm", str(config), "--run-dir", str(run), "--nodes", "1",
            "--time", "01:00:00", "--cpus-per-task", "2", "--mem", "1G", "--mtbf", "24h"]  # fmt: skip
    cli = CliRunner()
    short = cli.invoke(app, [*base, "--signal-lead", "44"])
    assert short.exit_code == 2, short.output
    # 5 s (fault.stop_check_s' default) + 40 s (the durable save measured) = 45 s > 44 s.
    line = " ".join(short.output.split())
    assert line.startswith("error: --signal-lead 44 s") and "(45 s:" in line, line
    assert "Traceback" not in short.output and not (run / "job.sbatch").exists()

    ok = cli.invoke(app, [*base, "--signal-lead", "45", "--json"])
    assert ok.exit_code == 0, ok.output
    planned = json.loads(ok.output)
    assert planned["checkpoint_s"] == 40.0 and planned["restart_s"] == 12.5
    shown = cli.invoke(app, [*base, "--signal-lead", "45", "fault.stop_check_s=2"])
    assert "restart 12.5 s load measured in" in " ".join(shown.output.split()), shown.output
