"""Versions and traffic over a real server: canary split, shadow, admin auth, rollback under load."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from tests.conftest import run_hpcml

from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.codec.oip import decode_output, encode_request_bytes
from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

ARGS = {"hidden": 16, "depth": 1}
TOKEN = "s3cret-for-tests"
JSON = {"content-type": "application/json"}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _versions(repo: Path) -> dict[str, torch.nn.Module]:
    models = {}
    for version, seed in (("1", 1), ("2", 2)):
        torch.manual_seed(seed)
        models[version] = build_model("mlp", ARGS).eval()
        save_export(repo / "digits" / version, models[version], "mlp", ARGS, (3, 32, 32), (10,))
    return models


def _logits(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.from_numpy(x)).numpy()


@pytest.fixture(params=["thread"])
def served(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, dict[str, torch.nn.Module]]]:
    monkeypatch.setenv("HPCML_TEST_ADMIN_TOKEN", TOKEN)
    models = _versions(tmp_path / "repo")
    digits = {"traffic": {"1": 75, "2": 25}, "max_queue_delay_ms": 1, "isolation": request.param}
    cfg = ServeConfig.model_validate(
        {"admin_token_env": "HPCML_TEST_ADMIN_TOKEN", "models": {"digits": digits}}
    )
    with running_server(build_app(tmp_path / "repo", cfg, seed=0)) as url:
        yield url, models


def test_canary_split_follows_the_weights_and_versions_answer_as_themselves(
    served: tuple[str, dict[str, torch.nn.Module]],
) -> None:
    url, models = served
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    expected = {v: _logits(m, x) for v, m in models.items()}
    counts = {"1": 0, "2": 0}
    payload = encode_request_bytes(x)
    with httpx.Client(base_url=url) as c:
        for _ in range(400):
            body = c.post("/v2/models/digits/infer", content=payload, headers=JSON).json()
            counts[body["model_version"]] += 1
            np.testing.assert_allclose(
                # fp32 sums in another order: 2 x Higham-Mary 6 sqrt(K) u |x||W| < 3e-3; answers differ > .1
                decode_output(body), expected[body["model_version"]], rtol=0, atol=3e-3
            )
        pinned = {
            c.post("/v2/models/digits/versions/2/infer", content=payload, headers=JSON).json()[
                "model_version"
            ]
            for _ in range(20)
        }
    # 25% of 400 is 100 with a standard deviation of 8.7: five of them either way.
    assert 57 <= counts["2"] <= 143, counts
    assert pinned == {"2"}


def test_shadow_mirrors_without_changing_answers_and_counts_disagreements(
    served: tuple[str, dict[str, torch.nn.Module]],
) -> None:
    url, models = served
    xs = np.random.default_rng(1).standard_normal((40, 1, 3, 32, 32)).astype(np.float32)
    with httpx.Client(base_url=url, headers=AUTH) as c:
        assert c.post("/admin/models/digits/promote", json={"version": "1"}).status_code == 200
        state = c.post("/admin/models/digits/shadow", json={"version": "2"}).json()
        assert state["shadow"] == {"version": "2", "fraction": 1.0}
        expected_disagreements = 0
        for x in xs:
            body = c.post(
                "/v2/models/digits/infer", content=encode_request_bytes(x), headers=JSON
            ).json()
            assert body["model_version"] == "1"
            v1, v2 = _logits(models["1"], x), _logits(models["2"], x)
            # fp32 sums in another order: 2 x Higham-Mary 6 sqrt(K) u |x||W| < 3e-3; answers differ > .1
            np.testing.assert_allclose(decode_output(body), v1, rtol=0, atol=3e-3)
            expected_disagreements += int(v1.argmax() != v2.argmax())
        for _ in range(200):  # comparisons finish just after the answers
            stats = c.get("/admin/models/digits").json()["shadow_stats"].get("2", {})
            if stats.get("samples") == 40:
                break
            time.sleep(0.02)
        assert stats["requests"] == 40 and stats["failed"] == 0
        assert stats["disagreements"] == expected_disagreements
        text = c.get("/metrics").text
    assert 'hpcml_shadow_samples_total{model="digits",version="2"} 40.0' in text
    # Counted at 0 too: a dashboard tells "compared, none differ" from "no shadow".
    assert (
        f'hpcml_shadow_disagreements_total{{model="digits",version="2"}} {float(expected_disagreements)}'
        in text
    )
    with httpx.Client(base_url=url, headers=AUTH) as c:
        # A shadow of the version that takes all the traffic would mirror nothing: refused,
        # the policy unchanged.
        r = c.post("/admin/models/digits/shadow", json={"version": "1"})
        assert r.status_code == 400 and "also takes all of its traffic" in r.json()["error"]
        assert c.get("/admin/models/digits").json()["shadow"] == {"version": "2", "fraction": 1.0}


def test_admin_endpoints_need_the_token_and_check_their_input(
    served: tuple[str, dict[str, torch.nn.Module]],
) -> None:
    url, _ = served
    with httpx.Client(base_url=url) as c:
        assert c.post("/admin/models/digits/promote", json={"version": "2"}).status_code == 401
        wrong = c.post(
            "/admin/models/digits/promote",
            json={"version": "2"},
            headers={"Authorization": "Bearer nope"},
        )
        assert wrong.status_code == 401 and "Bearer" in wrong.json()["error"]
        r = c.post("/admin/models/digits/promote", json={"version": "9"}, headers=AUTH)
        assert r.status_code == 400 and "no version '9'" in r.json()["error"]
        assert c.post("/admin/models/nope/rollback", headers=AUTH).status_code == 404
        r = c.post("/admin/models/digits/traffic", json={"weights": {"1": 0}}, headers=AUTH)
        assert r.status_code == 400
        assert (
            c.post("/admin/models/digits/rollback", headers=AUTH).status_code == 400
        )  # no history
        r = c.post("/admin/models/digits/traffic", json={"weights": {"1": 1, "2": 3}}, headers=AUTH)
        assert r.json()["traffic"] == {"1": 0.25, "2": 0.75}
        r = c.post("/admin/models/digits/rollback", headers=AUTH)
        assert r.json()["traffic"] == {"1": 0.75, "2": 0.25} and not r.json()["can_roll_back"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"weights": {"1": NaN, "2": 1}}',
        b'{"weights": {"1": Infinity}}',
        b'{"weights": {"1": -Infinity, "2": 1}}',
        b'{"weights": {"1": 1e400}}',  # Python's JSON reads this as infinity
        b'{"weights": {"1": -1, "2": 3}}',
        b'{"weights": {"1": 0, "2": 0}}',
        b'{"weights": {}}',
        b'{"weights": {"1": 1, "7": 1}}',
        b'{"weights": {"1": "a lot"}}',
        b'{"weights": [1, 2]}',
        b'{"weights": {"1": 1}',
    ],
)
def test_traffic_changes_are_validated_whole_before_they_apply(
    served: tuple[str, dict[str, torch.nn.Module]], body: bytes
) -> None:
    url, _ = served
    with httpx.Client(base_url=url, headers={**AUTH, **JSON}) as c:
        before = c.get("/admin/models/digits").json()
        r = c.post("/admin/models/digits/traffic", content=body)
        assert r.status_code == 400 and isinstance(r.json()["error"], str)
        after = c.get("/admin/models/digits").json()
        assert after["traffic"] == before["traffic"] == {"1": 0.75, "2": 0.25}
        assert not after["can_roll_back"]  # nothing was applied, so nothing to roll back
        # Unversioned requests still follow the old policy.
        x = encode_request_bytes(np.zeros((1, 3, 32, 32), dtype=np.float32))
        assert c.post("/v2/models/digits/infer", content=x).status_code == 200
        r = c.post("/admin/models/digits/shadow", content=b'{"version": "2", "fraction": NaN}')
        assert r.status_code == 400 and c.get("/admin/models/digits").json()["shadow"] is None


# The production default for torch: each version computes in its own process.
@pytest.mark.parametrize("served", ["process"], indirect=True)
def test_promote_and_rollback_under_load_fail_no_request(
    served: tuple[str, dict[str, torch.nn.Module]],
) -> None:
    url, _ = served
    x = encode_request_bytes(np.zeros((1, 3, 32, 32), dtype=np.float32))
    log: list[tuple[float, float, int, str]] = []  # (sent, answered, status, version)
    marks: dict[str, float] = {}

    async def client(c: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            sent = time.perf_counter()
            r = await c.post("/v2/models/digits/infer", content=x, headers=JSON)
            version = r.json().get("model_version", "") if r.status_code == 200 else ""
            log.append((sent, time.perf_counter(), r.status_code, version))

    async def main() -> None:
        stop = asyncio.Event()
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as c,
            httpx.AsyncClient(base_url=url, headers=AUTH) as admin,
        ):
            assert (
                await admin.post("/admin/models/digits/promote", json={"version": "1"})
            ).status_code == 200
            clients = [asyncio.create_task(client(c, stop)) for _ in range(6)]
            await asyncio.sleep(0.4)
            marks["promote_sent"] = time.perf_counter()
            assert (
                await admin.post("/admin/models/digits/promote", json={"version": "2"})
            ).status_code == 200
            marks["promoted"] = time.perf_counter()
            await asyncio.sleep(0.4)
            marks["rollback_sent"] = time.perf_counter()
            assert (await admin.post("/admin/models/digits/rollback")).status_code == 200
            marks["rolled_back"] = time.perf_counter()
            await asyncio.sleep(0.4)
            stop.set()
            await asyncio.gather(*clients)

    asyncio.run(main())
    assert [s for s in log if s[2] != 200] == []
    before = [v for _, answered, _, v in log if answered < marks["promote_sent"]]
    after_promote = [
        v
        for sent, answered, _, v in log
        if sent > marks["promoted"] and answered < marks["rollback_sent"]
    ]
    after_rollback = [v for sent, _, _, v in log if sent > marks["rolled_back"]]
    # Every request sent after a change was answered by the version that change chose.
    assert set(before) == {"1"}
    assert after_promote and set(after_promote) == {"2"}
    assert after_rollback and set(after_rollback) == {"1"}


def test_weights_whose_sum_overflows_are_normalised_and_requests_keep_flowing(
    served: tuple[str, dict[str, torch.nn.Module]],
) -> None:
    # Each weight is finite but their sum is not (1e308 + 1e308 = inf): main accepted this
    # and then answered every unversioned request with 500.
    url, _ = served
    x = encode_request_bytes(np.zeros((1, 3, 32, 32), dtype=np.float32))
    with httpx.Client(base_url=url, headers={**AUTH, **JSON}) as c:
        r = c.post("/admin/models/digits/traffic", content=b'{"weights": {"1": 1e308, "2": 1e308}}')
        assert r.status_code == 200 and r.json()["traffic"] == {"1": 0.5, "2": 0.5}
        versions = set()
        for _ in range(40):
            r = c.post("/v2/models/digits/infer", content=x)
            assert r.status_code == 200, r.text
            versions.add(r.json()["model_version"])
    # Both versions take half: missing one in 40 draws has probability 2 x 2^-40.
    assert versions == {"1", "2"}


def test_an_unexpected_error_in_an_admin_route_answers_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A route that fails as a bug would (the admin endpoints on main answered a plain-text
    # "Internal Server Error" when a NaN policy made the status unserialisable).
    _versions(tmp_path / "repo")
    monkeypatch.setenv("HPCML_TEST_ADMIN_TOKEN", TOKEN)  # every /admin path asks for it
    cfg = ServeConfig.model_validate(
        {"admin_token_env": "HPCML_TEST_ADMIN_TOKEN", "defaults": {"isolation": "thread"}}
    )
    app = build_app(tmp_path / "repo", cfg, seed=0)

    async def broken() -> None:
        raise ValueError("Out of range float values are not JSON compliant")

    app.add_api_route("/admin/broken", broken)
    with running_server(app) as url, httpx.Client(base_url=url, headers=AUTH) as c:
        r = c.get("/admin/broken")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": "internal error (ValueError); see the server log."}


def test_a_serve_config_with_nan_traffic_exits_2_in_one_sentence(tmp_path: Path) -> None:
    # main started with it, showed "nan%" and answered the admin status with a plain-text 500.
    _versions(tmp_path / "repo")
    config = tmp_path / "serve.yaml"
    config.write_text("models:\n  digits:\n    traffic: {1: .nan, 2: 1}\n")
    r = run_hpcml("serve", str(tmp_path / "repo"), "--config", str(config), "--port", "0",
                  check=False, timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3, r.stderr
    assert "models.digits.traffic" in r.stderr and "got '1': nan" in r.stderr, r.stderr
