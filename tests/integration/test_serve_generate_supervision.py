"""The generation engine's own process under kill -9, in a real `hpcml serve` over loopback.

Three clients stream long completions; the test kills the engine process with SIGKILL after
their first tokens. Expected: every stream ends at once with the one-sentence "retry" error
event and `[DONE]` (none hangs, the server does not die), a completion sent meanwhile waits
for the new engine process instead of failing, the new process has another pid and generates
the same greedy text as before the kill, and `hpcml_llm_engine_restarts_total` counts one
restart. OIP inference runs in the server's thread here (`isolation: thread`), so the
server's only spawned child is the engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from gpt_export import save_gpt_export
from test_serve_supervision import gone, inference_children

from hpcml.models.gpt import GPT, GPTConfig
from hpcml.serve.loadtest import wait_ready
from hpcml.serve.protocol.app import bind_socket

pytestmark = pytest.mark.timeout(300)

SRC = Path(__file__).resolve().parents[2] / "src"
ARGS = {"vocab_size": 256, "max_seq_len": 1024, "n_layer": 2, "n_head": 2, "d_model": 32}
NAME = "poet"


@contextmanager
def _serve(tmp_path: Path, generation: str = "") -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`hpcml serve` of a gpt export as a process; SIGTERM (then SIGKILL) at the end."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**ARGS)).eval()
    export = save_gpt_export(tmp_path / "export", model, ARGS)
    (tmp_path / "serve.yaml").write_text("defaults:\n  isolation: thread\n" + generation)
    sock = bind_socket("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    sock.close()
    cmd = [sys.executable, "-m", "hpcml", "serve", str(export), "--name", NAME]
    cmd += ["--port", str(port), "--config", str(tmp_path / "serve.yaml")]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    err = (tmp_path / "server.err").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _long_stream(url: str, started: threading.Event, out: list[list[str]]) -> None:
    """One streamed completion of 1000 tokens; the data lines it got, in order."""
    lines: list[str] = []
    body = {"model": NAME, "prompt": "x", "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                started.set()
    out.append(lines)


def _greedy(url: str) -> httpx.Response:
    body = {"model": NAME, "prompt": "def f(", "max_tokens": 12, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _gauge(url: str, key: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(key):
            return float(line.split()[-1])
    return 0.0


def _restarts(url: str) -> float:
    return _gauge(url, f'hpcml_llm_engine_restarts_total{{model="{NAME}"}} ')


def test_a_killed_engine_process_fails_its_streams_in_one_sentence_and_is_replaced(
    tmp_path: Path,
) -> None:
    with _serve(tmp_path) as (proc, url):
        wait_ready(url, timeout_s=180)
        before = _greedy(url)
        assert before.status_code == 200
        (engine,) = inference_children(proc.pid)
        assert _restarts(url) == 0

        streams: list[list[str]] = []
        started = [threading.Event() for _ in range(3)]
        threads = [
            threading.Thread(target=_long_stream, args=(url, s, streams), daemon=True)
            for s in started
        ]
        for t in threads:
            t.start()
        for s in started:
            assert s.wait(120), "a stream never got its first token"
        os.kill(engine, signal.SIGKILL)
        while not gone(engine):
            time.sleep(0.001)
        meanwhile = _greedy(url)  # waits for the new engine process, does not fail
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a stream hung after its engine process died"

        assert len(streams) == 3
        for lines in streams:
            assert lines[-1] == "data: [DONE]"
            assert '"error"' in lines[-2] and "retry" in lines[-2], lines[-2]
            assert len(lines) < 1000  # cut short, not finished
        assert meanwhile.status_code == 200
        assert meanwhile.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        (new_engine,) = inference_children(proc.pid)
        assert new_engine != engine
        assert _restarts(url) == 1
        assert proc.poll() is None, "the server died with its engine process"


def test_an_engine_that_cannot_start_again_fails_requests_at_once_until_it_can(
    tmp_path: Path,
) -> None:
    """The export's weights vanish, then the engine process dies: its replacement cannot load
    them, so completions get 503 with the retry sentence at once (not a hang) while the server
    keeps trying; once the weights are back, the next attempt succeeds and so do requests."""
    weights = tmp_path / "export" / "model.safetensors"
    with _serve(tmp_path) as (proc, url):
        wait_ready(url, timeout_s=180)
        before = _greedy(url)
        (engine,) = inference_children(proc.pid)
        weights.rename(tmp_path / "away.safetensors")
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while (r := _greedy(url)).status_code != 503:
            assert r.status_code == 200 and time.monotonic() < deadline, r.text
            time.sleep(0.05)  # answered by the old process's waiters only after a failed start
        assert "retry" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
        # Readiness tells the truth: no engine can serve (main: 200 from both, the OIP
        # version being fine).
        assert httpx.get(f"{url}/v2/health/ready").status_code == 400
        assert httpx.get(f"{url}/v2/models/{NAME}/ready").status_code == 400
        t0 = time.monotonic()
        assert _greedy(url).status_code == 503
        assert time.monotonic() - t0 < 30, "a request waited on an engine that cannot start"
        (tmp_path / "away.safetensors").rename(weights)
        while (r := _greedy(url)).status_code != 200:
            assert r.status_code == 503 and time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert r.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        assert httpx.get(f"{url}/v2/health/ready").status_code == 200
        assert httpx.get(f"{url}/v2/models/{NAME}/ready").status_code == 200
        assert proc.poll() is None


def test_a_hung_engine_process_is_killed_and_replaced(tmp_path: Path) -> None:
    """SIGSTOP freezes the engine process mid-stream (a hang, not a death: its pipes stay
    open). With `step_timeout_s: 2` the server kills it after 2 s without a step; the stream
    ends with the retry sentence, and the next completion comes from a new process."""
    with _serve(tmp_path, "generation:\n  step_timeout_s: 2\n") as (proc, url):
        wait_ready(url, timeout_s=180)
        before = _greedy(url)
        (engine,) = inference_children(proc.pid)
        streams: list[list[str]] = []
        started = threading.Event()
        thread = threading.Thread(target=_long_stream, args=(url, started, streams), daemon=True)
        thread.start()
        assert started.wait(120)
        os.kill(engine, signal.SIGSTOP)
        thread.join(120)
        assert not thread.is_alive(), "the stream hung with its engine process"
        (lines,) = streams
        assert lines[-1] == "data: [DONE]" and "retry" in lines[-2], lines[-2:]
        assert gone(engine)
        # The new engine holds nothing: the dead one's running sequence leaves the gauge.
        running = f'hpcml_llm_sequences{{model="{NAME}",state="running"}} '
        deadline = time.monotonic() + 60
        while _gauge(url, running) != 0:
            assert time.monotonic() < deadline, "the dead engine's sequence stayed on the gauge"
            time.sleep(0.05)
        after = _greedy(url)
        assert after.status_code == 200
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        (new_engine,) = inference_children(proc.pid)
        assert new_engine != engine
        assert _restarts(url) == 1
        err = (tmp_path / "server.err").read_text()
        assert "reported no step for" in err, err[-2000:]
