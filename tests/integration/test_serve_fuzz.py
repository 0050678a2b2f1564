"""Property-based fuzzing of the inference endpoints over a real server on loopback.

Hypothesis builds thousands of requests that are nearly right (a valid request with one or a
few parts broken: shapes with booleans, negatives and huge sizes, unknown or wrong datatypes,
data of the wrong length or kind, binary sections whose lengths disagree with the header,
wrong content types, unknown models and versions) and some that are arbitrary JSON. Whatever
arrives, the server must answer below 500, in the protocol's error form, without traceback
text. `derandomize=True` makes the cases the same on every run (the seed is the test's name).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.codec.oip import encode_request
from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

ARGS = {"hidden": 8, "depth": 1, "input_shape": [2, 2]}
DATATYPES = [
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES", "BF16", "FLOAT", "",
]  # fmt: skip
FORMATS = {"BOOL": "?", "UINT8": "B", "INT8": "b", "INT32": "i", "INT64": "q", "FP16": "e",
           "FP32": "f", "FP64": "d"}  # fmt: skip

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
dims = st.one_of(
    st.integers(min_value=-3, max_value=9),
    st.sampled_from([2**31, 2**62, 2**63, -(2**63), 2**64]),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=2),
)
numbers = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.integers(min_value=-300, max_value=300),
    st.booleans(),
)


@st.composite
def valid_tensor(draw: st.DrawFn, binary: bool) -> tuple[dict[str, Any], bytes]:
    batch = draw(st.integers(min_value=1, max_value=8))
    values = draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=batch * 4, max_size=batch * 4))
    tensor: dict[str, Any] = {"name": "input", "shape": [batch, 2, 2], "datatype": "FP32"}
    if not binary:
        tensor["data"] = values
        return tensor, b""
    raw = struct.pack(f"<{len(values)}f", *values)
    tensor["parameters"] = {"binary_data_size": len(raw)}
    return tensor, raw


@st.composite
def tensors(draw: st.DrawFn, binary: bool) -> tuple[dict[str, Any], bytes]:
    if draw(st.integers(0, 3)) == 0:
        return draw(valid_tensor(binary))
    batch = draw(st.integers(min_value=0, max_value=10))
    shape = draw(st.one_of(st.just([batch, 2, 2]), st.lists(dims, max_size=5), json_values))
    datatype = draw(st.one_of(st.sampled_from(DATATYPES), json_values))
    tensor: dict[str, Any] = {
        "name": draw(st.one_of(st.sampled_from(["input", "input", "x", ""]), json_values)),
        "shape": shape,
        "datatype": datatype,
    }
    raw = b""
    if binary:
        fmt = FORMATS.get(datatype) if isinstance(datatype, str) else None
        count = draw(st.sampled_from([batch * 4, draw(st.integers(0, 50))]))
        if fmt is not None and draw(st.booleans()):
            values = draw(st.lists(numbers, min_size=count, max_size=count))
            try:
                raw = struct.pack(f"<{count}{fmt}", *values)
            except (struct.error, OverflowError):
                raw = draw(st.binary(max_size=80))
        elif datatype == "BYTES" and draw(st.booleans()):
            items = draw(st.lists(st.binary(max_size=5), max_size=count))
            raw = b"".join(struct.pack("<I", len(b)) + b for b in items)
        else:
            raw = draw(st.binary(max_size=80))
        size = draw(st.one_of(st.just(len(raw)), st.integers(-5, 200), json_values))
        tensor["parameters"] = {"binary_data_size": size}
    else:
        tensor["data"] = draw(
            st.one_of(
                st.lists(numbers, min_size=batch * 4, max_size=batch * 4),
                st.lists(st.lists(numbers, min_size=4, max_size=4), max_size=10),
                st.lists(numbers, max_size=40),
                json_values,
            )
        )
    for key in draw(st.lists(st.sampled_from(list(tensor)), max_size=2)):
        tensor.pop(key, None)  # a missing key
    return tensor, raw


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    binary = draw(st.booleans())
    parts = draw(st.lists(tensors(binary), min_size=1, max_size=2))
    body: dict[str, Any] = {"inputs": [t for t, _ in parts]}
    if draw(st.booleans()):
        body["outputs"] = draw(
            st.one_of(
                st.just([{"name": "logits", "parameters": {"binary_data": draw(leaves)}}]),
                st.lists(st.fixed_dictionaries({"name": st.text(max_size=6)}), max_size=2),
                json_values,
            )
        )
    if draw(st.booleans()):
        body["parameters"] = draw(
            st.one_of(st.just({"binary_data_output": draw(leaves)}), json_values)
        )
    if draw(st.booleans()):
        body["id"] = draw(json_values)
    if draw(st.integers(0, 9)) == 0:
        body = draw(json_values)  # anything at all
    header = json.dumps(body).encode()
    raw = b"".join(r for _, r in parts)
    if draw(st.integers(0, 19)) == 0:
        header = draw(st.binary(max_size=60))  # not JSON, maybe not UTF-8
    if draw(st.integers(0, 29)) == 0:
        header += b" " * 5000  # still valid JSON, but past the server's 4096-byte body limit
    headers: dict[str, str] = {}
    content_type = draw(
        st.sampled_from(
            [None, "application/json", "application/octet-stream", "text/plain", "image/png"]
        )
    )
    if content_type:
        headers["content-type"] = content_type
    if binary:
        length = draw(
            st.one_of(
                st.just(str(len(header))),
                st.integers(-5, len(header) + 100).map(str),
                st.text(alphabet="0123456789-x", min_size=1, max_size=6),
            )
        )
        headers["inference-header-content-length"] = length
    path = draw(
        st.sampled_from(
            [
                "/v2/models/digits/infer",
                "/v2/models/digits/versions/1/infer",
                "/v2/models/digits/versions/2/infer",
                "/v2/models/nope/infer",
                "/v2/models/digits/versions/%00/infer",
            ]
        )
    )
    return path, header + raw, headers


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    export = save_export(
        tmp_path_factory.mktemp("run") / "export", model, "mlp", ARGS, (2, 2), (10,)
    )
    # json_offload_bytes 0: every body is parsed in a worker thread, the path large ones take.
    cfg = ServeConfig.model_validate(
        {
            "max_body_bytes": 4096,
            "json_offload_bytes": 0,
            "defaults": {"max_batch_size": 8, "isolation": "thread"},
        }
    )
    with (
        running_server(build_app(export, cfg, name="digits")) as url,
        httpx.Client(base_url=url, timeout=60) as c,
    ):
        yield c


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    assert "Traceback" not in response.text
    if response.status_code == 200:
        header = response.headers.get("inference-header-content-length")
        head = response.content[: int(header)] if header else response.content
        assert json.loads(head)["outputs"][0]["name"] == "logits"
    else:
        assert response.headers["content-type"] == "application/json"
        assert isinstance(response.json()["error"], str)


def test_no_request_makes_the_server_fail(client: httpx.Client) -> None:
    statuses: set[int] = set()

    # 1200 cases: about 30 s of CPU on one core; every case is the same on every run.
    @settings(
        max_examples=1200,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(case=requests())
    def case_is_answered_below_500(case: tuple[str, bytes, dict[str, str]]) -> None:
        path, body, headers = case
        response = client.post(path, content=body, headers=headers)
        _check(response)
        statuses.add(response.status_code)

    case_is_answered_below_500()
    # The strategy is not vacuous: its cases reach each kind of refusal. Whether a generated
    # case is also valid varies with Hypothesis's generation (one CI run saw no 200 among the
    # 1200), so a known-valid request checks the answer path with the same _check.
    assert {400, 404, 413} <= statuses, statuses
    valid = encode_request(np.zeros((3, 2, 2), dtype=np.float32))
    response = client.post("/v2/models/digits/infer", json=valid)
    _check(response)
    assert response.status_code == 200, response.text
