"""A latency plot of load-test results: latency by percentile and over time, one line a run."""

from __future__ import annotations

from pathlib import Path

from hpcml.serve.loadtest import LoadtestResult


def plot_results(runs: list[tuple[str, LoadtestResult]], out: Path, title: str = "latency") -> Path:
    """Latency by percentile (HdrHistogram style) and latency over time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, r in runs:
        if not r.spectrum_ms:
            continue
        ps = [float(p) for p in r.spectrum_ms if float(p) < 100.0]
        xs = [1.0 / (1.0 - p / 100.0) for p in ps]
        ax1.plot(xs, [r.spectrum_ms[f"{p:g}"] for p in ps], marker="o", ms=3, label=label)
        if r.timeline:
            t = sorted(r.timeline)
            ax2.scatter([p[0] for p in t], [p[1] for p in t], s=2, alpha=0.4, label=label)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ticks = [1, 2, 10, 100, 1000, 10000]
    ax1.set_xticks(ticks)
    ax1.set_xticklabels(["0%", "50%", "90%", "99%", "99.9%", "99.99%"])
    ax1.set_xlabel("percentile")
    ax1.set_ylabel("latency (ms)")
    ax1.set_title(f"{title}: latency by percentile")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.set_yscale("log")
    ax2.set_xlabel("time since start (s)")
    ax2.set_ylabel("latency (ms)")
    ax2.set_title("latency over time (sampled)")
    ax2.grid(True, alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
