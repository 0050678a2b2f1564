"""The body of a text model's engine process, and the messages it exchanges with the server.

A served text model's engine runs in a child process of its own (spawned), as OIP inference
does: a crash there (a segfault in a kernel, the kernel's OOM killer, kill -9) ends that
process, not the server, and the server starts a new one (`service.GenerationService`).

Both directions carry length-prefixed pickles (`backends.write_frame`) between the server and
the process it spawned itself, never anything a user sent as a file. The server sends
`("submit", seq_id, prompt, params)`, `("abort", seq_id)` and `("stop",)`; the process answers
`("ready", None)` or `("error", message)` once, then after every step
`("events", [(seq_id, token, finish_reason, stopped_by, reason, logprob, prompt_logprobs),
...], StepStats)`. Between steps it reads
every command that has arrived; with no work it sleeps on its command pipe.
"""

from __future__ import annotations

import logging
import pickle
import select
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hpcml.errors import ModelError
from hpcml.serve.generate.engine import Engine, EngineConfig, TokenEvent
from hpcml.serve.runtime.backends import read_frame, write_frame

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process needs to build its engine (all of it picklable)."""

    name: str
    export_dir: str
    config: EngineConfig
    tokenizer: Any
    """The model's `Tokenizer` (bytes, or a Hugging Face byte-level BPE)."""
    trust_code: bool = False
    quantize: str = "none"
    threads: int | None = None


@dataclass(frozen=True)
class StepStats:
    """What the engine reports with every step's events (for the server's metrics)."""

    running: int
    waiting: int
    blocks_used: int
    preemptions: int
    """Preemptions so far."""
    batch_size: int
    """Sequences in the step (0: no step since the last report)."""
    admitted: tuple[int, ...]
    """Sequences admitted for the first time since the last report (their queue time ends)."""
    prefix_hit_tokens: int
    """Tokens found in the prefix cache so far."""
    prefix_query_tokens: int
    """Tokens of admitted sequences so far (what the prefix cache was asked for)."""


def stats(engine: Engine) -> StepStats:
    admitted, engine.admitted = tuple(engine.admitted), []
    batch, engine.batch_size = engine.batch_size, 0
    return StepStats(
        len(engine.running),
        len(engine.waiting),
        engine.blocks_used,
        engine.preemptions,
        batch,
        admitted,
        engine.prefix_hit_tokens,
        engine.prefix_query_tokens,
    )


def build_engine(spec: EngineSpec) -> Engine:
    import torch

    from hpcml.models.export import load_export
    from hpcml.models.gpt import GPT

    if spec.threads:
        torch.set_num_threads(spec.threads)
    model, _ = load_export(Path(spec.export_dir), trust_code=spec.trust_code)
    if not isinstance(model, GPT):
        raise ModelError(f"{spec.export_dir} no longer holds a gpt export; serve it again.")
    if spec.quantize == "int8":
        from hpcml.serve.generate.quantize import quantize_int8

        quantize_int8(model)
    elif spec.quantize == "bf16":
        model.to(torch.bfloat16)
    return Engine(model, spec.config, spec.tokenizer)


def run_engine(spec: EngineSpec, commands: Connection, events: Connection) -> None:
    """Build the engine, then step it until told to stop or the server is gone."""
    # The server decides when to stop; Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox, out = commands.fileno(), events.fileno()

    def send(obj: object) -> None:
        write_frame(out, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        engine = build_engine(spec)
    except Exception as exc:  # noqa: BLE001 - reported to the server, which raises it
        send(("error", f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"))
        return
    send(("ready", None))
    try:
        while True:
            # Block on the pipe only while there is nothing to step and nothing to report.
            changed: list[tuple[Any, ...]] = []
            while select.select([inbox], [], [], 0 if engine.has_work or changed else None)[0]:
                message = pickle.loads(read_frame(inbox))
                if message[0] == "stop":
                    return
                changed.append(_apply(engine, message))
            if engine.has_work:
                emitted = [_flat(ev) for ev in _step(engine, spec.name)]
                send(("events", [e for e in changed if e] + emitted, stats(engine)))
            elif changed:  # aborts emptied the engine: the server's gauges must say so
                send(("events", [e for e in changed if e], stats(engine)))
    except (EOFError, BrokenPipeError):  # the server is gone
        return


def _apply(engine: Engine, message: tuple[Any, ...]) -> tuple[Any, ...]:
    """Carry out one command; the abort event of a submit the engine refused, else ()."""
    if message[0] == "submit":
        _, seq_id, prompt, params = message
        try:
            engine.submit(prompt, params, seq_id)
        except ValueError:  # checked by the server already; never expected here
            return (seq_id, None, "abort", None, "the engine refused the request.")
    elif message[0] == "abort":
        engine.abort(message[1])
    return ()


def _step(engine: Engine, name: str) -> list[TokenEvent]:
    try:
        return engine.step()
    except Exception:  # a bug of ours: fail the running requests, keep serving
        log.exception("generation step of model %r failed", name)
        why = "a generation step failed on the server (its log has the error); retry."
        events = [
            TokenEvent(seq_id=s.id, token=None, finish_reason="abort", reason=why)
            for s in engine.running
        ]
        for ev in events:
            engine.abort(ev.seq_id)
        return events


def _flat(ev: TokenEvent) -> tuple[Any, ...]:
    return (
        ev.seq_id,
        ev.token,
        ev.finish_reason,
        ev.stopped_by,
        ev.reason,
        ev.logprob,
        ev.prompt_logprobs,
    )
