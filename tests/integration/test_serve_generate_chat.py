"""`/v1/chat/completions` with the official `openai` client, and the OIP generate extension
(`/v2/models/{name}/generate`, `/generate_stream`) with httpx, against `hpcml serve` on
loopback. Greedy answers equal the one-request full-recompute reference for the prompt the
documented chat template renders (not merely some text), streamed or not; bad requests are
400 in each API's error form, unknown models 404."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from gpt_export import save_gpt_export
from tests.unit.generate_util import served_reference, widen

from hpcml.models.gpt import GPT, GPTConfig
from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

ARGS = {"vocab_size": 256, "max_seq_len": 128, "n_layer": 1, "n_head": 2, "d_model": 32,
        "tie_embeddings": False}
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "def main():"},
]
RENDERED = "<|system|>\nYou write Python.\n<|user|>\ndef main():\n<|assistant|>\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, GPT]]:
    torch.manual_seed(1)
    model = GPT(GPTConfig(**ARGS)).eval()
    widen(model)  # a random model whose greedy outputs depend on the context
    export = save_gpt_export(tmp_path_factory.mktemp("chat") / "export", model, ARGS)
    cfg = ServeConfig.model_validate({"defaults": {"isolation": "thread"}})
    with running_server(build_app(export, cfg, name="tiny")) as url:
        yield url, model


def test_openai_chat_client_answers_and_streams_the_template_reference(
    served: tuple[str, GPT],
) -> None:
    url, model = served
    expected = served_reference(model, RENDERED, 20)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    done = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=20, temperature=0  # type: ignore[arg-type]
    )
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 20
    assert done.usage.prompt_tokens == len(RENDERED.encode())
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, stream=True  # type: ignore[arg-type]
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "length"


def test_chat_refuses_what_it_does_not_do(served: tuple[str, GPT]) -> None:
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for kwargs, words in (
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
        ({"messages": []}, "messages"),
        ({"messages": MESSAGES, "logit_bias": {"1": 1.0}}, "'logit_bias' = .* is not supported"),
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "'tools'"),
    ):
        with pytest.raises(openai.BadRequestError, match=words):
            client.chat.completions.create(model="tiny", **kwargs)  # type: ignore[call-overload]
    with pytest.raises(openai.NotFoundError, match="does not generate text"):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)  # type: ignore[arg-type]


def test_chat_without_max_tokens_runs_to_the_context_and_reports_logprobs_n_and_usage(
    served: tuple[str, GPT],
) -> None:
    url, model = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    # A 119-byte rendered prompt leaves 9 tokens of the 128-token context (fewer than the 16 a
    # default would give, so a default of 16 is refused instead).
    long = [{"role": "user", "content": "x" * 95}]
    done = client.chat.completions.create(model="tiny", messages=long, temperature=0)  # type: ignore[arg-type]
    assert done.usage is not None and done.usage.prompt_tokens == 119
    assert done.usage.completion_tokens == 128 - 119
    assert done.choices[0].finish_reason == "length"
    two = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, n=2,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=2,
    )
    expected = served_reference(model, RENDERED, 20)
    assert [c.message.content for c in two.choices] == [expected, expected]
    lps = two.choices[1].logprobs
    assert lps is not None and lps.content is not None and len(lps.content) == 20
    ids = [(item.bytes or [-1])[0] for item in lps.content]  # byte tokens: one byte each
    assert bytes(ids).decode("utf-8", errors="replace") == expected
    tokens = list(RENDERED.encode()) + ids
    with torch.inference_mode():
        full = torch.log_softmax(model(torch.tensor([tokens]))[0], dim=-1)
    for i, item in enumerate(lps.content):
        row = full[len(RENDERED.encode()) - 1 + i]
        # Float32 model served batched and paged: ~1e-6 from one full pass.
        assert abs(item.logprob - float(row.max())) < 1e-4 and ids[i] == int(row.argmax())
        assert item.top_logprobs[0].logprob == item.logprob and len(item.top_logprobs) == 2
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    ))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_oip_generate_and_generate_stream(served: tuple[str, GPT]) -> None:
    url, model = served
    prompt = "import os\n"
    expected = served_reference(model, prompt, 16)
    body = {"text_input": prompt, "parameters": {"max_tokens": 16, "temperature": 0}}
    r = httpx.post(f"{url}/v2/models/tiny/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["model_name"] == "tiny" and answer["model_version"] == "1"
    assert answer["text_output"] == expected
    assert answer["details"] == {"finish_reason": "length", "output_tokens": 16}
    events = []
    with httpx.stream("POST", f"{url}/v2/models/tiny/generate_stream", json=body, timeout=30) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert len(events) > 3
    assert "".join(e["text_output"] for e in events) == expected
    assert events[-1]["details"] == {"finish_reason": "length"}
    bad = httpx.post(f"{url}/v2/models/tiny/generate", json={"text": prompt}, timeout=30)
    assert bad.status_code == 400 and "text_input" in bad.json()["error"]
    bad = httpx.post(f"{url}/v2/models/tiny/generate", content=b"{", timeout=30)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]
    huge = {"text_input": prompt, "parameters": {"max_tokens": 10_000}}
    bad = httpx.post(f"{url}/v2/models/tiny/generate", json=huge, timeout=30)
    assert bad.status_code == 400 and "context" in bad.json()["error"]
    missing = httpx.post(f"{url}/v2/models/nope/generate_stream", json=body, timeout=30)
    assert missing.status_code == 404 and "does not generate text" in missing.json()["error"]
