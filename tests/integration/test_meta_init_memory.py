"""Set-up memory per rank (issue 10, item 1): a gpt whose ~25 M fp32 parameters (~100 MB) dominate
set-up, trained for one step by `hpcml train --nproc 2` (torchrun's agent, workers forked from it), ddp
and zero3 (measured 91 / 236 MB this way).

What each rank's set-up adds to its RSS (`memory.per_rank[r].setup_rss_growth_bytes`, the peak
of set-up over the RSS at its start, so the few hundred MB of torch and hpcml imports that both
strategies pay alike are not in it):
- ddp holds the whole model (P) and DDP's gradient buckets (another P), so >= 2P;
- zero3 holds its half of the parameters (P/2) and, while initialising, one full parameter at a
  time (the largest is 1 M floats, 4 MB, P/25), so about 0.54P.
Both also pay the same fixed costs F (data description, process-group buffers: ~35 MB here),
which pull the ratio towards 1: (F + 0.54P) / (F + 2P) = 0.41 with P = 100 MB (measured 97 / 235
MB). The issue asks for <= 0.6; we assert <= 0.5, because building the whole model on every rank
first (the old set-up, F + P) measured 146 / 235 = 0.62 at this size, barely over 0.6, and 0.5
still leaves room for F up to ~90 MB.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import hpcml_proc, summary

from hpcml.data.sources.tokens import prepare_pystdlib

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = """
model: {{name: gpt-tiny, args: {{n_layer: 8, d_model: 512, n_head: 8}}}}
data: {{source: tokens, path: {corpus}, seq_len: 32, batch_size: 2, eval_windows: 4}}
train: {{max_steps: 1, eval_every: 0, log_every: 1}}
"""


def train(config: Path, run_dir: Path, strategy: str) -> list[dict[str, int]]:
    cmd = ["train", str(config), f"parallel.strategy={strategy}", "--nproc", "2"]
    # No traced step: its prediction is not what this test reads, and it is set-up CPU.
    cmd += ["train.plan_trace=never", "--run-dir", str(run_dir), "--quiet"]
    out = hpcml_proc(cmd, timeout=500)
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    per_rank: list[dict[str, int]] = summary(run_dir)["memory"]["per_rank"]
    return per_rank


def test_zero3_setup_memory_per_rank_is_a_fraction_of_ddp(tmp_path: Path) -> None:
    prepare_pystdlib(tmp_path / "corpus", val_fraction=0.2, max_bytes=100_000)
    config = tmp_path / "gpt.yaml"
    config.write_text(CONFIG.format(corpus=tmp_path / "corpus"))
    ddp = train(config, tmp_path / "ddp", "ddp")
    zero3 = train(config, tmp_path / "zero3", "zero3")
    params_bytes = 4 * 25_000_000  # ~P, to check the growths are about the model at all
    for rank in ddp + zero3:
        assert rank["setup_peak_rss_bytes"] >= rank["setup_start_rss_bytes"]
    ddp_growth = min(r["setup_rss_growth_bytes"] for r in ddp)
    zero3_growth = max(r["setup_rss_growth_bytes"] for r in zero3)
    assert ddp_growth >= 1.5 * params_bytes  # the replicated model and its gradient buckets
    assert zero3_growth <= 0.5 * ddp_growth, (zero3, ddp)
