"""The official `openai` Python client against `hpcml serve`'s `/v1/completions` on loopback."""

from __future__ import annotations

from collections.abc import Iterator

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
    with pytest.raises(openai.BadRequestError, match="'n' = 3 is not supported"):
        c.completions.create(model="tiny", prompt="x", n=3)
    with pytest.raises(openai.NotFoundError, match="does not generate text"):
        c.completions.create(model="gpt-4", prompt="x")
