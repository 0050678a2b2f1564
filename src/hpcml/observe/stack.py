"""`hpcml observe up`: the files to run Prometheus and Grafana on hpcml's runs and servers,
with the shipped alerting rules and dashboards provisioned, and the commands that start them.

Writes, into one folder: `prometheus.yml` (file_sd over the runs' and servers' target files,
`honor_labels`, the rules, the Alertmanager it sends alerts to), `rules/hpcml.yaml`,
`alertmanager.yml` (routes by severity, inhibitions, placeholder receivers),
`grafana/provisioning/` (a Prometheus data source and a dashboard provider),
`grafana/dashboards/*.json`, and a `docker-compose.yml` that runs the three with host
networking (the targets name this host's addresses).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from hpcml.errors import ConfigError
from hpcml.observe.targets import prune_dead

HERE = Path(__file__).resolve().parent
PROMETHEUS_IMAGE = "prom/prometheus:v2.53.0"
GRAFANA_IMAGE = "grafana/grafana:11.1.0"
ALERTMANAGER_IMAGE = "prom/alertmanager:v0.27.0"
ALERTMANAGER_PORT = 9093
RUNBOOKS = "docs/guides/runbooks.md#"


def prometheus_config(run_globs: list[str], scrape_s: int) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": f"{scrape_s}s", "evaluation_interval": f"{scrape_s}s"},
        "rule_files": ["rules/hpcml.yaml"],
        "alerting": {
            "alertmanagers": [{"static_configs": [{"targets": [f"localhost:{ALERTMANAGER_PORT}"]}]}]
        },
        "scrape_configs": [
            {
                "job_name": "hpcml",
                # The series' job label is hpcml's own (SLURM job id, observe.job).
                "honor_labels": True,
                "file_sd_configs": [{"files": run_globs, "refresh_interval": "10s"}],
            }
        ],
    }


def rules_text(docs_url: str | None) -> str:
    """The shipped rules; with `docs_url` (the docs site's root), runbook links into it."""
    text = (HERE / "rules" / "hpcml.yaml").read_text()
    if docs_url:
        text = text.replace(RUNBOOKS, f"{docs_url.rstrip('/')}/guides/runbooks/#")
    return text


def write_stack(
    out: Path,
    targets: list[Path],
    scrape_s: int = 5,
    port: int = 9090,
    docs_url: str | None = None,
) -> dict[str, Any]:
    """`targets`: folders of target files (observe.targets_dir, RUN_DIR/prometheus, the folder
    of `hpcml serve --prometheus-targets`); `docs_url`: where the docs site is published."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; pass a folder for the stack's files.")
    if not targets:
        raise ConfigError(
            "hpcml observe up needs --targets: the folder(s) of target files "
            "(observe.targets_dir, RUN_DIR/prometheus, or hpcml serve --prometheus-targets)."
        )
    for folder in targets:  # targets of processes on this host killed with SIGKILL
        prune_dead(folder)
    globs = [str(t.resolve() / "*.json") for t in targets]
    out.mkdir(parents=True, exist_ok=True)
    (out / "rules").mkdir(exist_ok=True)
    (out / "rules" / "hpcml.yaml").write_text(rules_text(docs_url))
    shutil.copyfile(HERE / "rules" / "alertmanager.yml", out / "alertmanager.yml")
    (out / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(globs, scrape_s), sort_keys=False))
    boards = out / "grafana" / "dashboards"
    boards.mkdir(parents=True, exist_ok=True)
    for board in sorted((HERE / "dashboards").glob("*.json")):
        shutil.copyfile(board, boards / board.name)
    prov = out / "grafana" / "provisioning"
    (prov / "datasources").mkdir(parents=True, exist_ok=True)
    (prov / "dashboards").mkdir(parents=True, exist_ok=True)
    (prov / "datasources" / "prometheus.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": 1,
                "datasources": [
                    {"name": "Prometheus", "type": "prometheus", "access": "proxy",
                     "url": f"http://localhost:{port}", "isDefault": True}
                ],
            },
            sort_keys=False,
        )
    )
    (prov / "dashboards" / "hpcml.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": 1,
                "providers": [
                    {"name": "hpcml", "type": "file", "folder": "hpcml",
                     "options": {"path": "/var/lib/grafana/dashboards"}}
                ],
            },
            sort_keys=False,
        )
    )
    # The containers must see the target files where the globs say they are: mount each
    # watched folder at its own path.
    mounts = sorted({str(t.resolve()) for t in targets})
    compose = {
        "services": {
            "prometheus": {
                "image": PROMETHEUS_IMAGE,
                "network_mode": "host",
                "command": [
                    "--config.file=/etc/prometheus/prometheus.yml",
                    f"--web.listen-address=:{port}",
                ],
                "volumes": [
                    "./prometheus.yml:/etc/prometheus/prometheus.yml:ro",
                    "./rules:/etc/prometheus/rules:ro",
                    *[f"{m}:{m}:ro" for m in mounts],
                ],
            },
            "alertmanager": {
                "image": ALERTMANAGER_IMAGE,
                "network_mode": "host",
                "command": ["--config.file=/etc/alertmanager/alertmanager.yml"],
                "volumes": ["./alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro"],
            },
            "grafana": {
                "image": GRAFANA_IMAGE,
                "network_mode": "host",
                "volumes": [
                    "./grafana/provisioning:/etc/grafana/provisioning:ro",
                    "./grafana/dashboards:/var/lib/grafana/dashboards:ro",
                ],
            },
        }
    }
    (out / "docker-compose.yml").write_text(yaml.safe_dump(compose, sort_keys=False))
    return {
        "folder": str(out),
        "watches": globs,
        "commands": [
            f"cd {out} && docker compose up -d    # Prometheus :{port}, Alertmanager "
            f":{ALERTMANAGER_PORT}, Grafana :3000 (admin/admin)",
            f"prometheus --config.file={out / 'prometheus.yml'}    # or without Docker",
        ],
        "dashboards": sorted(p.name for p in boards.iterdir()),
        "alert_rules": _alert_names(),
    }


def _alert_names() -> list[str]:
    rules = yaml.safe_load((HERE / "rules" / "hpcml.yaml").read_text())
    return [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]
