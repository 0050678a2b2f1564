"""`/v1/completions` of `hpcml serve` for a gpt export, over a real uvicorn on loopback.

Greedy answers are compared with a full-recompute loop over the same weights. The served model
is float32 and the server batches, so its logits differ from the reference's by rounding only
(other summation orders): at most about n * 6e-8 * sum |terms| per operation, ~1e-5 here with
32-wide dot products of values below 10 (the reference asserts |logits| < 10), compounded over
a dozen operations. The reference also asserts that its best logit beats the second by more
than 1e-3, so no rounding difference can flip a token.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from gpt_export import save_gpt_export
from tests.conftest import system_binary
from tests.unit.generate_util import served_reference as reference
from tests.unit.generate_util import widen

from hpcml.models.gpt import GPT, GPTConfig
from hpcml.serve.config import ServeConfig
from hpcml.serve.loadtest import wait_ready
from hpcml.serve.protocol.app import bind_socket, build_app
from hpcml.serve.testing import running_server

ARGS = {
    "vocab_size": 256,
    "max_seq_len": 1024,
    "n_layer": 2,
    "n_head": 2,
    "d_model": 32,
    "tie_embeddings": False,
}
NAME = "poet"


def make_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**ARGS)).eval()
    widen(model)  # a random model whose greedy outputs depend on the context
    return model


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GPT, str, Any]]:
    model = make_model()
    export = save_gpt_export(tmp_path_factory.mktemp("run") / "export", model, ARGS)
    cfg = ServeConfig.model_validate(
        {
            "defaults": {"isolation": "thread"},
            "generation": {"kv_cache_blocks": 130, "block_size": 8, "max_batched_tokens": 16},
        }
    )
    app = build_app(export, cfg, name=NAME)
    with running_server(app) as url:
        yield model, url, app


def complete(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": NAME, **body}, timeout=60)


def stream(url: str, **body: Any) -> list[dict[str, Any]]:
    chunks = []
    payload = {"model": NAME, "stream": True, **body}
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        chunks.append(json.loads(line[6:]))
    return chunks


def test_greedy_completion_matches_the_full_recompute_loop(served: tuple[GPT, str, Any]) -> None:
    model, url, _ = served
    r = complete(url, prompt="import os\n", max_tokens=20, temperature=0)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == NAME
    assert body["choices"][0]["text"] == reference(model, "import os\n", 20)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}


def test_stream_sends_the_same_text_in_pieces(served: tuple[GPT, str, Any]) -> None:
    model, url, _ = served
    chunks = stream(url, prompt="def f(x):", max_tokens=24, temperature=0)
    assert len(chunks) > 3
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference(model, "def f(x):", 24)


def test_concurrent_streams_each_get_their_own_answer(served: tuple[GPT, str, Any]) -> None:
    """Four streams at once: whichever way their arrivals interleave, each text is exact."""
    model, url, _ = served
    prompts = ["class A:", "def g(y):", "x = [", "# comment about"]

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        text = ""
        body = {"model": NAME, "prompt": prompt, "max_tokens": 30, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def all_of() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(all_of())
    assert got == [reference(model, p, 30) for p in prompts]


def test_stop_sequence_seed_and_sampling_over_http(served: tuple[GPT, str, Any]) -> None:
    model, url, _ = served
    full = reference(model, "while True:", 16)
    # The first two ASCII characters (the bytes are random; others decode to U+FFFD, which
    # is not what the model emitted) that do not occur earlier.
    i = next(
        i
        for i in range(2, len(full) - 1)
        if full[i : i + 2].isascii() and full[i : i + 2] not in full[: i + 1]
    )
    stop = full[i : i + 2]
    r = complete(url, prompt="while True:", max_tokens=16, temperature=0, stop=["\u2603", stop])
    assert r.json()["choices"][0] == {
        "text": full[:i],
        "index": 0,
        "logprobs": None,
        "finish_reason": "stop",
    }
    params = {"prompt": "if x:", "max_tokens": 12, "temperature": 1.2, "top_p": 0.9, "top_k": 50}
    a = complete(url, seed=7, **params).json()["choices"][0]["text"]
    b = complete(url, seed=7, **params).json()["choices"][0]["text"]
    c = complete(url, seed=8, **params).json()["choices"][0]["text"]
    assert a == b != c


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"prompt": "x", "suffix": "y"}, 400, "'suffix' = 'y' is not supported"),
        ({"prompt": "x", "temperature": -1}, 400, "'temperature'"),
        ({"prompt": "x", "best_of": 3}, 400, "'best_of'"),
        ({"prompt": "x", "frobnicate": 1}, 400, "'frobnicate' is not known"),
        ({"prompt": "x" * 1000, "max_tokens": 30}, 400, "context of 1024"),
        ({"prompt": "", "max_tokens": 1}, 400, "prompt is empty"),
        ({"prompt": [[7, 300]]}, 400, "token id 300 in 'prompt' is outside"),
        ({"prompt": ["a", "b"], "n": 65}, 400, "more than 128"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        ({"prompt": "x", "model": "cifar"}, 404, "does not generate text"),
        ({"max_tokens": 3}, 400, "'prompt'"),
        # Past torch.Generator's seed range: once a 503 "shutting down" from the sampler.
        ({"prompt": "x", "seed": 2**80}, 400, "'seed'"),
    ],
)
def test_bad_requests_get_one_sentence(
    served: tuple[GPT, str, Any], body: dict[str, Any], status: int, words: str
) -> None:
    _, url, _ = served
    r = httpx.post(f"{url}/v1/completions", json={"model": NAME, **body}, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert words in err["message"] and err["message"].count(". ") == 0
    assert err["type"] == "invalid_request_error"


def test_invalid_json_is_a_400(served: tuple[GPT, str, Any]) -> None:
    _, url, _ = served
    r = httpx.post(f"{url}/v1/completions", content=b"{nope", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_a_client_that_goes_away_frees_its_sequence(served: tuple[GPT, str, Any]) -> None:
    """A stream of 1000 tokens whose client hangs up after the first chunk is dropped by the
    engine well before its end (the whole generation takes 1000 forward passes)."""
    _, url, _ = served
    before = scrape(url).get(TOKENS, 0)
    payload = {"model": NAME, "prompt": "a", "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    # The engine runs in a process of its own: what it holds is what its gauges report.
    held = [f'hpcml_llm_sequences{{model="{NAME}",state="{s}"}}' for s in ("running", "waiting")]
    held.append(f'hpcml_llm_kv_cache_blocks_used{{model="{NAME}"}}')
    deadline = time.monotonic() + 60
    while any(scrape(url)[k] for k in held) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [scrape(url)[k] for k in held] == [0, 0, 0]
    assert scrape(url)[TOKENS] - before < 1000


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_non_streamed_request_whose_client_goes_away_is_cancelled(
    served: tuple[GPT, str, Any], path: str, n: int
) -> None:
    """A raw HTTP/1.1 client sends a non-streamed request for 990 tokens (n = 3: three
    sequences of 990, which the cache runs one at a time) and closes its socket once the engine
    runs it. The server must drop every sequence of the request, running or waiting (main went
    on generating all 990 tokens for nobody: the running gauge stayed 1 and KV blocks grew)."""
    _, url, _ = served
    before = scrape(url).get(TOKENS, 0)
    body = {"model": NAME, "max_tokens": 990, "temperature": 0, "n": n}
    if path == "/v1/completions":
        body["prompt"] = "a"
    else:
        body["messages"] = [{"role": "user", "content": "a"}]
    data = json.dumps(body).encode()
    port = int(url.rsplit(":", 1)[1])
    running = f'hpcml_llm_sequences{{model="{NAME}",state="running"}}'
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        deadline = time.monotonic() + 60
        while scrape(url).get(TOKENS, 0) == before:  # generating, for nobody soon
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    held = [running, f'hpcml_llm_sequences{{model="{NAME}",state="waiting"}}']
    held.append(f'hpcml_llm_kv_cache_blocks_used{{model="{NAME}"}}')
    while any(scrape(url)[k] for k in held) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [scrape(url)[k] for k in held] == [0, 0, 0]
    assert scrape(url)[TOKENS] - before < 990  # not one of its sequences ran to its end


TOKENS = f'hpcml_llm_output_tokens_total{{model="{NAME}"}}'


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("hpcml_llm_") and f'model="{NAME}"' in line:
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def test_metrics_count_generated_tokens(served: tuple[GPT, str, Any]) -> None:
    _, url, _ = served
    before = scrape(url)
    complete(url, prompt="print(", max_tokens=7, temperature=0)
    after = scrape(url)
    tokens = TOKENS
    ttft = f'hpcml_llm_time_to_first_token_seconds_count{{model="{NAME}"}}'
    itl = f'hpcml_llm_inter_token_latency_seconds_count{{model="{NAME}"}}'
    assert after[tokens] - before.get(tokens, 0) == 7
    assert after[ttft] - before.get(ttft, 0) == 1
    assert after[itl] - before.get(itl, 0) == 6
    assert after[f'hpcml_llm_kv_cache_blocks{{model="{NAME}"}}'] == 130
    assert after[f'hpcml_llm_kv_cache_blocks_used{{model="{NAME}"}}'] == 0

    def grew(name: str) -> float:
        key = f'hpcml_llm_{name}{{model="{NAME}"}}'
        return after[key] - before.get(key, 0)

    assert grew("prompt_tokens_total") == 6  # "print(": 6 bytes
    assert grew("request_duration_seconds_count") == 1
    assert grew("queue_time_seconds_count") == 1
    # It arrived, then was admitted, then ended: its queue time is within its latency.
    assert 0 < grew("queue_time_seconds_sum") <= grew("request_duration_seconds_sum")
    # Alone in the engine: one prefill step and 6 decode steps, one sequence each.
    assert grew("batch_size_count") == 7 and grew("batch_size_sum") == 7
    assert grew("prefix_cache_query_tokens_total") == 6
    assert grew("prefix_cache_hit_tokens_total") == 0
    promtool = system_binary("promtool", installer=".ci/install_prometheus.sh")
    text = httpx.get(f"{url}/metrics", timeout=30).text
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    # promtool exits 0 and prints nothing when every metric follows the conventions.
    assert check.returncode == 0 and check.stdout + check.stderr == "", check.stdout + check.stderr


def test_a_shared_prompt_prefix_counts_as_prefix_cache_hits(served: tuple[GPT, str, Any]) -> None:
    """B arrives while A, with the same 24-token prompt, runs: B finds A's two full blocks of 8
    in the prefix cache (its last token is always computed), so 16 of its 24 tokens hit."""
    _, url, _ = served
    before = scrape(url)
    prompt = "the same prompt, 24 b..."
    payload = {"model": NAME, "prompt": prompt, "max_tokens": 900, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=payload | {"stream": True}) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the stream (A would end)
        while not next(lines).startswith("data: {"):
            pass  # A's prompt is computed once its first chunk comes
        assert complete(url, prompt=prompt, max_tokens=2).status_code == 200
    after = scrape(url)
    hits = f'hpcml_llm_prefix_cache_hit_tokens_total{{model="{NAME}"}}'
    queries = f'hpcml_llm_prefix_cache_query_tokens_total{{model="{NAME}"}}'
    assert after[hits] - before.get(hits, 0) == 16
    assert after[queries] - before.get(queries, 0) == 48


def test_oip_still_serves_the_export(served: tuple[GPT, str, Any]) -> None:
    _, url, _ = served
    r = httpx.get(f"{url}/v2/models/{NAME}", timeout=30)
    assert r.status_code == 200 and r.json()["inputs"][0]["datatype"] == "INT64"


def test_hpcml_serve_process_streams_completions(tmp_path: Path) -> None:
    """`hpcml serve EXPORT --config` as a process: the summary names the text model, a streamed
    completion over loopback equals the reference, SIGTERM stops it cleanly."""
    model = make_model()
    export = save_gpt_export(tmp_path / "export", model, ARGS)
    (tmp_path / "serve.yaml").write_text("generation:\n  kv_cache_blocks: 40\n  block_size: 16\n")
    sock = bind_socket("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    sock.close()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hpcml", "serve", str(export), "--name", NAME, "--port", str(port)]
    cmd += ["--config", str(tmp_path / "serve.yaml"), "--json"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(url, timeout_s=120)
        chunks = stream(url, prompt="import sys\n", max_tokens=15, temperature=0)
        assert "".join(c["choices"][0]["text"] for c in chunks) == reference(
            model, "import sys\n", 15
        )
        too_long = complete(url, prompt="y" * 100, max_tokens=600)
        assert too_long.status_code == 400
        assert "exceeds the KV cache (640 tokens)" in too_long.json()["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode in (0, -signal.SIGTERM), err
        assert json.loads(out)["completions"] == [NAME]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
