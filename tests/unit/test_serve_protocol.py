"""Open Inference Protocol codec, serve config and model-source resolution, without a server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcml.errors import ConfigError, ModelError
from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve import protocol as oip
from hpcml.serve.config import load_serve_config
from hpcml.serve.repository import resolve_model_source, sorted_versions

SPEC = oip.TensorSpec("input", "FP32", (2, 2))


def _body(**inp: object) -> bytes:
    tensor = {"name": "input", "shape": [1, 2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}
    tensor.update(inp)
    return json.dumps({"inputs": [tensor]}).encode()


def test_flat_and_nested_data_give_the_same_tensor() -> None:
    flat = oip.parse_infer_request(_body())
    nested = oip.parse_infer_request(_body(data=[[[1, 2], [3, 4]]]))
    a = oip.check_inputs(flat, SPEC, 8, "m")
    b = oip.check_inputs(nested, SPEC, 8, "m")
    assert a.dtype == np.float32 and a.shape == (1, 2, 2)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "JSON object"),
        (b'{"inputs": []}', "no 'inputs'"),
        (_body(name="x"), "has input 'input' but the request sent 'x'"),
        (_body(datatype="FP64"), "has datatype FP32, but the request sent FP64"),
        (_body(datatype="FLOAT"), "does not define"),
        (_body(shape=[1, 4]), "has shape [-1, 2, 2]"),
        (_body(shape=[1, 2, 3]), "needs 6"),
        (_body(shape=[9, 2, 2], data=[0] * 36), "accepts 1 to 8"),
        (_body(data=["a", "b", "c", "d"]), "cannot be read as FP32"),
        (_body(shape="1,2,2"), "'shape' must be a list"),
    ],
)
def test_bad_requests_say_what_is_wrong(body: bytes, message: str) -> None:
    with pytest.raises(oip.ProtocolError) as err:
        oip.check_inputs(oip.parse_infer_request(body), SPEC, 8, "m")
    assert message in err.value.message
    assert err.value.status == 400


def test_unknown_requested_output_is_refused() -> None:
    req = oip.parse_infer_request(
        json.dumps({**json.loads(_body()), "outputs": [{"name": "probs"}]}).encode()
    )
    with pytest.raises(oip.ProtocolError, match="no output named 'probs'"):
        oip.check_requested_outputs(req, [oip.TensorSpec("logits", "FP32", (10,))], "m")


def test_response_round_trips_through_the_client_helpers() -> None:
    out = np.arange(6, dtype=np.float32).reshape(2, 3)
    body = json.loads(
        oip.infer_response_body("m", "3", "req-1", oip.TensorSpec("logits", "FP32", (3,)), out)
    )
    assert body["model_version"] == "3" and body["id"] == "req-1"
    assert body["outputs"][0]["datatype"] == "FP32" and body["outputs"][0]["shape"] == [2, 3]
    np.testing.assert_array_equal(oip.decode_output(body), out)
    req = json.loads(oip.encode_request_bytes(out, "input"))
    np.testing.assert_array_equal(
        oip.check_inputs(
            oip.parse_infer_request(json.dumps(req).encode()),
            oip.TensorSpec("input", "FP32", (3,)),
            4,
            "m",
        ),
        out,
    )


def test_serve_config_reads_integer_version_keys_and_rejects_unknown_keys(tmp_path: Path) -> None:
    good = tmp_path / "serve.yaml"
    good.write_text(
        "models:\n  digits:\n    traffic: {1: 90, 2: 10}\n    shadow: {version: 3}\n"
        "    versions:\n      3: {path: /somewhere}\n"
    )
    cfg = load_serve_config(good)
    assert cfg.models["digits"].traffic == {"1": 90, "2": 10}
    assert cfg.models["digits"].shadow is not None and cfg.models["digits"].shadow.version == "3"
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  digits:\n    max_batch: 8\n")
    with pytest.raises(ConfigError, match="models.digits.max_batch"):
        load_serve_config(bad)
    too_big = tmp_path / "big.yaml"
    too_big.write_text("defaults:\n  max_batch_size: 8\n  preferred_batch_sizes: [4, 16]\n")
    with pytest.raises(ConfigError, match="exceed max_batch_size"):
        load_serve_config(too_big)


def _export(path: Path) -> Path:
    model = build_model("mlp", {"hidden": 8, "depth": 1})
    return save_export(path, model, "mlp", {"hidden": 8, "depth": 1}, (3, 32, 32), (10,))


def test_model_sources_export_run_folder_and_repository(tmp_path: Path) -> None:
    torch.manual_seed(0)
    export = _export(tmp_path / "run" / "export")
    single = resolve_model_source(tmp_path / "run")
    assert single.kind == "export" and single.models == {"mlp": {"1": export}}
    assert resolve_model_source(export, name="digits").models == {"digits": {"1": export}}

    repo = tmp_path / "repo"
    for version in ("1", "2", "10"):
        _export(repo / "digits" / version)
    (repo / "digits" / "notes").mkdir()
    source = resolve_model_source(repo)
    assert source.kind == "repository"
    assert sorted_versions(list(source.models["digits"])) == ["1", "2", "10"]

    with pytest.raises(ModelError, match="no model 'cifar'"):
        resolve_model_source(repo, name="cifar")
    with pytest.raises(ModelError, match="neither an export"):
        resolve_model_source(repo / "digits" / "notes")
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model_source(tmp_path / "missing")


def test_example_serve_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "serve_digits.yaml"
    cfg = load_serve_config(example)
    digits = cfg.models["digits"]
    assert digits.traffic == {"1": 90, "2": 10} and digits.shadow is not None
    assert digits.versions["3"].backend == "onnx-int8"
