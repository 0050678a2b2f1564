"""Open Inference Protocol codec, serve config and model-source resolution, without a server."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcml.errors import ConfigError, ModelError
from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.codec import oip, tensors
from hpcml.serve.config import load_serve_config
from hpcml.serve.runtime.repository import resolve_model_source, sorted_versions

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
        (
            _body(datatype="INT64", data=[1, 2, 3, 2**40 + 1]),
            "has datatype FP32, but the request sent INT64",
        ),
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
        oip.infer_response_body("m", "3", "req-1", oip.TensorSpec("logits", "FP32", (3,)), out)[0]
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
    assert cfg.models["digits"].traffic == {"1": 0.9, "2": 0.1}  # normalised when read
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
    assert digits.traffic == {
        "1": 0.9,
        "2": 0.1,
    }  # normalised when read and digits.shadow is not None
    assert digits.versions["3"].backend == "onnx-int8"
    # A hung inference process is replaced (503 + Retry-After) before its requests time out
    # (504): with the example's timeout_ms of 5000 the old fixed 10 s default came too late.
    assert digits.hang_after_s * 1000 < digits.timeout_ms


def test_a_hang_timeout_not_below_the_request_timeout_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("defaults: {timeout_ms: 2000, hang_timeout_s: 2}\n")
    with pytest.raises(ConfigError, match="hang_timeout_s 2 s is not shorter than timeout_ms"):
        load_serve_config(path)
    path.write_text("defaults: {timeout_ms: 2000, hang_timeout_s: 1.5}\n")
    assert load_serve_config(path).defaults.hang_after_s == 1.5


# Binary tensor data extension and datatypes (tensors.py).


def _binary_body(header: dict, *chunks: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + b"".join(chunks), len(head)


def _bin_input(shape: list[int], datatype: str, size: int, name: str = "input") -> dict:
    return {
        "name": name,
        "shape": shape,
        "datatype": datatype,
        "parameters": {"binary_data_size": size},
    }


def test_binary_input_is_read_little_endian_and_outputs_follow_the_requested_form() -> None:
    x = np.arange(4, dtype=np.float32).reshape(1, 2, 2)
    raw = x.astype("<f4").tobytes()
    header = {
        "inputs": [_bin_input([1, 2, 2], "FP32", len(raw))],
        "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
    }
    body, n = _binary_body(header, raw)
    req = oip.parse_infer_request(body, oip.parse_header_length(str(n), len(body)))
    np.testing.assert_array_equal(oip.check_inputs(req, SPEC, 8, "m"), x)
    assert req.wants_binary("logits")
    out = np.array([[1.5, -2.0]], dtype=np.float32)
    resp, header_len = oip.infer_response_body(
        "m", "1", None, oip.TensorSpec("logits", "FP32", (2,)), out, binary=True
    )
    assert header_len is not None
    meta = json.loads(resp[:header_len])
    assert meta["outputs"][0]["parameters"] == {"binary_data_size": 8}
    assert "data" not in meta["outputs"][0]
    # The bytes after the header are the tensor, little-endian, as the spec says.
    assert resp[header_len:] == struct.pack("<2f", 1.5, -2.0)
    # binary_data_output on the request applies to outputs that do not say otherwise.
    req2 = oip.parse_infer_request(
        json.dumps({**json.loads(_body()), "parameters": {"binary_data_output": True}}).encode()
    )
    assert req2.wants_binary("logits")
    assert not oip.parse_infer_request(_body()).wants_binary("logits")


def test_bytes_tensors_round_trip_length_prefixed() -> None:
    values = [b"", b"a", "h\u00e9".encode(), b"\x00\xff" * 3]
    raw = b"".join(struct.pack("<I", len(v)) + v for v in values)
    got = tensors.from_raw(raw, "BYTES", (2, 2), "input 'x'")
    assert got.shape == (2, 2) and list(got.reshape(-1)) == values
    assert tensors.to_raw(got) == raw
    from_json = tensors.from_json_data([["", "a"], ["h\u00e9", "z"]], "BYTES", (2, 2), "x")
    assert from_json[1, 0] == "h\u00e9".encode()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (struct.pack("<I", 5) + b"abcd", "claims 5 bytes but only 4 remain"),
        (struct.pack("<I", 4) + b"abcd", "for 1 elements but its shape needs 2"),
        (struct.pack("<I", 0) * 2 + b"x", "1 bytes of BYTES data beyond"),
        (struct.pack("<I", 1) + b"a", "5 bytes of binary BYTES data, too few for the 2 elements"),
        (b"\x01\x00", "too few for the 2 elements"),
    ],
)
def test_malformed_bytes_tensors_are_refused(raw: bytes, message: str) -> None:
    with pytest.raises(oip.ProtocolError, match=re.escape(message)):
        tensors.from_raw(raw, "BYTES", (2,), "input 'x'")


def test_bytes_count_the_data_cannot_hold_is_refused_before_allocating() -> None:
    # 2^40 pointers would be 8 TiB: refused from the 5 bytes present, before np.empty runs.
    with pytest.raises(oip.ProtocolError, match="too few for the 1099511627776 elements"):
        tensors.deserialize_bytes(struct.pack("<I", 1) + b"a", 2**40, "input 'x'")


@pytest.mark.parametrize("binary", [False, True])
def test_decoded_size_budget_covers_every_input_of_a_request(binary: bool) -> None:
    # Two FP32 inputs of 100 elements (400 bytes each) and one BYTES input of 2 elements
    # (2 x 41 bytes): 882 bytes decoded. A budget of 881 refuses the request, 882 admits it.
    inputs, raw = [], b""
    for name in ("a", "b"):
        data = np.arange(100, dtype=np.float32)
        tensor: dict = {"name": name, "shape": [100], "datatype": "FP32"}
        if binary:
            tensor["parameters"] = {"binary_data_size": data.nbytes}
            raw += data.tobytes()
        else:
            tensor["data"] = data.tolist()
        inputs.append(tensor)
    inputs.append({"name": "s", "shape": [2], "datatype": "BYTES", "data": ["x", "yz"]})
    header = json.dumps({"inputs": inputs}).encode()
    length = len(header) if binary else None
    assert set(oip.parse_infer_request(header + raw, length, 882).inputs) == {"a", "b", "s"}
    with pytest.raises(oip.ProtocolError, match="limit of 881 decoded bytes") as err:
        oip.parse_infer_request(header + raw, length, 881)
    assert err.value.status == 413


def test_grpc_decoded_size_budget() -> None:
    from hpcml.serve.oip_pb import grpc_predict_v2_pb2 as pb
    from hpcml.serve.protocol.grpc import request_from_grpc

    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name="a", datatype="FP64", shape=[3]).contents.fp64_contents.extend([1, 2, 3])
    assert request_from_grpc(msg, 24).inputs["a"].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(oip.ProtocolError, match="limit of 23 decoded bytes") as err:
        request_from_grpc(msg, 23)
    assert err.value.status == 413


def test_decoded_limit_defaults_to_four_bodies() -> None:
    from hpcml.serve.config import ServeConfig

    assert ServeConfig(max_body_bytes=1000).decoded_limit_bytes == 4000
    assert ServeConfig(max_body_bytes=1000, max_decoded_bytes=10).decoded_limit_bytes == 10


FP32_16 = np.arange(4, dtype=np.float32).tobytes()


@pytest.mark.parametrize(
    ("header_length", "header", "chunks", "message"),
    [
        ("abc", None, [], "must be a non-negative integer"),
        ("-5", None, [], "must be a non-negative integer"),
        ("0", None, [], "must give the length"),
        ("999999", None, [], "must give the length"),
        (None, {"inputs": [_bin_input([1, 2, 2], "FP32", 16)]}, [FP32_16], "not valid JSON"),
        ("auto", {"inputs": [_bin_input([1, 2, 2], "FP32", 32)]}, [FP32_16], "only 16 remain"),
        (
            "auto",
            {"inputs": [_bin_input([1, 2, 2], "FP32", 16)]},
            [FP32_16, b"xxxx"],
            "4 bytes of binary data that no input claims",
        ),
        ("auto", {"inputs": [_bin_input([1, 2, 2], "FP32", 12)]}, [FP32_16], "needs 16"),
        ("auto", {"inputs": [_bin_input([1, 2, 2], "FP32", -1)]}, [FP32_16], "non-negative"),
        ("auto", {"inputs": [_bin_input([1, 2, 2], "FP32", True)]}, [FP32_16], "non-negative"),
        ("auto", {"inputs": [_bin_input([1, 2, 2], "FP64", 16)]}, [FP32_16], "needs 32"),
        (
            "auto",
            {"inputs": [{**_bin_input([1, 2, 2], "FP32", 16), "data": [1, 2, 3, 4]}]},
            [FP32_16],
            "both 'data' and 'binary_data_size'",
        ),
        (
            "auto",
            {"inputs": [{"name": "input", "shape": [1], "datatype": "FP32"}]},
            [],
            "no 'data'",
        ),
        (
            "auto",
            {
                "inputs": [_bin_input([1, 2, 2], "FP32", 16)],
                "outputs": [{"name": "logits", "parameters": {"binary_data": "yes"}}],
            },
            [FP32_16],
            "must be true or false",
        ),
    ],
)
def test_bad_binary_requests_say_what_is_wrong(
    header_length: str | None, header: dict | None, chunks: list[bytes], message: str
) -> None:
    if header is None:
        body, n = _body(), 0
    else:
        body, n = _binary_body(header, *chunks)
    value = str(n) if header_length == "auto" else header_length
    with pytest.raises(oip.ProtocolError, match=re.escape(message)):
        oip.parse_infer_request(body, oip.parse_header_length(value, len(body)))


@pytest.mark.parametrize(
    "shape",
    [[True, 2, 2], [1, -2, 2], [2**62, 2**62, 0, 4], [1.0, 2, 2], [1] * 17, None, [1, "2", 2]],
)
def test_shapes_with_booleans_negatives_or_huge_sizes_are_refused(shape: object) -> None:
    with pytest.raises(oip.ProtocolError, match="'shape'"):
        oip.parse_infer_request(_body(shape=shape, data=[]))


@pytest.mark.parametrize(
    ("datatype", "values", "expected"),
    [
        ("FP16", np.array([0.5, -2.0], np.float16), [0.5, -2.0]),
        ("FP64", np.array([0.1, 1e30], np.float64), [np.float32(0.1), np.float32(1e30)]),
        ("INT8", np.array([-128, 127], np.int8), [-128.0, 127.0]),
        ("UINT64", np.array([0, 2**24], np.uint64), [0.0, 2.0**24]),
        ("INT32", np.array([-(2**24), 7], np.int32), [-(2.0**24), 7.0]),
        ("BOOL", np.array([True, False]), [1.0, 0.0]),
    ],
)
def test_values_a_fp32_model_can_hold_are_converted(
    datatype: str, values: np.ndarray, expected: list[float]
) -> None:
    got = tensors.convert(values, datatype, "FP32", "input 'x'")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.array(expected, dtype=np.float32))


@pytest.mark.parametrize(
    ("datatype", "values", "target"),
    [
        ("INT32", np.array([2**24 + 1], np.int32), "FP32"),  # float32 has a 24-bit mantissa
        ("FP64", np.array([1e39], np.float64), "FP32"),  # beyond float32's 3.4e38
        ("FP32", np.array([70000.0], np.float32), "FP16"),  # beyond float16's 65504
        ("FP32", np.array([1.0], np.float32), "INT64"),  # floats never become integers
        ("INT64", np.array([300], np.int64), "UINT8"),
        ("INT64", np.array([-1], np.int64), "UINT64"),
        ("INT32", np.array([1], np.int32), "BOOL"),
        ("BYTES", np.array([b"1"], dtype=object), "FP32"),
        ("FP32", np.array([1.0], np.float32), "BYTES"),
    ],
)
def test_conversions_that_would_change_values_are_refused(
    datatype: str, values: np.ndarray, target: str
) -> None:
    with pytest.raises(oip.ProtocolError, match=f"has datatype {target}, but the request sent"):
        tensors.convert(values, datatype, target, "input 'x'")


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("INT32", [1.5, 2.0], "cannot be read as INT32"),  # no silent truncation
        ("UINT8", [256, 0], "outside the range of UINT8"),
        ("INT64", [2**70, 0], "cannot be read as INT64"),
        ("BOOL", [1, 0], "cannot be read as BOOL"),
        ("FP32", [1e39, 0], "too large for FP32"),
        ("FP32", [None, 1], "holds null"),
        ("BYTES", ["a", 1], "cannot be read as BYTES"),
        ("FP32", [[1], [2, 3]], "cannot be read as FP32"),
    ],
)
def test_json_data_is_read_as_its_datatype_or_refused(
    datatype: str, data: list, message: str
) -> None:
    with pytest.raises(oip.ProtocolError, match=re.escape(message)):
        tensors.from_json_data(data, datatype, (2,), "input 'x'")


def test_unknown_content_of_the_request_is_refused() -> None:
    with pytest.raises(oip.ProtocolError, match="classification"):
        oip.parse_infer_request(
            json.dumps({**json.loads(_body()), "parameters": {"classification": 3}}).encode()
        )


def test_numeric_version_names_are_names_under_defaults_as_under_models(tmp_path: Path) -> None:
    """YAML reads `2:` as an int; version names are strings, under `defaults` as under a
    model (before, `defaults` refused them: 'Input should be a valid string')."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "defaults:\n  versions: {2: {backend: onnx}}\n  shadow: {version: 2, fraction: 0.5}\n"
        "models:\n  digits:\n    traffic: {1: 90, 2: 10}\n"
    )
    loaded = load_serve_config(cfg)
    assert list(loaded.defaults.versions) == ["2"]
    assert loaded.defaults.shadow is not None and loaded.defaults.shadow.version == "2"
    assert loaded.models["digits"].traffic == {"1": 0.9, "2": 0.1}  # normalised when read


@pytest.mark.parametrize(
    ("traffic", "message"),
    [
        ("{1: .nan, 2: 1}", "finite and non-negative numbers, got '1': nan"),
        ("{1: .inf}", "finite and non-negative numbers, got '1': inf"),
        ("{1: -1, 2: 3}", "finite and non-negative numbers, got '1': -1.0"),
        ("{1: 0, 2: 0}", "needs a positive weight on some version"),
    ],
)
def test_serve_config_traffic_is_checked_as_a_whole(
    tmp_path: Path, traffic: str, message: str
) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(f"models:\n  digits:\n    traffic: {traffic}\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_serve_config(path)


def test_serve_config_traffic_is_normalised_even_when_its_sum_overflows(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("defaults:\n  traffic: {1: 1.0e+308, 2: 1.0e+308, 3: 0}\n")
    assert load_serve_config(path).defaults.traffic == {"1": 0.5, "2": 0.5, "3": 0.0}
    path.write_text("defaults:\n  traffic: {1: 1, 2: 3}\n")
    assert load_serve_config(path).defaults.traffic == {"1": 0.25, "2": 0.75}


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats_are_refused_in_binary_and_grpc_as_in_json(
    datatype: str, bad: float
) -> None:
    from hpcml.serve.oip_pb import grpc_predict_v2_pb2 as pb
    from hpcml.serve.protocol.grpc import request_from_grpc

    values = np.array([1.0, bad, 3.0, 4.0], dtype=tensors.DATATYPES[datatype])
    message = "holds NaN or infinite"
    # JSON cannot carry them: a null or an overflowing number is refused (the existing rule).
    with pytest.raises(oip.ProtocolError, match="null or values too large"):
        oip.parse_infer_request(_body(datatype=datatype, data=[1, None, 3, 4]))
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, 2, 2], "datatype": datatype,
                                     "parameters": {"binary_data_size": values.nbytes}}]}).encode()  # fmt: skip
    with pytest.raises(oip.ProtocolError, match=message):
        oip.parse_infer_request(header + values.tobytes(), len(header))
    raw = pb.ModelInferRequest(model_name="m", raw_input_contents=[values.tobytes()])
    raw.inputs.add(name="input", datatype=datatype, shape=[1, 2, 2])
    with pytest.raises(oip.ProtocolError, match=message):
        request_from_grpc(raw)
    if datatype != "FP16":  # FP16 has no typed contents field
        typed = pb.ModelInferRequest(model_name="m")
        t = typed.inputs.add(name="input", datatype=datatype, shape=[1, 2, 2])
        getattr(t.contents, f"{datatype.lower()}_contents").extend(values.tolist())
        with pytest.raises(oip.ProtocolError, match=message):
            request_from_grpc(typed)
    # Finite values of the same tensor pass.
    values[1] = 2.0
    assert oip.parse_infer_request(header + values.tobytes(), len(header)).inputs["input"].size == 4


@pytest.mark.parametrize(
    "data",
    [[1.5, -2, True, "3.25", 2**70], [None, 1.0], [1.0, [2.0]], ["abc", 1.0], [{"a": 1}, 2.0]],
)
def test_flat_float_data_reads_as_numpy_asarray_reads_it(data: list) -> None:
    # Flat lists take a faster path than nested ones; values and refusals must not differ.
    expected: np.ndarray | type[Exception]
    try:
        with np.errstate(over="ignore"):
            expected = np.asarray(data, dtype=np.float32)
    except (TypeError, ValueError):
        expected = Exception
    if expected is Exception:
        with pytest.raises(oip.ProtocolError):
            tensors.from_json_data(data, "FP32", (2,), "x")
        return
    if not np.isfinite(expected).all():
        with pytest.raises(oip.ProtocolError, match="holds null"):
            tensors.from_json_data(data, "FP32", (2,), "x")
        return
    got = tensors.from_json_data(data, "FP32", (len(data),), "x")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)
