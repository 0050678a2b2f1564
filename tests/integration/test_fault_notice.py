"""Spot and cloud preemption notices: a loopback HTTP server plays each provider's metadata
endpoint with its documented responses (and refuses requests without the headers the real
ones require); the watcher must find the notice, and a training run must stop on it exactly as
on a preemption signal (checkpoint, exit 75)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fault_util import config_dict, records, run_engine, summary

from hpcml.train.checkpoint import store as ckpt
from hpcml.train.fault.notice import NoticeWatcher

AZURE_EVENT = {
    "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
    "EventType": "Preempt",
    "ResourceType": "VirtualMachine",
    "Resources": ["spot-vm-0"],
    "EventStatus": "Scheduled",
    "NotBefore": "Mon, 23 Nov 2026 13:00:30 GMT",
    "Description": "",
    "EventSource": "Platform",
    "DurationInSeconds": -1,
}


class Metadata:
    """What the fake endpoint answers: nothing planned for the first `quiet` polls, then the
    provider's notice."""

    def __init__(self, provider: str, quiet: int) -> None:
        self.provider = provider
        self.quiet = quiet
        self.polls = 0
        self.refused = 0

    def answer(self, method: str, path: str, headers: Any) -> tuple[int, str]:
        if self.provider == "aws":
            if method == "PUT" and path == "/latest/api/token":
                return 200, "AQAEAFakeToken=="
            if path != "/latest/meta-data/spot/instance-action":
                return 404, ""
            if headers.get("X-aws-ec2-metadata-token") != "AQAEAFakeToken==":
                self.refused += 1
                return 401, ""  # IMDSv2 only
            self.polls += 1
            if self.polls <= self.quiet:
                return 404, ""
            return 200, json.dumps({"action": "terminate", "time": "2026-11-23T13:02:00Z"})
        if self.provider == "gcp":
            if headers.get("Metadata-Flavor") != "Google":
                self.refused += 1
                return 403, ""
            if path != "/computeMetadata/v1/instance/preempted":
                return 404, ""
            self.polls += 1
            return 200, "FALSE" if self.polls <= self.quiet else "TRUE"
        if headers.get("Metadata") != "true":
            self.refused += 1
            return 400, ""
        if path != "/metadata/scheduledevents?api-version=2020-07-01":
            return 404, ""
        self.polls += 1
        events = [] if self.polls <= self.quiet else [AZURE_EVENT]
        return 200, json.dumps({"DocumentIncarnation": self.polls, "Events": events})


@pytest.fixture
def endpoint(request: pytest.FixtureRequest) -> Iterator[tuple[str, Metadata]]:
    provider, quiet = request.param
    meta = Metadata(provider, quiet)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            status, body = meta.answer(self.command, self.path, self.headers)
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PUT = _reply  # noqa: N815 - http.server's naming

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", meta
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        (("aws", 2), "an AWS spot interruption notice (terminate at 2026-11-23T13:02:00Z)"),
        (("gcp", 2), "a GCP preemption notice (instance/preempted is TRUE)"),
        (("azure", 2), "an Azure scheduled event (Preempt, not before Mon, 23 Nov 2026"),
    ],
    indirect=["endpoint"],
)
def test_the_watcher_reads_each_providers_notice(
    endpoint: tuple[str, Metadata], expected: str
) -> None:
    url, meta = endpoint
    seen: list[str] = []
    watcher = NoticeWatcher(meta.provider, seen.append, every_s=0.05, base_url=url).start()
    try:
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watcher.stop()
    assert len(seen) == 1 and seen[0].startswith(expected), seen
    # It kept asking while nothing was planned, with the headers the provider requires.
    assert meta.polls == 3 and meta.refused == 0


@pytest.mark.parametrize("endpoint", [("gcp", 4)], indirect=True)
def test_a_training_run_stops_on_a_notice_like_on_a_signal(
    endpoint: tuple[str, Metadata], tmp_path: Path
) -> None:
    url, _ = endpoint
    run = tmp_path / "run"
    cfg = config_dict(
        train={"max_steps": 100_000, "checkpoint_every": 0, "checkpoint_every_s": 3600},
        fault={"preempt_notice": "gcp", "preempt_notice_url": url, "preempt_notice_every_s": 0.1},
    )
    kind, message = run_engine(cfg, run)
    assert kind == "Preempted", message
    assert message.startswith("preempted by a GCP preemption notice")
    (event,) = [e for e in records(run, "fault") if e["event"] == "preempted"]
    saved = Path(event["checkpoint"])
    assert ckpt.verify(saved) is None and ckpt.step_of(saved) == event["step"]
    assert summary(run)["status"] == "preempted" and summary(run)["checkpoint"] == str(saved)
