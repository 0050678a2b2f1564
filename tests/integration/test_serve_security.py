"""TLS, roles and the audit log over a real server on loopback (issue 39, items 1-3).

One server serves an MLP (`digits`) and a tiny GPT (`tiny`) over HTTPS and gRPC with TLS, a
tokens file and an audit log; stock clients (tritonclient over HTTP and gRPC, the openai
client) connect with the test CA and fail without it. A second server asks for client
certificates (mutual TLS). A training rank's `/metrics` endpoint serves HTTPS too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import ssl
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
import yaml
from gpt_export import save_gpt_export
from tests.conftest import run_hpcml
from tls_certs import Pki, make_pki
from tritonclient.utils import InferenceServerException

from hpcml.config_sections import TlsConfig
from hpcml.models.export import save_export
from hpcml.models.gpt import GPT, GPTConfig
from hpcml.models.zoo import build_model
from hpcml.observe.train_metrics import TrainExporter
from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

MLP = {"hidden": 16, "depth": 1}
GPT_ARGS = {"vocab_size": 256, "max_seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 16,
            "tie_embeddings": False}  # fmt: skip
# Fixed texts (their hashes go into the tokens file): what a caller would present.
TOKENS = {
    "ops": "tok-ops-7f3a9c1e55d2",
    "app": "tok-app-0b8e2d4471ac",
    "dash": "tok-dash-93c1aa50e6f4",
    "digits-only": "tok-scoped-5d7e19b2c3f0",
    "throttled": "tok-slow-a4c28e7d1b69",
}
ROLES = {"ops": ["admin"], "app": ["infer"], "dash": ["read"], "digits-only": ["infer"],
         "throttled": ["infer"]}  # fmt: skip
# float32 sums in another order than torch's: well inside 1e-5 relative.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


def write_tokens(path: Path) -> Path:
    entries = []
    for name, token in TOKENS.items():
        entry = {"name": name, "sha256": hashlib.sha256(token.encode()).hexdigest(),
                 "roles": ROLES[name]}  # fmt: skip
        if name == "digits-only":
            entry["models"] = ["digits"]
        if name == "throttled":  # refills one request a 100 s: the third of a test is refused
            entry["rate_limit"] = {"requests_per_s": 0.01, "burst": 2}
        entries.append(entry)
    path.write_text(yaml.safe_dump({"tokens": entries}))
    return path


@dataclass
class Secured:
    url: str
    grpc: str
    pki: Pki
    audit: Path
    mlp: torch.nn.Module

    def expected(self, x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.mlp(torch.from_numpy(x)).numpy()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Secured]:
    work = tmp_path_factory.mktemp("secured")
    torch.manual_seed(0)
    mlp = build_model("mlp", MLP).eval()
    for version in ("1", "2"):  # the same weights: any version answers as `expected` says
        save_export(work / "repo" / "digits" / version, mlp, "mlp", MLP, (3, 32, 32), (10,))
    torch.manual_seed(1)
    save_gpt_export(work / "repo" / "tiny" / "1", GPT(GPTConfig(**GPT_ARGS)).eval(), GPT_ARGS)
    cfg = ServeConfig.model_validate({
        "grpc_port": 0,
        "tls": {"cert": str(pki.server_cert), "key": str(pki.server_key)},
        "tokens_file": str(write_tokens(work / "tokens.yaml")),
        "audit_log": str(work / "audit.jsonl"),
        "defaults": {"isolation": "thread", "max_batch_size": 8},
    })  # fmt: skip
    app = build_app(work / "repo", cfg)
    with running_server(app) as url:
        yield Secured(url, f"127.0.0.1:{app.state.grpc_port}", pki, work / "audit.jsonl", mlp)


def trusting(pki: Pki, with_client_cert: bool = False) -> ssl.SSLContext:
    """A client context that trusts the test CA (and presents the client certificate)."""
    context = ssl.create_default_context(cafile=str(pki.ca))
    if with_client_cert:
        context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return context


def x_of(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 3, 32, 32)).astype(np.float32)


def triton_http(s: Secured, **ssl_options: str) -> thttp.InferenceServerClient:
    return thttp.InferenceServerClient(
        s.url.removeprefix("https://"), ssl=True, ssl_options=ssl_options
    )


def http_infer(client: thttp.InferenceServerClient, x: np.ndarray, token: str) -> np.ndarray:
    inp = thttp.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    headers = {"Authorization": f"Bearer {TOKENS[token]}"}
    return client.infer("digits", [inp], headers=headers).as_numpy("logits")


def grpc_infer(client: tgrpc.InferenceServerClient, x: np.ndarray, token: str | None) -> np.ndarray:
    inp = tgrpc.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    headers = {"authorization": f"Bearer {TOKENS[token]}"} if token else None
    return client.infer("digits", [inp], headers=headers).as_numpy("logits")


def test_tls_clients_with_the_ca_connect_and_without_it_fail(secured: Secured) -> None:
    s, x = secured, x_of(0)
    ca = str(s.pki.ca)
    trusting_http = triton_http(s, ca_certs=ca)
    np.testing.assert_allclose(http_infer(trusting_http, x, "app"), s.expected(x), **TOL)
    trusting_http.close()  # a kept-alive connection would hold the server's shutdown
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):  # the system's CAs only
        http_infer(triton_http(s), x, "app")

    client = tgrpc.InferenceServerClient(s.grpc, ssl=True, root_certificates=ca)
    np.testing.assert_allclose(grpc_infer(client, x, "app"), s.expected(x), **TOL)
    for refused in (tgrpc.InferenceServerClient(s.grpc, ssl=True),  # the system's CAs only
                    tgrpc.InferenceServerClient(s.grpc)):  # plain text  # fmt: skip
        with pytest.raises(InferenceServerException, match="UNAVAILABLE"):
            grpc_infer(refused, x, "app")
        refused.close()  # no reconnecting in the background

    # The openai client sends its api_key as the bearer token.
    with httpx.Client(verify=trusting(s.pki)) as transport:
        llm = openai.OpenAI(base_url=f"{s.url}/v1", api_key=TOKENS["app"], max_retries=0,
                            http_client=transport)  # fmt: skip
        done = llm.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=0)
        assert done.usage is not None and done.usage.completion_tokens == 3
        stranger = llm.with_options(api_key="tok-nobody-knows-this-2")
        with pytest.raises(openai.AuthenticationError, match="sent an unknown token"):
            stranger.completions.create(model="tiny", prompt="ab", max_tokens=3)
    with httpx.Client() as transport:
        llm = openai.OpenAI(base_url=f"{s.url}/v1", api_key=TOKENS["app"], max_retries=0,
                            http_client=transport)  # fmt: skip
        with pytest.raises(openai.APIConnectionError):
            llm.completions.create(model="tiny", prompt="ab", max_tokens=3)


def test_roles_scopes_and_rate_limits_over_http_never_log_a_token(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    s = secured
    body = {"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                        "data": x_of(1)[:1].ravel().tolist()}]}  # fmt: skip
    infer = "/v2/models/digits/infer"
    answers = []
    with httpx.Client(base_url=s.url, verify=trusting(s.pki)) as c:

        def call(method: str, path: str, who: str | None, **kw: object) -> httpx.Response:
            headers = bearer(who) if who in TOKENS else {}
            if who == "stranger":
                headers = {"Authorization": "Bearer tok-nobody-knows-this-1"}
            r = c.request(method, path, headers=headers, **kw)  # type: ignore[arg-type]
            answers.append(r.text)
            return r

        assert call("GET", "/v2/health/ready", None).status_code == 200  # probes stay open
        r = call("POST", infer, None, json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"] == (
            f"POST {infer} needs 'Authorization: Bearer <token>' with a token the server "
            "knows, and this request sent no token."
        )
        r = call("POST", infer, "stranger", json=body)
        assert r.status_code == 401 and "sent an unknown token" in r.json()["error"]
        assert call("POST", infer, "app", json=body).status_code == 200
        assert call("GET", "/v2/models/digits", "app").status_code == 200  # metadata: infer ok
        r = call("POST", infer, "dash", json=body)
        assert r.status_code == 403 and r.json()["error"] == (
            f"token 'dash' (roles ['read']) may not POST {infer}: it needs the infer role."
        )
        assert call("GET", "/metrics", "dash").status_code == 200
        assert call("GET", "/metrics", "app").status_code == 403
        r = call("POST", "/admin/models/digits/traffic", "app", json={"weights": {"1": 1}})
        assert r.status_code == 403 and "needs the admin role" in r.json()["error"]

        assert call("POST", infer, "digits-only", json=body).status_code == 200
        r = call("GET", "/v2/models/tiny", "digits-only")
        assert r.status_code == 403 and "limited to models ['digits']" in r.json()["error"]
        r = call("POST", "/v1/completions", "digits-only",
                 json={"model": "tiny", "prompt": "a", "max_tokens": 1})  # fmt: skip
        assert r.status_code == 403 and "with model 'tiny'" in r.json()["error"]["message"]
        assert call("GET", "/metrics", "digits-only").status_code == 403  # every model at once

        assert [call("POST", infer, "throttled", json=body).status_code for _ in range(2)] == [
            200, 200,
        ]  # fmt: skip
        r = call("POST", infer, "throttled", json=body)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "over its rate limit of 0.01 requests/s" in r.json()["error"]
        metrics = call("GET", "/metrics", "ops").text
    refused = 'hpcml_requests_total{code="401",model="digits",protocol="http",version=""} 2.0'
    assert refused in metrics
    seen = caplog.text + "".join(answers)
    for token in [*TOKENS.values(), "tok-nobody-knows-this-1"]:
        assert token not in seen


def test_roles_over_grpc(secured: Secured) -> None:
    s, x = secured, x_of(2)
    client = tgrpc.InferenceServerClient(s.grpc, ssl=True, root_certificates=str(s.pki.ca))
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED") as no_token:
        grpc_infer(client, x, None)
    assert "call ModelInfer needs 'Authorization: Bearer <token>'" in str(no_token.value)
    with pytest.raises(InferenceServerException, match="PERMISSION_DENIED.*needs the infer role"):
        grpc_infer(client, x, "dash")
    np.testing.assert_allclose(grpc_infer(client, x, "digits-only"), s.expected(x), **TOL)
    scoped = {"authorization": f"Bearer {TOKENS['digits-only']}"}
    with pytest.raises(InferenceServerException, match="PERMISSION_DENIED.*limited to models"):
        client.get_model_metadata("tiny", headers=scoped)
    with pytest.raises(InferenceServerException, match="PERMISSION_DENIED.*needs the read role"):
        client.get_inference_statistics("digits", headers=scoped)  # Triton's extension: read
    assert client.is_server_live()  # probes stay open
    with httpx.Client(verify=trusting(s.pki), headers=bearer("dash")) as c:
        metrics = c.get(f"{s.url}/metrics").text
    for code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):  # refused inference is counted
        assert f'{{code="{code}",model="digits",protocol="grpc",version=""}} 1.0' in metrics


def test_admin_changes_are_audited_under_the_token_name(secured: Secured, tmp_path: Path) -> None:
    s = secured
    with httpx.Client(base_url=s.url, verify=trusting(s.pki), headers=bearer("ops")) as c:
        r = c.post("/admin/models/digits/traffic",
                   json={"weights": {"1": 1}, "reason": "pin version 1 for the audit"})  # fmt: skip
        assert r.status_code == 200
        assert c.post("/admin/models/digits/rollback").status_code == 200
        refused = c.post("/admin/models/digits/promote", json={"version": "9"})
        assert refused.status_code == 400  # a change that did not happen is not recorded
    records = [json.loads(line) for line in s.audit.read_text().splitlines()]
    assert [(r["seq"], r["actor"], r["action"], r["target"], r["reason"]) for r in records] == [
        (1, "ops", "traffic", "digits", "pin version 1 for the audit"),
        (2, "ops", "rollback", "digits", ""),
    ]
    assert records[0]["details"]["weights"] == {"1": 1.0}
    assert records[1]["prev"] == records[0]["hash"]
    ok = run_hpcml("audit", "verify", str(s.audit))
    assert "2 records, chain intact" in ok.stdout
    edited = tmp_path / "edited.jsonl"
    edited.write_text(s.audit.read_text().replace('"actor":"ops"', '"actor":"eve"', 1))
    broken = run_hpcml("audit", "verify", str(edited), check=False)
    assert broken.returncode == 1
    assert f"line 1 of {edited} breaks the chain: its content does not match" in broken.stdout


def test_mutual_tls_refuses_clients_without_a_certificate(tmp_path: Path, pki: Pki) -> None:
    torch.manual_seed(0)
    mlp = build_model("mlp", MLP).eval()
    export = save_export(tmp_path / "export", mlp, "mlp", MLP, (3, 32, 32), (10,))
    tls = {"cert": str(pki.server_cert), "key": str(pki.server_key), "client_ca": str(pki.ca)}
    cfg = ServeConfig.model_validate({"grpc_port": 0, "tls": tls,
                                      "defaults": {"isolation": "thread"}})  # fmt: skip
    app = build_app(export, cfg, name="digits")
    x = x_of(3)
    with running_server(app) as url:
        s = Secured(url, f"127.0.0.1:{app.state.grpc_port}", pki, tmp_path / "none", mlp)
        with httpx.Client(verify=trusting(pki)) as c, pytest.raises(httpx.TransportError):
            c.get(f"{url}/v2/health/ready")
        with httpx.Client(verify=trusting(pki, with_client_cert=True)) as c:
            assert c.get(f"{url}/v2/health/ready").status_code == 200
        client = triton_http(s, ca_certs=str(pki.ca), certfile=str(pki.client_cert),
                             keyfile=str(pki.client_key))  # fmt: skip
        np.testing.assert_allclose(http_infer(client, x, "app"), s.expected(x), **TOL)
        client.close()  # a kept-alive connection would hold the server's shutdown 30 s
        anonymous = tgrpc.InferenceServerClient(s.grpc, ssl=True, root_certificates=str(pki.ca))
        with pytest.raises(InferenceServerException, match="UNAVAILABLE"):
            grpc_infer(anonymous, x, None)
        anonymous.close()  # no reconnecting in the background
        known = tgrpc.InferenceServerClient(
            s.grpc, ssl=True, root_certificates=str(pki.ca), private_key=str(pki.client_key),
            certificate_chain=str(pki.client_cert),
        )  # fmt: skip
        np.testing.assert_allclose(grpc_infer(known, x, None), s.expected(x), **TOL)


def test_training_metrics_endpoint_speaks_tls(tmp_path: Path, pki: Pki) -> None:
    tls = TlsConfig(cert=str(pki.server_cert), key=str(pki.server_key), client_ca=str(pki.ca))
    exporter = TrainExporter(0, "127.0.0.1", tmp_path / "run", 0, 0, tls=tls)
    try:
        url = f"https://127.0.0.1:{exporter.port}{exporter.metrics_path}"
        with httpx.Client(verify=trusting(pki, with_client_cert=True)) as c:
            scrape = c.get(url)
        assert scrape.status_code == 200 and "hpcml_train_step_seconds" in scrape.text
        with httpx.Client(verify=trusting(pki)) as c, pytest.raises(httpx.TransportError):
            c.get(url)  # no client certificate
        with pytest.raises(httpx.TransportError):
            httpx.get(url.replace("https:", "http:"))  # plain HTTP
        target = json.loads(exporter.target_file.read_text())[0]
        assert target["labels"]["__scheme__"] == "https"
        assert target["targets"] == [f"127.0.0.1:{exporter.port}"]
    finally:
        exporter.close()


def test_tls_and_tokens_mistakes_are_one_sentence(
    tmp_path: Path, pki: Pki, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpcml.cli.app import main

    (tmp_path / "tokens.yaml").write_text("tokens:\n  - {name: a, sha256: abc, roles: [infer]}\n")
    cases = [
        (["--tls-cert", str(pki.server_cert)], "TLS needs both --tls-cert and --tls-key"),
        (["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.server_key)],
         "cannot be used together"),
        (["--tls-cert", str(tmp_path / "no.pem"), "--tls-key", str(pki.server_key)],
         "is not a file"),
        (["--tokens", str(tmp_path / "tokens.yaml")], "tokens.0.sha256 is not allowed"),
    ]  # fmt: skip
    for args, sentence in cases:  # in this process: the CLI's own exit-code handling
        monkeypatch.setattr(sys, "argv", ["hpcml", "serve", str(tmp_path / "model"), *args])
        with pytest.raises(SystemExit) as end:
            main()
        err = capsys.readouterr().err
        assert end.value.code == 2, err
        assert sentence in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
