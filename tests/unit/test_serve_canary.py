"""The canary's rules (`hpcml.serve.traffic.canary`) on their own, with a clock the test holds:
when a step passes, holds or rolls back; the p99 and error-rate SLOs; which failures count as
the candidate's errors (through a real server); and the `canary` serve config's checks. The
whole deploy (promote, `serve --follow`, a rollback recorded in the registry) runs in
tests/integration/test_promote.py."""

from __future__ import annotations

import math
import random
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hpcml.errors import ConfigError
from hpcml.models.export import save_export
from hpcml.serve.codec.oip import encode_request_bytes
from hpcml.serve.config import CanaryConfig, ServeConfig, build_serve_config
from hpcml.serve.protocol.app import build_app
from hpcml.serve.runtime.model_stats import InferStats, RequestWindow
from hpcml.serve.testing import running_server
from hpcml.serve.traffic.canary import Canary

FAST_S, SLOW_S = 0.010, 5.0


def canary(**slo: object) -> Canary:
    cfg = CanaryConfig.model_validate(
        {"steps": [0.25, 1.0], "step_s": 10.0, "min_requests": 5, **slo}
    )
    c = Canary("2", "1", cfg)
    c.window = RequestWindow(started_s=0.0)
    return c


def answer(c: Canary, n: int, latency_s: float = FAST_S) -> None:
    for _ in range(n):
        c.window.add(latency_s)


def test_a_step_passes_after_step_s_with_min_requests_and_the_last_one_completes() -> None:
    c = canary()
    assert c.weights() == {"1": 0.75, "2": 0.25}
    answer(c, 4)
    assert c.check(60.0) == "hold"  # time enough, but 4 requests judge nothing
    answer(c, 1)
    assert c.check(9.9) == "hold"  # 5 requests, but the step has not lasted step_s
    assert c.check(10.0) == "next"
    assert c.step == 1 and c.weights() == {"1": 0.0, "2": 1.0}
    assert c.window.requests == 0 and c.window.started_s == 10.0  # a fresh window
    answer(c, 5)
    assert c.check(19.9) == "hold"
    assert c.check(20.0) == "done"


def test_p99_is_the_nearest_rank_so_one_slow_request_in_a_hundred_is_within_the_slo() -> None:
    c = canary(max_p99_ms=100.0)
    answer(c, 99)
    answer(c, 1, SLOW_S)
    # The p99 is its bucket's upper edge: never below the request's latency, at most 0.99% above.
    assert c.check(1.0) == "hold"
    assert FAST_S * 1000 <= c.window.p99_ms() <= FAST_S * 1000 * 1.0099
    answer(c, 1, SLOW_S)  # 2 of 101: the 100th fastest is slow
    assert c.check(1.0) == "rollback"
    p99 = c.window.p99_ms()
    assert SLOW_S * 1000 <= p99 <= SLOW_S * 1000 * 1.0099
    assert c.reason == (
        f"at step 1 of 2 (25% of traffic) p99 latency {p99:.1f} ms (over 101 answered requests) "
        "is over the SLO's 100 ms"
    )
    assert c.evidence()["p99_ms"] == round(p99, 3) and c.evidence()["requests"] == 101


def test_server_errors_over_the_rate_roll_back_client_errors_do_not_count() -> None:
    c = canary(max_error_rate=0.05)
    stats = InferStats(window=c.window)
    for _ in range(19):
        stats.succeeded(FAST_S, 0.0, FAST_S, 1)
    for _ in range(30):
        stats.failed(FAST_S, server_error=False)  # 400s: the client's fault
    stats.failed(FAST_S)  # 1 of 20: 5%, not over
    assert c.window.requests == 20 and c.check(1.0) == "hold"
    stats.failed(FAST_S)  # 2 of 21
    assert c.check(1.0) == "rollback"
    assert "error rate 9.5% (2 of 21 requests answered with a server error)" in c.reason
    assert stats.fail_count == 32  # Triton's statistics count every failure as before


def test_a_breach_ends_the_canary_before_the_window_has_lasted_step_s() -> None:
    c = canary(max_error_rate=0.0)
    answer(c, 4)
    c.window.server_errors += 1
    assert c.check(0.5) == "rollback"


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([], "at least one share"),
        ([0.5, 0.2], "must increase"),
        ([0.0, 1.0], "in (0, 1]"),
        ([0.5, 1.5], "in (0, 1]"),
    ],
)
def test_bad_canary_steps_are_one_sentence(steps: list[float], message: str) -> None:
    with pytest.raises(ConfigError, match="defaults.canary.steps") as err:
        build_serve_config({"defaults": {"canary": {"steps": steps}}}, "serve.yaml")
    assert message in err.value.message and "\n" not in err.value.message


def test_which_failures_a_candidate_is_judged_on(tmp_path: Path) -> None:
    """Through a real server: a request the server cannot answer in time (504) counts against
    the version that took it, a request with the wrong shape (400) does not."""
    from tests.integration.slow_model import NAME, build

    args = {"sleep_s": 1.0, "input_shape": [1, 8, 8], "hidden": 8, "depth": 1}
    torch.manual_seed(0)
    export = save_export(tmp_path / "export", build(**args), NAME, args, (1, 8, 8), (10,))
    cfg = ServeConfig.model_validate(
        {"drift": {"enabled": False},
         "defaults": {"isolation": "thread", "threads": 1, "timeout_ms": 100}}
    )  # fmt: skip
    app = build_app(export, cfg, name="slow", trust_code=True)
    stats = app.state.router.models["slow"].versions["1"].stats
    stats.window = window = RequestWindow()
    with running_server(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        late = c.post(
            "/v2/models/slow/infer",
            content=encode_request_bytes(np.zeros((1, 1, 8, 8), np.float32)),
            headers={"content-type": "application/json"},
        )
        bad = c.post(
            "/v2/models/slow/infer",
            content=encode_request_bytes(np.zeros((1, 3, 8, 8), np.float32)),
            headers={"content-type": "application/json"},
        )
    assert (late.status_code, bad.status_code) == (504, 400)
    assert window.server_errors == 1 and window.requests == 1 and stats.fail_count == 2


def test_the_deployment_guides_canary_config_is_a_valid_serve_config() -> None:
    import yaml

    page = Path(__file__).resolve().parents[2] / "docs" / "guides" / "deployment.md"
    block = page.read_text().split("```yaml\n# serve.yaml\n", 1)[1].split("```", 1)[0]
    cfg = build_serve_config(yaml.safe_load(block), "docs/guides/deployment.md")
    assert cfg.defaults.canary == CanaryConfig(
        steps=[0.1, 0.5, 1.0], step_s=60, min_requests=20, max_error_rate=0.01, max_p99_ms=250
    )


def test_a_window_holds_buckets_not_requests_and_its_p99_stays_within_a_bucket() -> None:
    # A step at 10,000 requests/s for minutes must not hold (and sort) one number a request.
    rng = random.Random(7)
    lat = [rng.lognormvariate(math.log(0.02), 1.0) for _ in range(200_000)]
    w = RequestWindow(started_s=0.0)
    for x in lat:
        w.add(x)
    # Latencies across 13+ doublings at 70 buckets each: far fewer buckets than requests.
    lo, hi = min(lat), max(lat)
    assert len(w.buckets) <= 70 * (math.log2(hi / lo) + 1) < 2_000
    exact = sorted(lat)[math.ceil(0.99 * len(lat)) - 1] * 1000
    assert exact <= w.p99_ms() <= exact * 2 ** (1 / 70)  # one bucket's width: 0.99%
