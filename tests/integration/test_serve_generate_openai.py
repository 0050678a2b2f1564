"""The official `openai` Python client against `hpcml serve`'s `/v1/completions` and
`/v1/models` on loopback, and lm-eval-harness's `local-completions` request shapes (its
loglikelihood requests and its parsing of the answer) with httpx, as that tool sends them."""

from __future__ import annotations

from collections.abc import Iterator
from operator import itemgetter
from typing import Any

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

ARGS = {
    "vocab_size": 256,
    "max_seq_len": 128,
    "n_layer": 1,
    "n_head": 2,
    "d_model": 32,
    "tie_embeddings": False,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, GPT]]:
    torch.manual_seed(1)
    model = GPT(GPTConfig(**ARGS)).eval()
    widen(model)  # a random model whose greedy outputs depend on the context
    export = save_gpt_export(tmp_path_factory.mktemp("run") / "export", model, ARGS)
    cfg = ServeConfig.model_validate({"defaults": {"isolation": "thread"}})
    with running_server(build_app(export, cfg, name="tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), model


def test_openai_client_completes_and_streams(client: tuple[openai.OpenAI, GPT]) -> None:
    c, model = client
    expected = served_reference(model, "def main():", 25)
    done = c.completions.create(model="tiny", prompt="def main():", max_tokens=25, temperature=0)
    assert done.choices[0].text == expected
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 25
    pieces = list(
        c.completions.create(
            model="tiny", prompt="def main():", max_tokens=25, temperature=0, stream=True
        )
    )
    assert len(pieces) > 3
    assert "".join(p.choices[0].text for p in pieces) == expected
    assert pieces[-1].choices[0].finish_reason == "length"


def test_openai_client_sees_bad_requests_as_its_own_errors(
    client: tuple[openai.OpenAI, GPT],
) -> None:
    c, _ = client
    with pytest.raises(openai.BadRequestError, match="'logit_bias' = .* is not supported"):
        c.completions.create(model="tiny", prompt="x", logit_bias={"1": 2.0})
    with pytest.raises(openai.NotFoundError, match="does not generate text"):
        c.completions.create(model="gpt-4", prompt="x")


def full_logprobs(model: GPT, tokens: list[int]) -> torch.Tensor:
    """log_softmax of one full forward pass (float32): row p predicts token p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens]))[0], dim=-1)


TOL = 1e-4
"""Float32 model, served batched and paged: logits differ from one full pass by ~1e-6."""


def lm_eval_parse(out: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval-harness's LocalCompletionsAPI.parse_logprobs, as it reads the answer."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens, strict=True):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(tok == max(top.values()) for tok, top in zip(lps, tops, strict=True))
        res.append((sum(lps), greedy))
    return res


def test_lm_eval_loglikelihood_requests_get_the_model_logprobs(
    client: tuple[openai.OpenAI, GPT],
) -> None:
    c, model = client
    contexts, continuations = ["def main():", "x = 1"], [" return 0", "\ny"]
    ids = [list((a + b).encode()) for a, b in zip(contexts, continuations, strict=True)]
    # The payload of lm-eval's LocalCompletionsAPI._create_payload(generate=False), prompts as
    # token ids (tokenized_requests=True) and as strings.
    for prompt in (ids, [a + b for a, b in zip(contexts, continuations, strict=True)]):
        body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 1,
                "logprobs": 1, "seed": 1234, "echo": True}
        r = httpx.post(f"{c.base_url}completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = lm_eval_parse(r.json(), [len(x.encode()) for x in contexts])
        for (total, greedy), tokens, ctx in zip(got, ids, contexts, strict=True):
            full = full_logprobs(model, tokens)
            rows = full[len(ctx.encode()) - 1 : -1]
            want = float(rows[torch.arange(len(rows)), torch.tensor(tokens[len(ctx.encode()):])].sum())
            assert abs(total - want) < TOL * len(rows)
            assert greedy == bool((rows.argmax(-1) == torch.tensor(tokens[len(ctx.encode()):])).all())
        choice = r.json()["choices"][0]
        assert choice["text"].startswith(contexts[0] + continuations[0])  # echo
        assert choice["logprobs"]["token_logprobs"][0] is None  # nothing predicts token 0
        assert len(choice["logprobs"]["tokens"]) == len(ids[0]) + 1
    # max_tokens 0 (older lm-eval, and OpenAI's own) scores the prompt only.
    done = c.completions.create(model="tiny", prompt=ids[0], max_tokens=0, echo=True, logprobs=0)
    assert done.choices[0].text == contexts[0] + continuations[0]
    assert done.usage is not None and done.usage.completion_tokens == 0
    lps = done.choices[0].logprobs
    assert lps is not None and lps.token_logprobs is not None
    assert len(lps.token_logprobs) == len(ids[0])
    # A prompt as long as the context (128) cannot be scored: the refusal names what was sent
    # (max_tokens 0), not the one token the engine computes past it.
    full = list(range(32, 32 + ARGS["max_seq_len"]))
    with pytest.raises(openai.BadRequestError, match=r"fills the model's context of 128 .*"
                       r"max_tokens 0.* shorten it by 1 token") as refused:  # fmt: skip
        c.completions.create(model="tiny", prompt=full, max_tokens=0, echo=True, logprobs=0)
    assert "max_tokens (1)" not in str(refused.value)
    ok = c.completions.create(model="tiny", prompt=full[:-1], max_tokens=0, echo=True, logprobs=0)
    assert ok.choices[0].logprobs is not None and len(ok.choices[0].logprobs.tokens or []) == 127


def test_models_stream_usage_n_and_max_tokens_null(client: tuple[openai.OpenAI, GPT]) -> None:
    c, model = client
    assert [m.id for m in c.models.list()] == ["tiny"]
    chunks = list(c.completions.create(
        model="tiny", prompt="def main():", max_tokens=25, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 25
    assert chunks[-1].usage.prompt_tokens == len("def main():") and not chunks[-1].choices
    # n: seeded samples differ from each other, each is reproducible, greedy ones all equal.
    kw: dict[str, Any] = {"model": "tiny", "prompt": "def", "max_tokens": 12, "seed": 7}
    three = c.completions.create(**kw, n=3)
    texts = [ch.text for ch in sorted(three.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) == 3 and texts[0] == c.completions.create(**kw).choices[0].text
    assert three.usage is not None and three.usage.completion_tokens == 36
    greedy = c.completions.create(model="tiny", prompt="def main():", max_tokens=25,
                                  temperature=0, n=2)
    assert [ch.text for ch in greedy.choices] == [served_reference(model, "def main():", 25)] * 2
    # max_tokens null: until the context (128 tokens) is full; a 120-token prompt keeps it short.
    done = c.completions.create(model="tiny", prompt="x" * 120, max_tokens=None, temperature=0)  # type: ignore[arg-type]
    assert done.usage is not None and done.usage.completion_tokens == 128 - 120
    assert done.choices[0].finish_reason == "length"


def test_penalties_reach_the_engine(client: tuple[openai.OpenAI, GPT]) -> None:
    """Greedy with a presence penalty equals a full-recompute loop that subtracts it from the
    logits of the bytes already generated (and differs from plain greedy)."""
    c, model = client
    prompt, out = list(b"def main():"), []
    with torch.inference_mode():
        for _ in range(25):
            logits = model(torch.tensor([prompt + out]))[0, -1].clone()
            logits[sorted(set(out))] -= 2.0
            top2 = torch.topk(logits, 2).values
            assert float(top2[0] - top2[1]) > 1e-3, "near-tie in the reference"
            out.append(int(torch.argmax(logits)))
    want = bytes(out).decode("utf-8", errors="replace")
    assert want != served_reference(model, "def main():", 25)
    done = c.completions.create(
        model="tiny", prompt="def main():", max_tokens=25, temperature=0, presence_penalty=2.0
    )
    assert done.choices[0].text == want
