"""`hpcml observe up`: Prometheus + Grafana files for runs and servers, and how to start them."""

from __future__ import annotations

from pathlib import Path

import typer

from hpcml.cli.common import console, print_json

app = typer.Typer(help="Observability: Prometheus and Grafana for runs and servers.", no_args_is_help=True)


@app.command("up")
def up(
    targets: list[Path] = typer.Option(
        [],
        "--targets",
        help="A folder of target files (observe.targets_dir, RUN_DIR/prometheus, or the one "
        "hpcml serve --prometheus-targets writes to); repeatable.",
    ),
    out: Path = typer.Option(Path("observe-stack"), "--out", help="Folder for the files."),
    scrape_s: int = typer.Option(5, "--scrape-s", min=1, help="Scrape interval in seconds."),
    port: int = typer.Option(9090, "--port", min=1, max=65535, help="Prometheus port."),
    docs_url: str | None = typer.Option(
        None,
        "--docs-url",
        help="Root of a published copy of the docs site: the alerts' runbook_url links point "
        "into its runbooks page (default: the page's path in the hpcml sources).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
) -> None:
    """Write prometheus.yml (file_sd over the targets, the alerting rules), alertmanager.yml,
    Grafana provisioning with the dashboards, and a docker-compose.yml; print the commands
    that start them. Prunes target files of processes on this host killed with SIGKILL."""
    from hpcml.observe.stack import write_stack

    result = write_stack(out, targets, scrape_s, port, docs_url)
    if json_out:
        print_json(result)
        return
    console.print(f"wrote {result['folder']}: watching {', '.join(result['watches'])}")
    for command in result["commands"]:
        console.print(f"  {command}", highlight=False)


@app.command("health")
def health(json_out: bool = typer.Option(False, "--json", help="Print readings as JSON.")) -> None:
    """NVML health of every GPU on this machine: uncorrected ECC errors, pending memory
    repairs, slowdown at rest, narrowed PCIe links, other processes; exit 1 on a problem."""
    import dataclasses

    from hpcml.observe.gpu_health import problems, read_gpus

    readings = read_gpus()
    found = [(r, problems(r)) for r in readings or []]
    if json_out:
        print_json(
            {
                "gpus": [{**dataclasses.asdict(r), "problems": p} for r, p in found],
                "note": None if readings else "no GPU: NVML found none, nothing to check",
            }
        )
    elif not readings:
        console.print("no GPU: NVML found none (or is not installed); nothing to check.")
    for r, p in found if not json_out else []:
        state = "ok" if not p else f"{len(p)} problem(s)"
        console.print(f"GPU {r.index} {r.name} {r.uuid}: {state}", highlight=False)
        for line in p:
            console.print(f"  {line}", highlight=False)
    if any(p for _, p in found):
        raise typer.Exit(1)
