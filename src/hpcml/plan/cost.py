"""What training costs: a run's GPU-hours and money per hardware option, cloud versus owned
hardware over time, and spot instances with checkpoint intervals from Young (1974) and Daly
(2006)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hpcml.plan.common import HOUR_S, PlanError
from hpcml.plan.hardware import Accelerator
from hpcml.plan.shapes import ModelShape

HOURS_PER_MONTH = 730.0


# --- (a) the cost of one training run --------------------------------------------------------


@dataclass(frozen=True)
class RunCost:
    accelerator: str
    precision: str
    devices: int
    mfu: float
    total_flops: float
    gpu_hours: float
    wall_hours: float
    usd_per_gpu_hour: float | None
    price_provider: str
    price_as_of: str
    cost_usd: float | None
    energy_kwh: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def training_flops(
    model: ModelShape,
    tokens: float | None = None,
    samples: float | None = None,
    recompute: str = "none",
) -> tuple[float, float]:
    """(FLOPs, samples) of a run given its tokens (transformers) or samples.

    Model FLOPs: 6N + 12LHQT per token (PaLM, Appendix B), about Kaplan et al.'s C = 6ND.
    """
    if tokens is None and samples is None:
        raise PlanError("give the run's length with --tokens or --steps and --global-batch.")
    if samples is None:
        assert tokens is not None
        samples = tokens / model.tokens_per_sample
    if samples <= 0:
        raise PlanError("the run must process a positive number of tokens or samples.")
    return model.hardware_flops_per_sample(recompute) * samples, samples


def run_cost(
    model: ModelShape,
    accelerators: Sequence[Accelerator],
    precision: str,
    devices: int,
    tokens: float | None = None,
    samples: float | None = None,
    mfu: float | None = None,
    price_usd_per_gpu_hour: float | None = None,
    provider: str | None = None,
    recompute: str = "none",
) -> list[RunCost]:
    """GPU-hours and cost of a run on each accelerator, at an MFU (default: the catalog's
    efficiency for that accelerator; better: the MFU `plan step` or a measured run gives).
    With recomputation the FLOPs are hardware FLOPs and `mfu` is read as HFU."""
    if devices < 1:
        raise PlanError(f"--devices is {devices}; it must be at least 1.")
    flops, _ = training_flops(model, tokens, samples, recompute)
    out = []
    for acc in accelerators:
        eff = mfu if mfu is not None else acc.default_efficiency
        if not 0 < eff <= 1:
            raise PlanError(f"--mfu {eff} must lie in (0, 1].")
        peak = acc.peak(precision)
        gpu_hours = flops / (peak * eff) / HOUR_S
        offer = acc.price(provider)
        price = (
            price_usd_per_gpu_hour
            if price_usd_per_gpu_hour is not None
            else (offer.usd_per_gpu_hour if offer else None)
        )
        out.append(
            RunCost(
                accelerator=acc.key,
                precision=precision,
                devices=devices,
                mfu=eff,
                total_flops=flops,
                gpu_hours=gpu_hours,
                wall_hours=gpu_hours / devices,
                usd_per_gpu_hour=price,
                price_provider="--price"
                if price_usd_per_gpu_hour is not None
                else (offer.provider if offer else ""),
                price_as_of=""
                if price_usd_per_gpu_hour is not None
                else (offer.as_of if offer else ""),
                cost_usd=gpu_hours * price if price is not None else None,
                energy_kwh=gpu_hours * acc.tdp_watts / 1000.0,
            )
        )
    return out


# --- (b) cloud versus owned ------------------------------------------------------------------


@dataclass(frozen=True)
class TcoInputs:
    devices: int
    purchase_usd_per_device: float
    cloud_usd_per_device_hour: float
    device_watts: float
    host_watts_per_device: float = 0.0
    utilization: float = 0.7
    """Share of hours the owned devices do useful work; the cloud bills only those hours."""
    idle_power_fraction: float = 0.3
    """Draw of an idle device relative to its busy draw."""
    pue: float = 1.3
    usd_per_kwh: float = 0.10
    ops_fraction_per_year: float = 0.10
    """Operations (staff, support contracts, space) per year as a share of the purchase."""
    amortization_months: int = 48
    horizon_months: int = 60


@dataclass(frozen=True)
class TcoResult:
    inputs: TcoInputs
    onprem_monthly_opex_usd: float
    cloud_monthly_usd: float
    onprem_cumulative_usd: tuple[float, ...]
    cloud_cumulative_usd: tuple[float, ...]
    break_even_month: float | None
    onprem_usd_per_useful_device_hour: float
    cloud_usd_per_useful_device_hour: float
    power_usd_per_month: float
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["onprem_cumulative_usd"] = list(self.onprem_cumulative_usd)
        d["cloud_cumulative_usd"] = list(self.cloud_cumulative_usd)
        d["notes"] = list(self.notes)
        return d


def tco(i: TcoInputs) -> TcoResult:
    """Owned: purchase up front, then power x PUE and operations every month. Cloud: the same
    useful device-hours at the cloud price. Break-even: the month the cumulative cloud bill
    overtakes the owned total (linear within the month)."""
    for label, value, lo, hi in (
        ("--utilization", i.utilization, 0.0, 1.0),
        ("--idle-power", i.idle_power_fraction, 0.0, 1.0),
    ):
        if not lo < value <= hi:
            raise PlanError(f"{label} {value} must lie in ({lo}, {hi}].")
    if i.pue < 1.0:
        raise PlanError(f"--pue {i.pue} cannot be below 1 (it is facility power / IT power).")
    if i.devices < 1 or i.horizon_months < 1 or i.amortization_months < 1:
        raise PlanError("devices, horizon and amortization months must be at least 1.")
    busy_w = i.device_watts + i.host_watts_per_device
    avg_w = busy_w * (i.utilization + (1 - i.utilization) * i.idle_power_fraction)
    power = i.devices * avg_w / 1000.0 * HOURS_PER_MONTH * i.pue * i.usd_per_kwh
    capex = i.devices * i.purchase_usd_per_device
    ops = capex * i.ops_fraction_per_year / 12.0
    opex = power + ops
    useful_hours = i.devices * HOURS_PER_MONTH * i.utilization
    cloud = useful_hours * i.cloud_usd_per_device_hour
    onprem_cum = tuple(capex + k * opex for k in range(i.horizon_months + 1))
    cloud_cum = tuple(k * cloud for k in range(i.horizon_months + 1))
    break_even = capex / (cloud - opex) if cloud > opex else None
    if break_even is not None and break_even > i.horizon_months:
        notes: tuple[str, ...] = (f"break-even after the {i.horizon_months}-month horizon",)
    else:
        notes = ()
    months = i.amortization_months
    owned_rate = (capex + months * opex) / (useful_hours * months)
    return TcoResult(
        inputs=i,
        onprem_monthly_opex_usd=opex,
        cloud_monthly_usd=cloud,
        onprem_cumulative_usd=onprem_cum,
        cloud_cumulative_usd=cloud_cum,
        break_even_month=break_even,
        onprem_usd_per_useful_device_hour=owned_rate,
        cloud_usd_per_useful_device_hour=i.cloud_usd_per_device_hour,
        power_usd_per_month=power,
        notes=notes,
    )


# --- (c) spot instances and checkpoint intervals ---------------------------------------------


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young 1974, "A first order approximation to the optimum checkpoint interval"
    (CACM 17(9)): T_opt = sqrt(2 C M) for checkpoint time C and mean time between failures M."""
    if checkpoint_s <= 0 or mtbf_s <= 0:
        raise PlanError("checkpoint time and mean time between interruptions must be positive.")
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart
    dumps" (FGCS 22(3)), its higher-order estimate: for delta < 2M,
    tau = sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) + (1/9) (delta / 2M)] - delta; else M."""
    if checkpoint_s <= 0 or mtbf_s <= 0:
        raise PlanError("checkpoint time and mean time between interruptions must be positive.")
    d, m = checkpoint_s, mtbf_s
    if d >= 2.0 * m:
        return m
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def daly_wall_time(
    solve_s: float, interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float
) -> float:
    """Expected wall time to finish `solve_s` of work with Poisson interruptions of mean M
    (Daly 2006, the complete cost function with restart time R):
    T_w = M e^{R/M} (e^{(tau + delta)/M} - 1) T_s / tau."""
    m = mtbf_s
    return (
        m
        * math.exp(restart_s / m)
        * math.expm1((interval_s + checkpoint_s) / m)
        * solve_s
        / interval_s
    )


def goodput(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """Share of wall time that advances the job: T_s / T_w in Daly's model (1 with no failures)."""
    if math.isinf(mtbf_s):
        return interval_s / (interval_s + checkpoint_s)
    return 1.0 / daly_wall_time(1.0, interval_s, checkpoint_s, restart_s, mtbf_s)


@dataclass(frozen=True)
class CheckpointPlan:
    """Where to checkpoint and what failures then cost: the one implementation behind
    `plan cost spot` and `launch checkpoint-interval`."""

    checkpoint_s: float
    mtbf_s: float
    restart_s: float
    young_interval_s: float
    daly_interval_s: float
    goodput: float
    """Share of wall time that advances the job at Daly's interval (Daly 2006's full model)."""
    lost_work_per_failure_s: float
    """Expected work redone after a failure: half an interval (failures fall uniformly within
    one) plus the restart time."""

    @property
    def overhead_fraction(self) -> float:
        return 1.0 - self.goodput

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "overhead_fraction": self.overhead_fraction}


def checkpoint_plan(checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> CheckpointPlan:
    """Young's and Daly's intervals and the goodput at Daly's; no failures: goodput 1."""
    if checkpoint_s <= 0 or restart_s < 0:
        raise PlanError("give a positive checkpoint time and a restart time of at least 0.")
    if math.isinf(mtbf_s):
        return CheckpointPlan(checkpoint_s, mtbf_s, restart_s, math.inf, math.inf, 1.0, 0.0)
    tau = daly_interval(checkpoint_s, mtbf_s)
    return CheckpointPlan(
        checkpoint_s,
        mtbf_s,
        restart_s,
        young_interval(checkpoint_s, mtbf_s),
        tau,
        goodput(tau, checkpoint_s, restart_s, mtbf_s),
        tau / 2.0 + restart_s,
    )


@dataclass(frozen=True)
class SpotResult:
    on_demand_usd_per_hour: float
    spot_usd_per_hour: float
    interruptions_per_hour: float
    """For the whole job: any instance's preemption stops every rank."""
    mtbf_s: float
    checkpoint_s: float
    restart_s: float
    young_interval_s: float
    daly_interval_s: float
    spot_goodput: float
    on_demand_goodput: float
    spot_effective_usd_per_useful_hour: float
    on_demand_effective_usd_per_useful_hour: float
    savings_fraction: float
    break_even_preemptions_per_instance_hour: float | None
    wall_time_factor: float
    """Spot wall time / on-demand wall time for the same work."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def spot_economics(
    on_demand_usd_per_hour: float,
    spot_discount: float,
    preemptions_per_instance_hour: float,
    instances: int,
    checkpoint_s: float,
    restart_s: float,
    on_demand_failures_per_instance_hour: float = 0.0,
) -> SpotResult:
    """Effective price of useful work on spot versus on-demand instances, each checkpointing
    at Daly's optimum interval for its own interruption rate."""
    if not 0 <= spot_discount < 1:
        raise PlanError(f"--discount {spot_discount} must lie in [0, 1): the share saved.")
    if preemptions_per_instance_hour < 0 or on_demand_failures_per_instance_hour < 0:
        raise PlanError("interruption rates cannot be negative.")
    if checkpoint_s <= 0 or restart_s < 0 or instances < 1:
        raise PlanError("give a positive checkpoint time, a restart time >= 0 and >= 1 instance.")
    spot_price = on_demand_usd_per_hour * (1.0 - spot_discount)

    def mtbf(rate_per_instance_hour: float) -> float:
        rate = rate_per_instance_hour * instances
        return math.inf if rate == 0 else HOUR_S / rate

    def best_goodput(rate: float) -> tuple[float, float, float]:
        p = checkpoint_plan(checkpoint_s, mtbf(rate), restart_s)
        return p.mtbf_s, p.daly_interval_s, p.goodput

    m_spot, tau_spot, g_spot = best_goodput(preemptions_per_instance_hour)
    _, _, g_od = best_goodput(on_demand_failures_per_instance_hour)
    spot_eff = spot_price / g_spot
    od_eff = on_demand_usd_per_hour / g_od

    # The preemption rate at which spot stops paying: effective prices equal.
    break_even: float | None = None
    target = spot_price / od_eff  # goodput spot must keep
    if target < 1.0:
        lo, hi = 0.0, 1.0
        while best_goodput(hi)[2] > target and hi < 1e6:
            hi *= 2.0
        if hi < 1e6:
            for _ in range(100):
                mid = (lo + hi) / 2.0
                if best_goodput(mid)[2] > target:
                    lo = mid
                else:
                    hi = mid
            break_even = (lo + hi) / 2.0
    return SpotResult(
        on_demand_usd_per_hour=on_demand_usd_per_hour,
        spot_usd_per_hour=spot_price,
        interruptions_per_hour=preemptions_per_instance_hour * instances,
        mtbf_s=m_spot,
        checkpoint_s=checkpoint_s,
        restart_s=restart_s,
        young_interval_s=young_interval(checkpoint_s, m_spot)
        if math.isfinite(m_spot)
        else math.inf,
        daly_interval_s=tau_spot,
        spot_goodput=g_spot,
        on_demand_goodput=g_od,
        spot_effective_usd_per_useful_hour=spot_eff,
        on_demand_effective_usd_per_useful_hour=od_eff,
        savings_fraction=1.0 - spot_eff / od_eff,
        break_even_preemptions_per_instance_hour=break_even,
        wall_time_factor=g_od / g_spot,
    )
