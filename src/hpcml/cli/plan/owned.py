"""`hpcml plan cost tco|spot`: owning versus renting, and spot versus on-demand."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from hpcml.cli.common import console, print_json
from hpcml.cli.plan.options import (
    CATALOG_OPT,
    JSON_OPT,
    _catalog,
    _finish_plot,
    cost_app,
)
from hpcml.plan.common import PlanError, human_seconds

# --- cost ------------------------------------------------------------------------------------


@cost_app.command("tco")
def cost_tco_cmd(
    gpu: str = typer.Option("h100-sxm", "--gpu", help="Accelerator to own or rent."),
    devices: int = typer.Option(64, "--devices", "-n", help="Devices."),
    purchase: float | None = typer.Option(None, "--purchase", help="USD per device incl. server."),
    cloud_price: float | None = typer.Option(None, "--cloud-price", help="USD per device-hour."),
    provider: str | None = typer.Option(
        None, "--provider", help="Catalog price from this provider."
    ),
    utilization: float = typer.Option(0.7, "--utilization", help="Busy share of owned hours."),
    pue: float = typer.Option(1.3, "--pue", help="Power usage effectiveness of the facility."),
    kwh: float = typer.Option(0.10, "--kwh-price", help="USD per kWh."),
    ops: float = typer.Option(0.10, "--ops", help="Operations per year, share of purchase."),
    idle_power: float = typer.Option(0.3, "--idle-power", help="Idle draw / busy draw."),
    amortization: int = typer.Option(48, "--amortization-months", help="Depreciation period."),
    horizon: int = typer.Option(60, "--horizon-months", help="Months to compare."),
    plot: Path | None = typer.Option(None, "--plot", help="Write cumulative costs as PNG."),
    catalog: list[Path] = CATALOG_OPT,
    json_out: bool = JSON_OPT,
) -> None:
    """Cloud vs owned: purchase, amortization, power x PUE, operations, utilization."""
    from hpcml.plan.cost import TcoInputs, tco

    cat = _catalog(catalog)
    acc = cat.accelerator(gpu)
    offer = acc.price(provider)
    cp = cloud_price if cloud_price is not None else (offer.usd_per_gpu_hour if offer else None)
    pp = purchase if purchase is not None else acc.purchase_usd_per_gpu
    if cp is None or pp is None:
        raise PlanError(
            f"the catalog has no cloud or purchase price for {acc.key}; pass "
            "--cloud-price and --purchase."
        )
    host_w = 0.0
    if acc.default_node and acc.default_node in cat.nodes:
        node = cat.nodes[acc.default_node]
        host_w = node.host_watts / node.devices_per_node
    inputs = TcoInputs(
        devices=devices,
        purchase_usd_per_device=pp,
        cloud_usd_per_device_hour=cp,
        device_watts=acc.tdp_watts,
        host_watts_per_device=host_w,
        utilization=utilization,
        idle_power_fraction=idle_power,
        pue=pue,
        usd_per_kwh=kwh,
        ops_fraction_per_year=ops,
        amortization_months=amortization,
        horizon_months=horizon,
    )
    res = tco(inputs)
    if plot:
        _plot_tco(res, plot, f"{devices} x {acc.key}: owned vs cloud")
    if json_out:
        d = res.to_dict()
        d["accelerator"] = acc.key
        d["cloud_price_source"] = (
            f"{offer.provider} ({offer.as_of})"
            if offer and cloud_price is None
            else "--cloud-price"
        )
        d["plot"] = str(plot) if plot else None
        print_json(d)
        return
    t = Table(title=f"{devices} x {acc.key}: owned vs cloud at {utilization:.0%} utilization")
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_row("purchase", f"${devices * pp:,.0f}")
    t.add_row("owned: power per month (x PUE)", f"${res.power_usd_per_month:,.0f}")
    t.add_row("owned: power + operations per month", f"${res.onprem_monthly_opex_usd:,.0f}")
    t.add_row("cloud: per month for the same useful hours", f"${res.cloud_monthly_usd:,.0f}")
    t.add_row(
        f"owned: $ per useful device-hour ({amortization} months)",
        f"{res.onprem_usd_per_useful_device_hour:.2f}",
    )
    t.add_row("cloud: $ per useful device-hour", f"{res.cloud_usd_per_useful_device_hour:.2f}")
    t.add_row(
        "break-even month",
        f"{res.break_even_month:.1f}" if res.break_even_month else "never (cloud cheaper)",
    )
    t.add_row(f"owned total at {horizon} months", f"${res.onprem_cumulative_usd[-1]:,.0f}")
    t.add_row(f"cloud total at {horizon} months", f"${res.cloud_cumulative_usd[-1]:,.0f}")
    console.print(t)
    for note in res.notes:
        console.print(f"note: {note}")
    if plot:
        console.print(f"plot written to {plot}")


def _plot_tco(res: Any, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    months = list(range(len(res.onprem_cumulative_usd)))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(months, [x / 1e6 for x in res.onprem_cumulative_usd], label="owned")
    ax.plot(months, [x / 1e6 for x in res.cloud_cumulative_usd], label="cloud")
    if res.break_even_month and res.break_even_month <= months[-1]:
        ax.axvline(
            res.break_even_month,
            color="grey",
            linestyle="--",
            label=f"break-even {res.break_even_month:.1f} mo",
        )
    ax.set_xlabel("month")
    ax.set_ylabel("cumulative cost (M USD)")
    _finish_plot(fig, ax, title, path)


@cost_app.command("spot")
def cost_spot_cmd(
    gpu: str = typer.Option("h100-sxm", "--gpu", help="Accelerator (for its on-demand price)."),
    on_demand: float | None = typer.Option(None, "--on-demand-price", help="USD per device-hour."),
    provider: str | None = typer.Option(
        None, "--provider", help="Catalog price from this provider."
    ),
    discount: float = typer.Option(0.6, "--discount", help="Spot discount, e.g. 0.6 = 60% off."),
    preemptions: float = typer.Option(
        0.05, "--preemptions-per-hour", help="Preemptions per instance-hour."
    ),
    instances: int = typer.Option(8, "--instances", help="Instances (nodes) the job needs."),
    checkpoint_s: float = typer.Option(60.0, "--checkpoint-s", help="Seconds to write one."),
    restart_s: float = typer.Option(600.0, "--restart-s", help="Seconds to get back to work."),
    od_failures: float = typer.Option(
        0.0, "--on-demand-failures-per-hour", help="Failures per on-demand instance-hour."
    ),
    catalog: list[Path] = CATALOG_OPT,
    json_out: bool = JSON_OPT,
) -> None:
    """Spot economics: Young/Daly checkpoint interval, expected goodput, effective price."""
    from hpcml.plan.cost import spot_economics

    price = on_demand
    source = "--on-demand-price"
    if price is None:
        acc = _catalog(catalog).accelerator(gpu)
        offer = acc.price(provider)
        if offer is None:
            raise PlanError(
                f"the catalog has no on-demand price for {acc.key}; pass --on-demand-price."
            )
        price, source = offer.usd_per_gpu_hour, f"{offer.provider} ({offer.as_of})"
    res = spot_economics(
        price, discount, preemptions, instances, checkpoint_s, restart_s, od_failures
    )
    if json_out:
        d = res.to_dict()
        d["price_source"] = source
        print_json(
            {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}
        )
        return
    t = Table(
        title=f"spot vs on-demand for a job on {instances} instances "
        f"(on-demand ${price:.2f}/device-h, {source})"
    )
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_row("spot price, $/device-h", f"{res.spot_usd_per_hour:.2f}")
    t.add_row("job interruptions per hour", f"{res.interruptions_per_hour:.3f}")
    t.add_row("mean time between interruptions", human_seconds(res.mtbf_s))
    t.add_row("checkpoint interval, Young 1974", human_seconds(res.young_interval_s))
    t.add_row("checkpoint interval, Daly 2006", human_seconds(res.daly_interval_s))
    t.add_row("expected goodput on spot", f"{res.spot_goodput:.1%}")
    t.add_row("expected goodput on-demand", f"{res.on_demand_goodput:.1%}")
    t.add_row("spot $ per useful device-hour", f"{res.spot_effective_usd_per_useful_hour:.2f}")
    t.add_row(
        "on-demand $ per useful device-hour", f"{res.on_demand_effective_usd_per_useful_hour:.2f}"
    )
    t.add_row("saving with spot", f"{res.savings_fraction:.1%}")
    t.add_row("wall time on spot / on-demand", f"{res.wall_time_factor:.2f}x")
    be = res.break_even_preemptions_per_instance_hour
    t.add_row("spot stops paying above (preemptions/instance-h)", f"{be:.3f}" if be else "-")
    console.print(t)


# --- check -----------------------------------------------------------------------------------
