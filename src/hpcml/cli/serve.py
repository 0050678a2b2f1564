"""`hpcml serve`, `hpcml loadtest` and `hpcml export onnx`: answer requests, measure, convert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from hpcml.cli.common import console, err_console, print_json
from hpcml.errors import ConfigError

export_app = typer.Typer(help="Convert an exported model to other formats.", no_args_is_help=True)


def serve(
    path: Path | None = typer.Argument(
        None, help="Export folder, run folder, or model repository (NAME/VERSION/ folders)."
    ),
    name: str | None = typer.Option(
        None, "--name", help="Name to serve one export under (default: its architecture)."
    ),
    config: Path | None = typer.Option(
        None, "--config", help="Serve config YAML (batching, versions, traffic, limits)."
    ),
    host: str | None = typer.Option(
        None, "--host", help="Address to listen on (default 127.0.0.1)."
    ),
    port: int | None = typer.Option(None, "--port", help="Port to listen on (default 8000)."),
    grpc_port: int | None = typer.Option(
        None,
        "--grpc-port",
        help="Also serve the OIP v2 gRPC API (inference.GRPCInferenceService) on this port.",
    ),
    backend: str | None = typer.Option(
        None, "--backend", help="torch, compile, onnx or onnx-int8 (all models)."
    ),
    max_batch_size: int | None = typer.Option(
        None, "--max-batch-size", help="Most samples per forward pass."
    ),
    max_queue_delay_ms: float | None = typer.Option(
        None, "--max-queue-delay-ms", help="Longest wait for a batch to fill."
    ),
    instances: int | None = typer.Option(
        None, "--instances", help="Model copies computing concurrently."
    ),
    threads: int | None = typer.Option(None, "--threads", help="Intra-op threads per instance."),
    admin_token_env: str | None = typer.Option(
        None,
        "--admin-token-env",
        help="Environment variable holding the admin bearer token (admin endpoints are off without it).",
    ),
    tokens: Path | None = typer.Option(
        None,
        "--tokens",
        help="Tokens file (YAML/JSON: sha256-hashed bearer tokens with roles infer/read/admin, "
        "model scopes, rate limits); every endpoint but health then needs a token.",
    ),
    tls_cert: Path | None = typer.Option(
        None, "--tls-cert", help="Serve HTTPS and gRPC over TLS with this certificate (PEM)."
    ),
    tls_key: Path | None = typer.Option(
        None, "--tls-key", help="The private key (PEM) of --tls-cert."
    ),
    tls_client_ca: Path | None = typer.Option(
        None,
        "--tls-client-ca",
        help="Mutual TLS: refuse clients without a certificate this CA bundle (PEM) signed.",
    ),
    audit_log: Path | None = typer.Option(
        None,
        "--audit-log",
        help="Append admin changes and alias-following deploys to this hash-chained JSON-lines "
        "file (check it with hpcml audit verify).",
    ),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level."),
    json_out: bool = typer.Option(False, "--json", help="Print the startup summary as JSON."),
    trust_code: bool = typer.Option(
        False,
        "--trust-code",
        help="Let a model.json that names an import path (pkg.mod:build) run that code; "
        "only for models from people you trust (zoo architectures never need it).",
    ),
    follow: bool = typer.Option(
        False,
        "--follow",
        help="With models:/NAME@ALIAS: poll the registry and deploy the version the alias "
        "moves to (load beside, warm, switch, unload the old one); with a canary section in "
        "the serve config, in steps, rolled back (alias too) when it breaches the SLO.",
    ),
    poll_s: float = typer.Option(10.0, "--poll-s", help="Seconds between registry polls."),
    tracing: bool = typer.Option(
        False,
        "--tracing",
        help="An OpenTelemetry trace per request (receive, queue, compute, respond) by OTLP/HTTP "
        "to $OTEL_EXPORTER_OTLP_ENDPOINT.",
    ),
    require_signature: bool = typer.Option(
        False,
        "--require-signature",
        help="Serve only exports signed with `hpcml export sign` (checked with --verify-key); "
        "an unsigned or changed one is refused, and --follow keeps the old version.",
    ),
    verify_key: Path | None = typer.Option(
        None, "--verify-key", help="The signer's public key (PEM) for --require-signature."
    ),
    prometheus_targets: Path | None = typer.Option(
        None,
        "--prometheus-targets",
        help="Folder a Prometheus reads file_sd targets from: the server writes its /metrics "
        "target there while it runs (removed when it stops; a server killed with SIGKILL leaves it "
        "until the next server or hpcml observe up on this host prunes it).",
    ),
) -> None:
    """Serve models over the Open Inference Protocol v2 (REST, and gRPC with --grpc-port) with dynamic batching."""
    from hpcml.serve.config import build_serve_config, load_serve_config
    from hpcml.serve.protocol.app import uvicorn_server

    cfg = load_serve_config(config)
    data = cfg.model_dump()
    for key, value in (
        ("host", host),
        ("port", port),
        ("grpc_port", grpc_port),
        ("admin_token_env", admin_token_env),
        ("tokens_file", tokens),
        ("audit_log", audit_log),
    ):
        if value is not None:
            data[key] = str(value) if isinstance(value, Path) else value
    if tls_cert is not None or tls_key is not None or tls_client_ca is not None:
        data["tls"] = _tls_section(tls_cert, tls_key, tls_client_ca, data.get("tls"))
    if tracing:
        data["tracing"] = True
    if require_signature:
        data["require_signature"] = True
    if verify_key is not None:
        data["verify_key"] = str(verify_key)
    per_model = {
        "backend": backend,
        "max_batch_size": max_batch_size,
        "max_queue_delay_ms": max_queue_delay_ms,
        "instances": instances,
        "threads": threads,
    }
    for section in [data["defaults"], *data["models"].values()]:
        section.update({k: v for k, v in per_model.items() if v is not None})
    cfg = build_serve_config(data, "--config and command-line options")
    from hpcml.serve.protocol.app import authorizer_of, tls_options

    tls_options(cfg)  # a wrong certificate, key or tokens file: one sentence before any load
    authorizer_of(cfg)
    if cfg.grpc_port:
        _check_port_free(cfg.host, cfg.grpc_port, "--grpc-port")
    app, summary = _build(path, cfg, name, trust_code, poll_s if follow else None)
    if json_out:
        print_json(summary)
    else:
        _print_summary(summary)
    target = _write_prometheus_target(prometheus_targets, cfg) if prometheus_targets else None
    if target is not None:
        _remove_on_stop_signal(target)
    try:
        uvicorn_server(app, cfg, log_level).run()
    finally:
        if target is not None:
            target.unlink(missing_ok=True)


def _tls_section(
    cert: Path | None, key: Path | None, client_ca: Path | None, from_file: dict[str, Any] | None
) -> dict[str, Any]:
    """The `tls` section from the options over the config file's: a certificate and its key
    come together."""
    tls = dict(from_file or {})
    for name, value in (("cert", cert), ("key", key), ("client_ca", client_ca)):
        if value is not None:
            tls[name] = str(value)
    if not tls.get("cert") or not tls.get("key"):
        raise ConfigError(
            "TLS needs both --tls-cert and --tls-key (or tls.cert and tls.key in --config); "
            "pass the certificate and its private key."
        )
    return tls


def _remove_on_stop_signal(target: Path) -> None:
    """uvicorn stops gracefully on SIGTERM/SIGINT, restores the handlers it found and raises
    the signal again, so the process ends by that signal before any `finally` runs. The
    handlers it finds are these: they remove the target, then let the signal act as usual."""
    import signal

    def stop(signum: int, _frame: object) -> None:
        target.unlink(missing_ok=True)
        signal.signal(
            signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        )
        signal.raise_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def _write_prometheus_target(folder: Path, cfg: Any) -> Path:
    import os
    import socket

    from hpcml.observe.targets import prune_dead, write_target

    if cfg.port == 0:
        raise ConfigError("--prometheus-targets needs a fixed --port (not 0); pass --port.")
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--prometheus-targets {str(folder)!r} is a file; pass a folder.")
    host = socket.gethostname() if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    labels = {"job": os.environ.get("HPCML_JOB", "hpcml-serve"), "role": "serve"}
    if cfg.tls is not None:  # file_sd's way to say how Prometheus must connect
        labels["__scheme__"] = "https"
    prune_dead(folder)  # targets of servers killed with SIGKILL on this host
    return write_target(folder / f"serve-{host}-{cfg.port}.json", host, cfg.port, labels)


def _check_port_free(host: str, port: int, option: str) -> None:
    """One clear sentence now, rather than a failed server startup after the models load."""
    from hpcml.serve.protocol.app import bind_socket

    try:
        bind_socket(host, port).close()
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror}); pick another {option}."
        ) from None


def _build(
    path: Path | None,
    cfg: Any,
    name: str | None,
    trust_code: bool = False,
    follow_poll_s: float | None = None,
) -> tuple[Any, dict[str, Any]]:
    from hpcml.serve.protocol.app import build_app

    app = build_app(path, cfg, name=name, trust_code=trust_code, follow_poll_s=follow_poll_s)
    router = app.state.router
    with err_console.status("loading models"):
        router.load()
    authorizer = app.state.authorizer
    summary = {
        "url": f"{'https' if cfg.tls else 'http'}://{cfg.host}:{cfg.port}",
        "tls": None if cfg.tls is None else ("mutual" if cfg.tls.client_ca else "server"),
        "tokens": len(authorizer.principals) if authorizer.tokens_file else None,
        "audit_log": cfg.audit_log,
        "grpc": f"{cfg.host}:{cfg.grpc_port}" if cfg.grpc_port is not None else None,
        "admin": authorizer.admin_possible,
        "models": [m.describe() for m in router.models.values()],
        "completions": sorted(app.state.generators),
        "batching": {
            name: {
                "max_batch_size": m.newest.config.max_batch_size,
                "max_queue_delay_ms": m.newest.config.max_queue_delay_ms,
                "instances": m.newest.config.instances,
                "max_queue_size": m.newest.config.max_queue_size,
            }
            for name, m in router.models.items()
        },
    }
    return app, summary


def _print_summary(summary: dict[str, Any]) -> None:
    table = Table(title=f"hpcml serve  {summary['url']}")
    for col in ("model", "version", "backend", "traffic", "shadow", "batching"):
        table.add_column(col)
    for m in summary["models"]:
        b = summary["batching"][m["name"]]
        for v, info in m["versions"].items():
            share = m["traffic"].get(v)
            shadow = m["shadow"]
            table.add_row(
                m["name"],
                v,
                info["backend"],
                f"{share:.0%}" if share else "-",
                f"{shadow['fraction']:.0%} mirrored" if shadow and shadow["version"] == v else "-",
                f"max {b['max_batch_size']}, {b['max_queue_delay_ms']:g} ms, x{b['instances']}",
            )
    console.print(table)
    console.print(
        f"OIP v2 at {summary['url']}/v2 · metrics {summary['url']}/metrics · API docs "
        f"{summary['url']}/docs · admin endpoints {'on' if summary['admin'] else 'off'}"
        + (f" · gRPC {summary['grpc']}" if summary["grpc"] else "")
        + (f" · TLS ({summary['tls']})" if summary["tls"] else "")
        + (f" · {summary['tokens']} tokens" if summary["tokens"] else "")
    )
    if summary["completions"]:
        console.print(
            f"text generation (OpenAI completions) at {summary['url']}/v1/completions for "
            + ", ".join(summary["completions"])
        )


def loadtest(
    url: str = typer.Argument(..., help="Server base URL, e.g. http://127.0.0.1:8000."),
    model: str = typer.Option(..., "--model", help="Model name."),
    version: str | None = typer.Option(
        None, "--version", help="Model version (default: the server's routing)."
    ),
    rate: float | None = typer.Option(
        None, "--rate", help="Open loop: Poisson arrivals at this many requests/s."
    ),
    concurrency: int | None = typer.Option(
        None, "--concurrency", help="Closed loop: this many clients."
    ),
    duration: float = typer.Option(10.0, "--duration", help="Seconds of load."),
    batch: int = typer.Option(1, "--batch", help="Samples per request."),
    timeout: float = typer.Option(30.0, "--timeout", help="Client timeout per request, seconds."),
    processes: int = typer.Option(
        1, "--processes", help="Client processes sharing the load (for rates one loop can't drive)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    binary: bool = typer.Option(
        False, "--binary", help="Send binary tensor data (what tritonclient sends), not JSON."
    ),
    grpc_target: str | None = typer.Option(
        None, "--grpc", help="HOST:PORT of the gRPC endpoint: send ModelInfer calls there."
    ),
    max_send_lag_ms: float = typer.Option(
        10.0,
        "--max-send-lag-ms",
        help="Open loop: a client send lag p99 over this marks the result invalid.",
    ),
    plot: Path | None = typer.Option(None, "--plot", help="Write a latency plot (PNG)."),
    out: Path | None = typer.Option(
        None, "--out", help="Write the result JSON (with the latency timeline) here."
    ),
    llm: bool = typer.Option(
        False, "--llm", help="Streaming /v1/completions: TTFT, inter-token latency, tokens/s."
    ),
    chat: bool = typer.Option(False, "--chat", help="--llm: send /v1/chat/completions."),
    prompt_len: str = typer.Option(
        "16:64", "--prompt-len", help="--llm: prompt lengths: N, LO:HI, lognormal:MEDIAN:SIGMA:MAX."
    ),
    max_tokens: int = typer.Option(32, "--max-tokens", help="--llm: tokens per request."),
    output_len: str | None = typer.Option(
        None, "--output-len", help="--llm: max_tokens drawn as --prompt-len is (not --max-tokens)."
    ),
    ttft_slo_ms: float = typer.Option(1000.0, "--ttft-slo-ms", help="--llm: goodput's TTFT."),
    itl_slo_ms: float = typer.Option(100.0, "--itl-slo-ms", help="--llm: goodput's mean ITL."),
    seed: int = typer.Option(
        0, "--seed", help="Seed of open-loop arrivals (--llm: and prompts); one per repetition."
    ),
) -> None:
    """Load-test an Open Inference Protocol server: open loop (--rate) or closed loop
    (--concurrency); with --llm, streaming OpenAI completions (TTFT, inter-token latency)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from hpcml.errors import WorkFailed
    from hpcml.records import write_json_atomic
    from hpcml.serve.loadtest import loadtest as run
    from hpcml.serve.loadtest_plot import plot_results

    check_url(url)
    if llm:
        from hpcml.cli.loadtest_llm import run_llm_mode

        lengths = (prompt_len, output_len or str(max_tokens))
        run_llm_mode(url, model, rate, duration, timeout, lengths, chat, ttft_slo_ms, itl_slo_ms,
                     seed, json_out)
        return
    with Progress(
        TextColumn("[bold]loadtest"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task("load", total=duration, info="")

        def progress(elapsed: float, sent: int, ok: int, errors: int) -> None:
            bar.update(task, completed=elapsed, info=f"sent {sent}  ok {ok}  errors {errors}")

        result = run(
            base_url=url,
            model=model,
            version=version,
            rate=rate,
            concurrency=concurrency,
            duration_s=duration,
            batch=batch,
            timeout_s=timeout,
            progress=progress,
            processes=processes,
            max_send_lag_ms=max_send_lag_ms,
            binary=binary,
            seed=seed,
            grpc_target=grpc_target,
        )
    if out is not None:
        write_json_atomic(out, result.to_json(with_timeline=True))
    if plot is not None:
        label = f"rate {rate:g}/s" if rate is not None else f"{concurrency} clients"
        plot_results([(label, result)], plot, title=f"{model} {label}")
    if json_out:
        print_json(result.to_json())
    else:
        _print_loadtest(result)
    if not result.valid:
        err_console.print(f"[bold yellow]invalid result:[/] {result.invalid_reason}")
    if result.ok == 0:
        raise WorkFailed(f"no request to {result.url} succeeded (errors: {result.errors}).")


def check_url(url: str) -> None:
    """A server base URL: http(s)://host[:port][/path]; anything else is the input's fault."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port that is not a number in 0..65535
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"'{url}' is not a server URL; pass http://HOST:PORT, e.g. http://127.0.0.1:8000."
        )
    del port


def _print_loadtest(r: Any) -> None:
    mode = (
        f"open loop, target {r.target_rate:g}/s"
        if r.mode == "open"
        else f"closed loop, {r.concurrency} clients"
    )
    table = Table(title=f"loadtest: {mode}, {r.duration_s:g} s", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("endpoint", r.url)
    table.add_row("requests sent", f"{r.sent:,}")
    table.add_row(
        "achieved rate",
        f"{r.achieved_rate:,.1f}/s" + (f" of {r.target_rate:g}/s" if r.target_rate else ""),
    )
    table.add_row("throughput (ok)", f"{r.throughput:,.1f}/s")
    if r.processes > 1:
        table.add_row("client processes", str(r.processes))
    for key in ("p50", "p90", "p99", "p99.9", "max"):
        if key in r.latency_ms:
            table.add_row(f"latency {key} (ok)", f"{r.latency_ms[key]:,.2f} ms")
    for key in ("p50", "p99", "max"):
        if key in r.latency_all_ms and r.errors:
            table.add_row(f"latency {key} (all, errors too)", f"{r.latency_all_ms[key]:,.2f} ms")
    table.add_row("ok", f"{r.ok:,}")
    for status, n in r.errors.items():
        table.add_row(f"errors {status}", f"{n:,}")
    if r.not_sent:
        table.add_row("not sent (client in-flight limit)", f"{r.not_sent:,}")
    if r.mode == "open":
        table.add_row("client send lag p99", f"{r.send_lag_ms_p99:,.2f} ms")
    console.print(table)


@export_app.command("onnx")
def export_onnx_cmd(
    path: Path = typer.Argument(..., help="Run folder or export folder."),
    int8: bool = typer.Option(
        False, "--int8", help="Also write model.int8.onnx (ONNX Runtime dynamic quantization)."
    ),
    opset: int | None = typer.Option(None, "--opset", help="ONNX opset (default: the exporter's)."),
    reduce_range: bool | None = typer.Option(
        None,
        "--reduce-range/--no-reduce-range",
        help="INT8 weights in 7 bits (safe on every CPU) or 8 bits (only for x86 with VNNI or "
        "ARM). Default: chosen from this machine's CPU features.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    trust_code: bool = typer.Option(
        False,
        "--trust-code",
        help="Let a model.json that names an import path (pkg.mod:build) run that code.",
    ),
) -> None:
    """Export to ONNX with a dynamic batch axis, check it against torch, optionally quantize to INT8."""
    from hpcml.serve.runtime.onnx_export import check_export_dir, export_onnx

    export_dir = check_export_dir(path)
    with err_console.status("exporting to ONNX and measuring"):
        report = export_onnx(
            export_dir, int8=int8, opset=opset, reduce_range=reduce_range, trust_code=trust_code
        )
    if json_out:
        print_json(report)
        return
    console.print(f"wrote {report['onnx']}" + (f" and {report['onnx_int8']}" if int8 else ""))
    if int8:
        q = report["int8_settings"]
        cpu = q["cpu"]
        console.print(
            f"INT8 for this CPU ({cpu['arch']}, features {', '.join(cpu['features']) or 'none'} "
            f"from {cpu['source']}): reduce_range={q['reduce_range']}, "
            f"per_channel={q['per_channel']}; {q['reason']}."
        )
    checks = ", ".join(
        f"batch {c['batch']}: max |diff| {c['max_abs_diff']:.2g}" for c in report["check"]
    )
    console.print(f"matches torch ({checks})")
    acc = report["accuracy"]
    speed = report["speed"]
    runners = list(speed["batch_1_samples_per_s"])
    runners = [r for r in runners if not r.startswith("int8_")]
    table = Table(title="torch vs ONNX Runtime" + (" vs INT8" if int8 else ""))
    table.add_column("")
    for r in runners:
        table.add_column(r, justify="right")
    if acc.get("measured"):
        table.add_row(
            f"val accuracy ({acc['samples']} samples)", *[f"{acc[r]:.4f}" for r in runners]
        )
    for key, row in speed.items():
        label = key.replace("_samples_per_s", "").replace("_", " ") + " samples/s"
        table.add_row(label, *[f"{row[r]:,.0f}" for r in runners])
    console.print(table)
    if not acc.get("measured"):
        console.print(f"accuracy change {acc['reason']}")
    elif int8:
        console.print(
            f"INT8 accuracy change {acc['int8_minus_fp32']:+.4f} "
            f"(top-1 agreement with fp32 {acc['int8_agreement_with_fp32']:.2%}); speed "
            f"x{speed['batch_1_samples_per_s']['int8_speedup_vs_fp32']:.2f} at batch 1, "
            f"x{speed['batch_32_samples_per_s']['int8_speedup_vs_fp32']:.2f} at batch 32."
        )


def register(app: typer.Typer) -> None:
    """Add `serve`, `loadtest` and `export` to the hpcml app."""
    app.command("serve", help=serve.__doc__)(serve)
    app.command("loadtest", help=loadtest.__doc__)(loadtest)
    app.add_typer(export_app, name="export")
