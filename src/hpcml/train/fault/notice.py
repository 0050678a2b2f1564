"""Cloud preemption notices: a thread polls the instance-metadata endpoint of a spot/preemptible
VM and, when the provider announces the VM's end, raises the same preemption flag a SIGTERM
or SIGUSR1 raises (checkpoint at the next step boundary, exit 75).

Providers and the documented responses read here:
- aws: `GET /latest/meta-data/spot/instance-action` (IMDSv2: a token from
  `PUT /latest/api/token` first); 404 while nothing is planned, then JSON
  `{"action": "terminate" | "stop" | "hibernate", "time": "..."}` (two minutes' warning).
- gcp: `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google`;
  `FALSE`, then `TRUE` once the VM is being preempted (about 30 s before the stop).
- azure: `GET /metadata/scheduledevents?api-version=2020-07-01` with `Metadata: true`;
  JSON `{"DocumentIncarnation": n, "Events": [{"EventType": "Preempt", ...}]}` (Spot eviction
  is `Preempt`; `Terminate` is a deletion).

The requests are three small GETs with fixed headers, so the standard library's urllib does
them; no HTTP client dependency is added for this.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable

DEFAULT_BASE = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
_TIMEOUT_S = 2.0


def _get(url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=_TIMEOUT_S) as resp:  # noqa: S310 - fixed URL
            return int(resp.status), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), ""


def poll_aws(base: str) -> str | None:
    status, token = _get(
        f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, "PUT"
    )
    headers = {"X-aws-ec2-metadata-token": token} if status == 200 else {}
    status, body = _get(f"{base}/latest/meta-data/spot/instance-action", headers)
    if status != 200:
        return None  # 404: no interruption planned
    try:
        action = json.loads(body)
    except json.JSONDecodeError:
        return None
    if isinstance(action, dict) and action.get("action") in ("terminate", "stop", "hibernate"):
        return f"an AWS spot interruption notice ({action['action']} at {action.get('time')})"
    return None


def poll_gcp(base: str) -> str | None:
    status, body = _get(
        f"{base}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"}
    )
    if status == 200 and body.strip().upper() == "TRUE":
        return "a GCP preemption notice (instance/preempted is TRUE)"
    return None


def poll_azure(base: str) -> str | None:
    status, body = _get(
        f"{base}/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"}
    )
    if status != 200:
        return None
    try:
        doc = json.loads(body)
    except json.JSONDecodeError:
        return None
    for event in doc.get("Events", []) if isinstance(doc, dict) else []:
        if isinstance(event, dict) and event.get("EventType") in ("Preempt", "Terminate"):
            return (
                f"an Azure scheduled event ({event['EventType']}, not before "
                f"{event.get('NotBefore') or 'unknown'})"
            )
    return None


POLLERS: dict[str, Callable[[str], str | None]] = {
    "aws": poll_aws,
    "gcp": poll_gcp,
    "azure": poll_azure,
}


class NoticeWatcher:
    """A daemon thread: every `every_s` asks the provider; on a notice calls `on_notice` once
    with what was announced. Unreachable endpoints are retried (a metadata server can answer
    503 during host maintenance); the first failure is reported through `warn`."""

    def __init__(
        self,
        provider: str,
        on_notice: Callable[[str], None],
        every_s: float = 5.0,
        base_url: str | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.poll = POLLERS[provider]
        self.provider = provider
        self.base = (base_url or DEFAULT_BASE[provider]).rstrip("/")
        self.every_s = every_s
        self.on_notice = on_notice
        self.warn = warn
        self.notice: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcml-notice", daemon=True)

    def start(self) -> NoticeWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=_TIMEOUT_S * 3)

    def _run(self) -> None:
        warned = False
        while not self._stop.is_set():
            try:
                found = self.poll(self.base)
            except (OSError, ValueError) as exc:
                found = None
                if not warned and self.warn is not None:
                    self.warn(
                        f"cannot read {self.provider} preemption notices from {self.base} "
                        f"({type(exc).__name__}: {exc}); retrying every {self.every_s:g} s."
                    )
                    warned = True
            if found is not None:
                self.notice = found
                self.on_notice(found)
                return
            self._stop.wait(self.every_s)
