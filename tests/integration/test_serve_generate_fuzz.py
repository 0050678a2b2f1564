"""Property-based fuzzing of the text endpoints (`/v1/completions`, `/v1/chat/completions`,
OIP `generate` and `generate_stream`) over a real server on loopback.

Hypothesis builds requests that are nearly right (a valid body with one or a few fields
replaced by hostile values: wrong types, out-of-range numbers, huge and empty strings, lone
UTF-16 surrogates escaped in the JSON, unknown fields, lists where strings go) and some that
are arbitrary JSON or not JSON at all. Whatever arrives, the server must answer below 500, in
its error form (OpenAI's `{"error": {"message"}}` for /v1, OIP's `{"error": "..."}`), without
traceback text; a 200 must be a well-formed answer (a stream: `data:` events ending with
`[DONE]`). `derandomize=True` makes the cases the same on every run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from gpt_export import save_gpt_export
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve_fuzz import json_values

from hpcml.models.gpt import GPT, GPTConfig
from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

ARGS = {"vocab_size": 256, "max_seq_len": 64, "n_layer": 1, "n_head": 2, "d_model": 16}
NAME = "poet"

# Strings a JSON body can carry that Python cannot encode to UTF-8 (lone surrogates), very
# long ones, empty ones, control characters, and multi-byte characters split by stops.
LONE = "\ud800"
hostile_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", LONE, "a" + LONE, "\x00", "日本語🙂", "x" * 5000, "\n\n", " "]),
)
hostile_numbers = st.sampled_from(
    [-1, 0, 1, 2, 3, 63, 64, 65, 2**31, 2**63, 2**64, 2**64 - 1, -(2**63), 1.5, 1e308, -0.0,
     2.0000001, True, False, "3", None]
)  # fmt: skip
fields = {
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                        "stream", "n", "logprobs", "echo", "user", "model", "stream_options",
                        "logit_bias", "suffix", "best_of", "unknown"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "temperature",
                             "top_p", "top_k", "seed", "stop", "stream", "n", "model", "tools",
                             "response_format", "unknown"],
    f"/v2/models/{NAME}/generate": ["text_input", "parameters", "unknown"],
    f"/v2/models/{NAME}/generate_stream": ["text_input", "parameters", "unknown"],
}  # fmt: skip


def valid(path: str) -> dict[str, Any]:
    if path == "/v1/completions":
        return {"model": NAME, "prompt": "def f(", "max_tokens": 3, "temperature": 0}
    if path == "/v1/chat/completions":
        messages = [{"role": "user", "content": "hi"}]
        return {"model": NAME, "messages": messages, "max_tokens": 3, "temperature": 0}
    return {"text_input": "def f(", "parameters": {"max_tokens": 3, "temperature": 0}}


@st.composite
def values_for(draw: st.DrawFn, name: str) -> Any:
    if name in ("prompt", "text_input", "user", "model", "suffix"):
        return draw(hostile_text | json_values | st.lists(hostile_text, max_size=3))
    if name == "stop":
        return draw(hostile_text | st.lists(hostile_text, max_size=6) | json_values)
    if name == "messages":
        message = st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", ""])},
            optional={"content": hostile_text | json_values, "name": hostile_text},
        )
        return draw(st.lists(message, max_size=3) | json_values)
    if name == "parameters":
        keys = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "unknown"]
        return draw(
            st.dictionaries(st.sampled_from(keys), hostile_numbers | hostile_text, max_size=4)
            | json_values
        )
    return draw(hostile_numbers | json_values)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(fields)))
    kind = draw(st.sampled_from(["nearly", "nearly", "nearly", "json", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=40) | st.sampled_from([b"", b"{", b"[]", b"null"]))
    if kind == "json":
        return path, json.dumps(draw(json_values)).encode()
    body = valid(path)
    for name in draw(st.lists(st.sampled_from(fields[path]), min_size=1, max_size=3)):
        if draw(st.booleans()) and name in body:
            del body[name]
        else:
            body[name] = draw(values_for(name))
    # ensure_ascii keeps lone surrogates as \\ud800 escapes, as a hostile client would send.
    return path, json.dumps(body, ensure_ascii=True).encode()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**ARGS)).eval()
    export = save_gpt_export(tmp_path_factory.mktemp("fuzz") / "export", model, ARGS)
    cfg = ServeConfig.model_validate(
        {"defaults": {"isolation": "thread"}, "generation": {"kv_cache_blocks": 16}}
    )
    with (
        running_server(build_app(export, cfg, name=NAME)) as url,
        httpx.Client(base_url=url, timeout=60) as c,
    ):
        yield c


def _check(path: str, response: httpx.Response) -> None:
    assert response.status_code < 500, (path, response.status_code, response.text[:300])
    assert "Traceback" not in response.text
    if response.status_code != 200:
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        message = error if path.startswith("/v2") else error["message"]
        assert isinstance(message, str) and message
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [ln for ln in response.text.splitlines() if ln.startswith("data:")]
        assert (
            events
            and events[-1] in ("data: [DONE]", "data:[DONE]")
            or path.endswith("generate_stream")
        ), response.text[-300:]
        for ev in events:
            if "[DONE]" not in ev:
                assert "error" not in json.loads(ev[5:]), ev
        return
    body = response.json()
    assert ("choices" in body) if path.startswith("/v1") else ("text_output" in body), body


def test_no_text_request_makes_the_server_fail(client: httpx.Client) -> None:
    statuses: dict[str, set[int]] = {path: set() for path in fields}

    # 600 cases, each answered in milliseconds (at most 3 tokens of a 1-layer model).
    @settings(
        max_examples=600,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(case=requests())
    def case_is_answered_below_500(case: tuple[str, bytes]) -> None:
        path, body = case
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        _check(path, response)
        statuses[path].add(response.status_code)

    case_is_answered_below_500()
    # Not vacuous: every endpoint refused some cases; valid bodies are answered with 200.
    for path in fields:
        assert 400 in statuses[path] or 422 in statuses[path], (path, statuses[path])
        response = client.post(path, json=valid(path))
        _check(path, response)
        assert response.status_code == 200, (path, response.text)


@pytest.mark.parametrize("path", sorted(fields))
def test_a_lone_surrogate_is_one_sentence_not_a_500(client: httpx.Client, path: str) -> None:
    """Found by the fuzzing above: `\\ud800` is valid JSON but cannot be UTF-8, and reached
    the tokenizer (500, and a reset stream)."""
    body = valid(path)
    key = "messages" if "chat" in path else "text_input" if path.startswith("/v2") else "prompt"
    body[key] = [{"role": "user", "content": "a" + LONE}] if key == "messages" else "a" + LONE
    response = client.post(
        path,
        content=json.dumps(body, ensure_ascii=True).encode(),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert "not valid Unicode" in (error if path.startswith("/v2") else error["message"])
