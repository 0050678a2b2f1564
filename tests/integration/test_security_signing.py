"""Signed exports (OpenSSF model-signing): `hpcml export sign`, `hpcml export verify` and
`hpcml serve --require-signature --verify-key`.

A signed export serves and answers a real client on loopback; the same export with one byte
of its weights changed, with a file added after signing, unsigned, or checked with another
signer's key is refused at load in one sentence with exit code 2. An alias follower's new
version that fails its check is not added beside the served one (the old version keeps
serving; test_serve_follow.py shows that a refused version leaves traffic alone).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from tests.conftest import run_hpcml

from hpcml.errors import HpcmlError, ModelError
from hpcml.models.export import save_export
from hpcml.models.signing import SIGNATURE
from hpcml.models.zoo import build_model
from hpcml.serve.codec.oip import decode_output, encode_request
from hpcml.serve.config import ServeConfig
from hpcml.serve.metrics import ServeMetrics
from hpcml.serve.protocol.app import build_app
from hpcml.serve.runtime.repository import ModelSource
from hpcml.serve.testing import running_server
from hpcml.serve.traffic.follow import add_version
from hpcml.serve.traffic.router import Router

ARGS = {"hidden": 16, "depth": 1}


def _keypair(folder: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / f"{name}.pem", folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def _refused(path: Path, public: Path) -> str:
    proc = run_hpcml(
        "serve", str(path), "--require-signature", "--verify-key", str(public), "--port", "0",
        check=False,
    )  # fmt: skip
    message = proc.stderr.strip()
    assert proc.returncode == 2, message
    assert len(message.splitlines()) == 1, message
    return message


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path, Path, Path]:
    root = tmp_path_factory.mktemp("signed")
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    export = save_export(root / "export", model, "mlp", ARGS, (3, 32, 32), (10,))
    private, public = _keypair(root, "signer")
    run_hpcml("export", "sign", str(export), "--key", str(private))
    assert (export / SIGNATURE).is_file()
    assert "signature verified" in run_hpcml("export", "verify", str(export), "--key", str(public)).stdout
    return model, export, public, root


def test_a_signed_export_serves_and_a_changed_one_is_refused(
    signed: tuple[torch.nn.Module, Path, Path, Path], tmp_path: Path
) -> None:
    model, export, public, root = signed
    cfg = ServeConfig(require_signature=True, verify_key=str(public))
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with running_server(build_app(export, cfg, name="digits")) as url:
        r = httpx.post(f"{url}/v2/models/digits/infer", json=encode_request(x), timeout=60)
    assert r.status_code == 200, r.text
    with torch.inference_mode():
        expected = model(torch.from_numpy(x)).numpy()
    # fp32 sums in another order (as test_serve_http): well under the > .1 of other weights.
    np.testing.assert_allclose(decode_output(r.json()), expected, rtol=0, atol=3e-3)

    tampered = shutil.copytree(export, tmp_path / "tampered")
    weights = bytearray((tampered / "model.safetensors").read_bytes())
    weights[-3] ^= 0x01  # one bit of one weight
    (tampered / "model.safetensors").write_bytes(bytes(weights))
    assert "fails its signature check" in _refused(tampered, public)  # `hpcml serve`: exit 2

    # The same check in the server's set-up, in this process (each `hpcml serve` pays the
    # import of model_signing again).
    def refusal(path: Path, key: Path = public) -> str:
        with pytest.raises(HpcmlError) as err:
            build_app(path, ServeConfig(require_signature=True, verify_key=str(key)), name="d")
        assert "\n" not in err.value.message and err.value.exit_code == 2
        return err.value.message

    added = shutil.copytree(export, tmp_path / "added")
    (added / "model.onnx").write_bytes(b"written after signing")
    assert "fails its signature check" in refusal(added)
    unsigned = shutil.copytree(export, tmp_path / "unsigned")
    (unsigned / SIGNATURE).unlink()
    assert "is not signed" in refusal(unsigned)
    _, stranger = _keypair(tmp_path, "stranger")
    assert "fails its signature check" in refusal(export, stranger)
    with pytest.raises(HpcmlError, match="needs --verify-key"):
        build_app(export, ServeConfig(require_signature=True), name="d")


def test_a_followed_version_that_fails_its_check_is_not_added(
    signed: tuple[torch.nn.Module, Path, Path, Path], tmp_path: Path
) -> None:
    _, export, public, _ = signed
    cfg = ServeConfig(require_signature=True, verify_key=str(public))
    router = Router.from_source(
        ModelSource("export", export, {"digits": {"1": export}}), cfg, ServeMetrics()
    )
    tampered = shutil.copytree(export, tmp_path / "v2")
    (tampered / "model.json").write_text((tampered / "model.json").read_text() + " ")
    with pytest.raises(ModelError, match="fails its signature check"):
        asyncio.run(add_version(router, "digits", "2", tampered))
    assert list(router.model("digits").versions) == ["1"]


def test_a_signature_made_after_registration_travels_with_the_next_version(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The first registration logs the run (and its unsigned export) to MLflow; the export is
    signed afterwards and registered again: the new version's artifact carries model.sig, so
    it passes its sha256 check and verifies (MLflow's MLmodel beside it is not signed), and
    the first version's artifact is left as registered (its sha256 still matches)."""
    from tests.integration.mlflow_util import fresh_store
    from tests.integration.test_track_registry import make_run

    from hpcml.models.signing import sign_export, verify_export
    from hpcml.track.registry import register_run
    from hpcml.track.resolve import resolve_model

    store = fresh_store(tmp_path_factory, "signed-registry")
    root = tmp_path_factory.mktemp("signed-run")
    run = root / "run"
    make_run(run, 0.9, 0.3)
    register_run(run, "signed", tracking_uri=store)
    private, public = _keypair(root, "signer")
    sign_export(run, private)
    version = register_run(run, "signed", tracking_uri=store)["version"]
    resolved = resolve_model(f"models:/signed/{version}", store)
    assert (resolved.path / "MLmodel").is_file() and (resolved.path / SIGNATURE).is_file()
    verify_export(resolved.path, public)
    first = resolve_model("models:/signed/1", store)  # raises if its files changed
    assert not (first.path / SIGNATURE).exists()
