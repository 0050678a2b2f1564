"""Work nobody waits for is refused or freed, and failures name their cause, over real HTTP.

One in-thread server (`running_server`, a real uvicorn on loopback) with one sequence per step,
`max_waiting: 1` and `request_timeout_s: 3`. The engine process is frozen with SIGSTOP to hold
requests where the test wants them (no timing race: a frozen engine takes nothing off the
queue), then thawed with SIGCONT or killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gpt_export import save_gpt_export
from test_serve_generate import ARGS, NAME, make_model, scrape

from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

pytestmark = pytest.mark.timeout(300)
DEADLINE_S = 3


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    export = save_gpt_export(tmp_path_factory.mktemp("run") / "export", make_model(), ARGS)
    generation = {
        "kv_cache_blocks": 130,
        "block_size": 8,
        "max_num_seqs": 1,
        "max_waiting": 1,
        "request_timeout_s": DEADLINE_S,
    }
    cfg = ServeConfig.model_validate(
        {"defaults": {"isolation": "thread"}, "generation": generation}
    )
    app = build_app(Path(export), cfg, name=NAME)
    with running_server(app) as url:
        yield url, app.state.generators[NAME]


def _post(url: str, path: str, body: dict[str, Any], out: list[httpx.Response]) -> None:
    out.append(httpx.post(f"{url}{path}", json={"model": NAME, **body}, timeout=120))


def _stream(url: str, started: threading.Event, out: list[str]) -> None:
    body = {"model": NAME, "prompt": "a", "max_tokens": 990, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line)
                started.set()


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_full_queue_answers_429_and_the_deadline_frees_what_nobody_waits_for(
    served: tuple[str, Any],
) -> None:
    url, service = served
    stream: list[str] = []
    started = threading.Event()
    a = threading.Thread(target=_stream, args=(url, started, stream), daemon=True)
    a.start()
    assert started.wait(60), "the stream never started"
    engine = service.pid
    os.kill(engine, signal.SIGSTOP)  # A runs; nothing more moves
    try:
        answers: list[httpx.Response] = []
        b = threading.Thread(
            target=_post,
            args=(url, "/v1/completions", {"prompt": "b", "max_tokens": 5}, answers),
            daemon=True,
        )
        b.start()
        _until(lambda: service.waiting == 1, "the second request never queued")
        full = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "c"}, timeout=60)
        assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text
        assert "max_waiting 1" in full.json()["error"]["message"]
        # The deadline passes while the engine is frozen: both requests end, saying why.
        b.join(60)
        a.join(60)
        assert not a.is_alive() and not b.is_alive()
        (late,) = answers
        assert late.status_code == 503 and late.headers["retry-after"] == "1"
        assert f"request_timeout_s of {DEADLINE_S} s" in late.json()["error"]["message"]
        assert stream[-1] == "data: [DONE]"
        assert "request_timeout_s" in json.loads(stream[-2][6:])["error"]["message"]
    finally:
        os.kill(engine, signal.SIGCONT)
    # Thawed, the engine drops both sequences: nothing runs, waits or holds KV blocks.
    held = [
        f'hpcml_llm_sequences{{model="{NAME}",state="running"}}',
        f'hpcml_llm_sequences{{model="{NAME}",state="waiting"}}',
        f'hpcml_llm_kv_cache_blocks_used{{model="{NAME}"}}',
    ]
    _until(lambda: not any(scrape(url)[k] for k in held), "the expired requests held the engine")
    ok = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "d"}, timeout=60)
    assert ok.status_code == 200
    refused = scrape(url)[f'hpcml_llm_refused_requests_total{{model="{NAME}"}}']
    assert refused == 1


def test_an_engine_death_is_named_in_the_503_of_a_non_streamed_chat(
    served: tuple[str, Any],
) -> None:
    """Main told this client "the server is shutting down". Readiness is 400 until a new
    engine runs."""
    url, service = served
    engine = service.pid
    os.kill(engine, signal.SIGSTOP)
    answers: list[httpx.Response] = []
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    chat = threading.Thread(
        target=_post, args=(url, "/v1/chat/completions", body, answers), daemon=True
    )
    chat.start()
    _until(lambda: service.waiting == 1, "the chat never reached the engine")
    os.kill(engine, signal.SIGKILL)
    chat.join(60)
    (r,) = answers
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    message = r.json()["error"]["message"]
    assert "process of model 'poet' died (killed by SIGKILL)" in message, message
    assert "shutting down" not in message
    # Not ready until a new engine runs: the death is seen before the 503 is sent, and a new
    # engine process takes seconds to spawn and load its model, the check milliseconds.
    assert httpx.get(f"{url}/v2/health/ready", timeout=30).status_code == 400
    _until(lambda: service.pid not in (None, engine) and service.is_ready(), "no new engine")
    assert httpx.get(f"{url}/v2/health/ready", timeout=30).status_code == 200


def test_max_waiting_counts_sequences_and_refuses_a_request_larger_than_the_bound(
    served: tuple[str, Any],
) -> None:
    """`max_waiting` counts sequences (prompts x n), not requests: with the engine idle and the
    bound at 1, a request of n = 2 (or of two prompts) would alone make 2 wait, so it is answered
    429 with Retry-After and a sentence that says to send a smaller n, through the official
    `openai` client (its retries off, so the 429 reaches the test) and raw HTTP for chat and a
    prompt list; the same request with n = 1 is served. Main let any request in while fewer
    than max_waiting requests waited, so n = 64 added 64 sequences to a bound of 1."""
    import openai

    url, _ = served
    counter = f'hpcml_llm_refused_requests_total{{model="{NAME}"}}'
    refused_before = scrape(url).get(counter, 0.0)  # absent until a first refusal
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=NAME, prompt="a", max_tokens=2, n=2, temperature=1)
    assert caught.value.response.headers["retry-after"] == "1"
    message = caught.value.response.json()["error"]["message"]
    assert "asks for 2 sequences" in message and "smaller n" in message, message
    answer = client.completions.create(model=NAME, prompt="a", max_tokens=2, n=1)
    assert len(answer.choices) == 1
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 3}
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, **chat}, timeout=60)
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    assert "asks for 3 sequences" in r.json()["error"]["message"]
    two = {"model": NAME, "prompt": ["a", "b"], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=two, timeout=60)
    assert r.status_code == 429 and "asks for 2 sequences" in r.json()["error"]["message"]
    assert scrape(url)[counter] == refused_before + 3
