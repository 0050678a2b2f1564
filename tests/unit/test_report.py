"""`hpcml report` on run folders written here in hpcml's own formats (the integration test in
test_train_run.py reports on real runs and renders the page in a headless Chromium)."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
from matplotlib.image import imread
from tests.conftest import run_hpcml

from hpcml.observe.report import comparison, load_run


class Tables(HTMLParser):
    """The text of every table cell, by table id, and the image sources."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.images: list[str] = []
        self.scripts = 0
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id") or "?"
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.images.append(a.get("src") or "")
        elif tag == "script":
            self.scripts += 1

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None


def fake_run(path: Path, world: int, sps: float, faults: int = 0) -> Path:
    path.mkdir(parents=True)
    steps = [
        {"kind": "step", "step": s, "loss": 2.3 - 0.1 * s, "step_time_s": 0.1, "data_wait_s": 0.02,
         "samples_per_s": sps}
        for s in range(1, 9)
    ]
    steps.append({**steps[4], "loss": 9.0})  # step 5 replayed after a rollback: this one counts
    evals = [{"kind": "eval", "step": 8, "val_loss": 1.1, "val_accuracy": 0.7}]
    events = [{"kind": "fault", "step": 5, "event": "rollback", "to_step": 4}] * faults
    with open(path / "run.jsonl", "w") as f:
        for rec in [*steps, *evals, *events]:
            f.write(json.dumps(rec) + "\n")
    summary = {
        "status": "finished", "steps": 8, "world_size": world, "precision": "fp32",
        "throughput": {"samples_per_s": sps, "mfu": None},
        "final": {"train_loss": 1.5, "val_accuracy": 0.7},
        "memory": {"peak_rss_bytes": 300 * 2**20},
        "config": {"parallel": {"strategy": "ddp"}},
        "fault": {"skipped_steps": 0},
        "prediction": {"rows": [
            {"quantity": "params_bytes", "predicted": 4e5, "measured": 4e5},
            {"quantity": "step_time_s", "predicted": 0.1, "measured": 0.2},
        ]},
    }
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_report_compares_runs_escapes_names_and_embeds_figures(tmp_path: Path) -> None:
    base = fake_run(tmp_path / "one", world=1, sps=100.0)
    hostile = fake_run(tmp_path / "<img src=x onerror=alert(1)>", world=4, sps=340.0, faults=1)
    out = tmp_path / "out" / "r.html"
    proc = run_hpcml("report", str(base), str(hostile), "--out", str(out), "--json")
    rows = json.loads(proc.stdout)["runs"]
    # 340 / 100 on 4 processes against 1: speedup 3.4, efficiency 3.4 / 4 = 0.85.
    assert [round(r["speedup"], 6) for r in rows] == [1.0, 3.4]
    assert [round(r["scaling_efficiency"], 6) for r in rows] == [1.0, 0.85]
    assert rows[1]["fault_events"] == 1
    assert abs(rows[0]["data_wait_share"] - 0.2) < 1e-12  # 0.02 / 0.1 in binary floating point

    page = out.read_text()
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    parsed = Tables()
    parsed.feed(page)
    assert parsed.scripts == 0
    runs = parsed.tables["runs"]
    header = runs[0]
    assert runs[2][header.index("speedup")] == "3.4"
    assert runs[2][header.index("scaling_efficiency")] == "0.85"
    assert runs[1][header.index("peak_rss_mib")] == "300"
    assert [r[2] for r in parsed.tables["faults"][1:]] == ["rollback"]
    # Three figures, embedded and beside the page, each a PNG with something drawn on it.
    assert len(parsed.images) == 3 and all(s.startswith("data:image/png;base64,") for s in parsed.images)
    for png in sorted((out.parent / "r_figures").iterdir()):
        pixels = imread(png)
        assert pixels.shape[0] > 100 and float(np.std(pixels)) > 0.05, png.name


def test_a_replayed_step_counts_once_with_its_last_record(tmp_path: Path) -> None:
    run = load_run(fake_run(tmp_path / "r", world=1, sps=10.0))
    assert [r["step"] for r in run.steps] == list(range(1, 9))
    assert run.steps[4]["loss"] == 9.0
    assert comparison([run])[0]["steps"] == 8


def test_bad_run_folders_are_one_sentence_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "summary.json").write_text("{not json")
    for folder, words in [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "holds no summary.json or run.jsonl"),
        (broken, "is not valid JSON"),
    ]:
        proc = run_hpcml("report", str(folder), "--out", str(tmp_path / "x.html"), check=False)
        assert proc.returncode == 2, proc.stderr
        assert words in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "x.html").exists()


def test_scaling_efficiency_is_relative_to_the_baseline_processes(tmp_path: Path) -> None:
    # Baseline on 2 processes, the other on 8: 4x the processes, 3.4x the throughput -> 0.85
    # (an efficiency divided by the 8 processes alone would say 0.425).
    rows = comparison([load_run(fake_run(tmp_path / "two", world=2, sps=100.0)),
                       load_run(fake_run(tmp_path / "eight", world=8, sps=340.0))])
    assert round(rows[1]["speedup"], 6) == 3.4
    assert round(rows[1]["scaling_efficiency"], 6) == 0.85


def test_a_preempted_baseline_compares_by_its_step_records(tmp_path: Path) -> None:
    """A preempted run's summary has samples_per_s None: every speedup was None although
    run.jsonl holds the throughput of each step."""
    base = fake_run(tmp_path / "base", world=1, sps=100.0)
    summary = json.loads((base / "summary.json").read_text())
    summary["status"], summary["throughput"] = "preempted", {"samples_per_s": None}
    (base / "summary.json").write_text(json.dumps(summary))
    rows = comparison([load_run(base), load_run(fake_run(tmp_path / "four", world=4, sps=340.0))])
    assert rows[0]["samples_per_s"] == 100.0  # the median of its step records
    assert round(rows[1]["speedup"], 6) == 3.4 and round(rows[1]["scaling_efficiency"], 6) == 0.85


def test_efficiency_above_one_is_flagged_and_same_named_runs_are_told_apart(
    tmp_path: Path,
) -> None:
    # 531% efficiency (a slowed baseline): printed with a note, on the page and the terminal.
    base = fake_run(tmp_path / "exp1" / "run", world=1, sps=10.0)
    fast = fake_run(tmp_path / "exp2" / "run", world=2, sps=106.2)
    out = tmp_path / "r.html"
    proc = run_hpcml("report", str(base), str(fast), "--out", str(out))
    assert "note: exp2/run: scaling efficiency above 1" in " ".join(proc.stdout.split())
    parsed = Tables()
    parsed.feed(out.read_text())
    table = parsed.tables["runs"]
    header = table[0]
    assert [r[header.index("run")] for r in table[1:]] == ["exp1/run", "exp2/run"]
    assert table[2][header.index("scaling_efficiency")] == "5.31"
    assert table[2][header.index("notes")].startswith("scaling efficiency above 1")
    assert table[1][header.index("notes")] == "–"
