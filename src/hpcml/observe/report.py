"""`hpcml report`: one self-contained HTML page (PNG figures embedded, and written beside it)
for one or several run folders: loss and evaluation curves, throughput, data-wait share,
memory measured against the planner's prediction, fault events, and for several runs a
side-by-side table with speedup and scaling efficiency against the first run (the baseline).

Hand-written HTML (a template engine would be one more dependency for one page); every value
from a run folder is escaped, since a run's name and config come from its user.
"""

from __future__ import annotations

import base64
import html
import io
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcml.errors import ConfigError
from hpcml.records import read_run_log


@dataclass
class Run:
    name: str
    path: Path
    summary: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)

    @property
    def world(self) -> int:
        return int(self.summary.get("world_size") or 1)

    @property
    def samples_per_s(self) -> float | None:
        """The summary's, else (a preempted or failed run has none) the median of the step
        records' past warm-up, as the summary computes it."""
        value = (self.summary.get("throughput") or {}).get("samples_per_s")
        if value:
            return float(value)
        rates = [float(r["samples_per_s"]) for r in self.steps[3:] or self.steps
                 if isinstance(r.get("samples_per_s"), int | float) and r["samples_per_s"] > 0]
        return statistics.median(rates) if rates else None

    def data_wait_share(self) -> float | None:
        shares = [
            r["data_wait_s"] / r["step_time_s"]
            for r in self.steps[3:] or self.steps  # past warm-up, like the summary's median
            if r.get("step_time_s")
        ]
        return statistics.median(shares) if shares else None


def load_run(path: Path) -> Run:
    summary_path, log_path = path / "summary.json", path / "run.jsonl"
    if not path.is_dir():
        raise ConfigError(f"run folder {str(path)!r} does not exist; pass a folder hpcml train wrote.")
    if not summary_path.exists() and not log_path.exists():
        raise ConfigError(
            f"{str(path)!r} holds no summary.json or run.jsonl; pass a folder hpcml train wrote."
        )
    summary: dict[str, Any] = {}
    if summary_path.exists():
        try:
            summary = json.loads(summary_path.read_text())
        except (ValueError, UnicodeDecodeError):
            raise ConfigError(
                f"{str(summary_path)!r} is not valid JSON; it was damaged or is not hpcml's."
            ) from None
        if not isinstance(summary, dict):
            raise ConfigError(f"{str(summary_path)!r} is not a run summary (not a JSON object).")
    records = read_run_log(log_path)
    run = Run(path.resolve().name, path.resolve(), summary)
    for rec in records:
        kind = rec.get("kind", "step")
        if kind == "step" and isinstance(rec.get("step"), int) and "loss" in rec:
            run.steps.append(rec)
        elif kind == "eval":
            run.evals.append(rec)
        elif kind == "fault":
            run.faults.append(rec)
    # A step replayed after a rollback or a resume: its last record counts.
    run.steps = list({r["step"]: r for r in run.steps}.values())
    run.steps.sort(key=lambda r: r["step"])
    return run


EFFICIENCY_NOTE = (
    "scaling efficiency above 1: more than linear, usually a slowed baseline (a contended, "
    "preempted or cold run); check it before trusting the speedup"
)


def unique_names(runs: list[Run]) -> None:
    """Runs whose folders share a name (exp1/run, exp2/run) are named by as many parent
    folders as tell them apart."""
    depth = 1
    while True:
        names = ["/".join(run.path.parts[-depth:]) for run in runs]
        if len(set(names)) == len(names) or depth >= max(len(r.path.parts) for r in runs):
            break
        depth += 1
    for run, name in zip(runs, names, strict=True):
        run.name = name


def comparison(runs: list[Run]) -> list[dict[str, Any]]:
    """One row per run; speedup and scaling efficiency against the first run, and notes on
    numbers that need a second look."""
    base = runs[0]
    rows = []
    for run in runs:
        s = run.summary
        sps = run.samples_per_s
        speedup = sps / base.samples_per_s if sps and base.samples_per_s else None
        efficiency = speedup / (run.world / base.world) if speedup is not None else None
        final = s.get("final") or {}
        cfg = s.get("config") or {}
        fault = s.get("fault") or {}
        rows.append(
            {
                "run": run.name,
                "status": s.get("status", "no summary"),
                "processes": run.world,
                "strategy": (cfg.get("parallel") or {}).get("strategy"),
                "precision": s.get("precision"),
                "steps": s.get("steps", run.steps[-1]["step"] if run.steps else 0),
                "train_loss": final.get("train_loss"),
                "val_accuracy": final.get("val_accuracy"),
                "samples_per_s": sps,
                "speedup": speedup,
                "scaling_efficiency": efficiency,
                "mfu": (s.get("throughput") or {}).get("mfu"),
                "data_wait_share": run.data_wait_share(),
                "peak_rss_mib": _mib((s.get("memory") or {}).get("peak_rss_bytes")),
                "fault_events": len(run.faults),
                "skipped_steps": fault.get("skipped_steps"),
                "notes": EFFICIENCY_NOTE if efficiency is not None and efficiency > 1 else None,
            }
        )
    return rows


def _mib(value: Any) -> float | None:
    return value / 2**20 if isinstance(value, int | float) else None


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def figures(runs: list[Run]) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes] = {}
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 3.6))
    for run in runs:
        loss_ax.plot([r["step"] for r in run.steps], [r["loss"] for r in run.steps], label=run.name)
        if run.evals:
            acc_ax.plot(
                [r["step"] for r in run.evals],
                [r.get("val_accuracy") for r in run.evals],
                marker="o",
                label=run.name,
            )
        for f in run.faults:
            loss_ax.axvline(f.get("step", 0), color="red", alpha=0.3, lw=1)
    loss_ax.set(xlabel="step", ylabel="training loss", title="Loss (red lines: fault events)")
    acc_ax.set(xlabel="step", ylabel="validation accuracy", title="Evaluation")
    loss_ax.legend(fontsize=8)
    if any(run.evals for run in runs):
        acc_ax.legend(fontsize=8)
    out["curves.png"] = _png(fig)
    plt.close(fig)

    fig, (sps_ax, wait_ax) = plt.subplots(1, 2, figsize=(11, 3.6))
    for run in runs:
        pts = [(r["step"], r["samples_per_s"]) for r in run.steps if r.get("samples_per_s")]
        sps_ax.plot([p[0] for p in pts], [p[1] for p in pts], label=run.name)
    sps_ax.set(xlabel="step", ylabel="samples/s", title="Throughput per step")
    sps_ax.legend(fontsize=8)
    shares = [(run.name, run.data_wait_share() or 0.0) for run in runs]
    wait_ax.bar([n for n, _ in shares], [100 * v for _, v in shares], color="tab:orange")
    wait_ax.set(ylabel="% of step time", title="Waiting for data (median step)")
    wait_ax.tick_params(axis="x", labelrotation=20)
    out["throughput.png"] = _png(fig)
    plt.close(fig)

    rows = [(run.name, r) for run in runs for r in _memory_rows(run)]
    if rows:
        fig, ax = plt.subplots(figsize=(11, 0.5 + 0.35 * len(rows)))
        labels = [f"{name}: {r['quantity']}" for name, r in rows]
        ax.barh(labels, [r["measured"] / 2**20 for _, r in rows], height=0.4, label="measured")
        ax.scatter([r["predicted"] / 2**20 for _, r in rows], labels, color="black", zorder=3,
                   label="predicted (hpcml plan)")
        ax.set(xlabel="MiB per process", title="Memory: measured vs predicted")
        ax.invert_yaxis()
        ax.legend(fontsize=8)
        out["memory.png"] = _png(fig)
        plt.close(fig)
    return out


def _memory_rows(run: Run) -> list[dict[str, Any]]:
    rows = (run.summary.get("prediction") or {}).get("rows") or []
    return [
        r
        for r in rows
        if str(r.get("quantity", "")).endswith("_bytes")
        and isinstance(r.get("measured"), int | float)
        and isinstance(r.get("predicted"), int | float)
    ]


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def render(runs: list[Run], images: dict[str, bytes]) -> str:
    rows = comparison(runs)
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row.values()) + "</tr>" for row in rows
    )
    imgs = "".join(
        f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}"></figure>'
        for name, png in images.items()
    )
    faults = "".join(
        f"<tr><td>{_cell(run.name)}</td><td>{_cell(f.get('step'))}</td><td>{_cell(f.get('event'))}"
        f"</td><td>{_cell(json.dumps({k: v for k, v in f.items() if k not in ('kind', 'time')}))}"
        "</td></tr>"
        for run in runs
        for f in run.faults
    )
    title = "hpcml report: " + ", ".join(run.name for run in runs)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
.wide {{ overflow-x: auto; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child {{ text-align: left; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>Baseline for speedup and scaling efficiency: <b>{html.escape(runs[0].name)}</b>
(efficiency = speedup / (processes / baseline processes)).</p>
<h2>Runs</h2>
<div class="wide"><table id="runs"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>
<h2>Figures</h2>{imgs}
<h2>Fault events</h2>
<div class="wide"><table id="faults">
<thead><tr><th>run</th><th>step</th><th>event</th><th>record</th></tr></thead>
<tbody>{faults or '<tr><td colspan="4">none</td></tr>'}</tbody></table></div>
</body></html>
"""


def write_report(run_dirs: list[Path], out: Path) -> dict[str, Any]:
    """Write `out` (HTML) and its figures as PNGs in `<out stem>_figures/`."""
    if not run_dirs:
        raise ConfigError("hpcml report needs at least one run folder.")
    runs = [load_run(p) for p in run_dirs]
    unique_names(runs)
    images = figures(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = out.with_name(f"{out.stem}_figures")
    folder.mkdir(exist_ok=True)
    for name, png in images.items():
        (folder / name).write_bytes(png)
    out.write_text(render(runs, images), encoding="utf-8")
    return {"report": str(out), "figures": [str(folder / n) for n in images], "runs": comparison(runs)}
