"""Cost model: Young 1974 and Daly 2006 checkpoint intervals, run cost, TCO, spot economics."""

from __future__ import annotations

import math

import pytest

from hpcml.plan.common import PlanError
from hpcml.plan.cost import (
    TcoInputs,
    daly_interval,
    daly_wall_time,
    goodput,
    run_cost,
    spot_economics,
    tco,
    young_interval,
)
from hpcml.plan.hardware import load_catalog
from hpcml.plan.shapes import transformer

MIN = 60.0
HOUR = 3600.0
CAT = load_catalog()


@pytest.mark.parametrize(
    "mtbf_min,published_min",
    # Daly 2006, Figs. 3-5: delta = 5 min; M = 24 h, 6 h, 15 min -> tau_opt = 117, 57, 9.1 min.
    [(24 * 60, 117), (6 * 60, 57), (15, 9.1)],
)
def test_daly_published_intervals(mtbf_min: float, published_min: float) -> None:
    tau = daly_interval(5 * MIN, mtbf_min * MIN) / MIN
    # Daly prints 3 digits: half a unit of the last digit plus the rounding of his inputs.
    assert tau == pytest.approx(published_min, abs=0.6 if published_min > 10 else 0.06)


def test_young_first_order() -> None:
    # Young 1974: sqrt(2 C M); delta = 5 min, M = 24 h -> 120 min.
    assert young_interval(5 * MIN, 24 * HOUR) / MIN == pytest.approx(120.0)
    assert daly_interval(5 * MIN, 24 * HOUR) < young_interval(5 * MIN, 24 * HOUR)


@pytest.mark.parametrize("mtbf_min", [15, 60, 24 * 60])
def test_daly_estimate_is_near_the_minimum_of_his_wall_time(mtbf_min: float) -> None:
    d, m, r = 5 * MIN, mtbf_min * MIN, 10 * MIN
    tau = daly_interval(d, m)
    grid = [tau * (0.5 + i / 1000) for i in range(1001)]
    best = min(grid, key=lambda t: daly_wall_time(500 * HOUR, t, d, r, m))
    # Daly's closed form is his model's optimum to first order; the grid step is 0.1% of tau.
    assert tau == pytest.approx(best, rel=0.01)


def test_daly_when_checkpoints_cost_more_than_failures() -> None:
    assert daly_interval(3 * HOUR, 1 * HOUR) == 1 * HOUR
    with pytest.raises(PlanError):
        young_interval(0, HOUR)


def test_goodput_falls_with_interruptions() -> None:
    g = [goodput(daly_interval(60, m), 60, 300, m) for m in (100 * HOUR, 10 * HOUR, HOUR)]
    assert 1 > g[0] > g[1] > g[2] > 0


def test_narayanan_training_time_estimates() -> None:
    # Narayanan et al. 2021, Sec. 5.1: GPT-3 175B on 300B tokens with 1024 A100s at
    # 140 TFLOP/s takes about 34 days; 1T on 450B tokens with 3072 GPUs at 163 TFLOP/s about
    # 84 days (full recomputation: 8TP/(nX)).
    a100 = [CAT.accelerator("a100-80gb")]
    gpt3 = transformer("gpt3", 96, 12288, 96, 2048, 51200)
    days = run_cost(gpt3, a100, "bf16", 1024, tokens=300e9, mfu=140 / 312,
                    recompute="full")[0].wall_hours / 24
    # Published in whole days from the 8TP/(nX) approximation, which drops terms counted here.
    assert days == pytest.approx(34, rel=0.05)
    one_t = transformer("1t", 128, 25600, 160, 2048, 51200)
    days = run_cost(one_t, a100, "bf16", 3072, tokens=450e9, mfu=163 / 312,
                    recompute="full")[0].wall_hours / 24
    assert days == pytest.approx(84, rel=0.03)


def test_run_cost_prices_and_energy() -> None:
    m = transformer("t", 32, 4096, 32, 4096, 32000)
    rows = run_cost(m, [CAT.accelerator("h100-sxm"), CAT.accelerator("a100-80gb")], "bf16", 64,
                    tokens=1e12, mfu=0.4, price_usd_per_gpu_hour=2.0)
    h100, a100 = rows
    assert h100.gpu_hours < a100.gpu_hours
    assert h100.cost_usd == pytest.approx(h100.gpu_hours * 2.0)
    assert h100.wall_hours == pytest.approx(h100.gpu_hours / 64)
    assert h100.energy_kwh == pytest.approx(h100.gpu_hours * 0.7)
    with pytest.raises(PlanError):
        run_cost(m, [CAT.accelerator("h100-sxm")], "bf16", 8, mfu=0.4)


def test_tco_break_even() -> None:
    i = TcoInputs(devices=8, purchase_usd_per_device=30000, cloud_usd_per_device_hour=4.0,
                  device_watts=700, utilization=0.8, horizon_months=60)
    r = tco(i)
    be = r.break_even_month
    assert be is not None and 0 < be < 60
    k = math.floor(be)
    assert r.cloud_cumulative_usd[k] <= r.onprem_cumulative_usd[k]
    assert r.cloud_cumulative_usd[k + 1] >= r.onprem_cumulative_usd[k + 1]
    busier = tco(TcoInputs(**{**i.__dict__, "utilization": 0.95}))
    assert busier.break_even_month is not None and busier.break_even_month < be
    cheap_cloud = tco(TcoInputs(**{**i.__dict__, "cloud_usd_per_device_hour": 0.2}))
    assert cheap_cloud.break_even_month is None
    with pytest.raises(PlanError, match="pue"):
        tco(TcoInputs(**{**i.__dict__, "pue": 0.9}))


def test_spot_economics() -> None:
    calm = spot_economics(10.0, 0.6, 0.0, 8, 60, 600)
    assert calm.spot_goodput == 1.0 and calm.savings_fraction == pytest.approx(0.6)
    busy = spot_economics(10.0, 0.6, 0.2, 8, 60, 600)
    assert busy.spot_goodput < 1 and busy.savings_fraction < 0.6
    assert busy.daly_interval_s < busy.young_interval_s
    be = busy.break_even_preemptions_per_instance_hour
    assert be is not None
    at = spot_economics(10.0, 0.6, be, 8, 60, 600)
    assert at.savings_fraction == pytest.approx(0.0, abs=1e-3)
    worse = spot_economics(10.0, 0.6, be * 2, 8, 60, 600)
    assert worse.savings_fraction < 0
    with pytest.raises(PlanError, match="discount"):
        spot_economics(10.0, 1.2, 0.1, 8, 60, 600)
