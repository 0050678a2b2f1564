"""A stepped canary of the version an alias moved to, judged by SLOs on its own requests.

`Canary` walks a candidate through `CanaryConfig.steps` (its share of unversioned requests;
the serving version takes the rest). Each step's window is the candidate's requests since the
step began: a `RequestWindow` on its `InferStats`, which `run_infer` feeds as requests end, so
the verdict rests on the candidate's own answers, never on the other version's. At each check
(`AliasFollower` checks at every registry poll):

- a window of at least `min_requests` whose server-error rate or p99 latency breaches the SLO
  ends the canary: `rollback`;
- a step that has lasted `step_s` with at least `min_requests` and no breach passes: `next`,
  or `done` after the last step;
- otherwise `hold`. With fewer than `min_requests` requests a step never passes nor fails: a
  server with no traffic keeps both versions until traffic comes to judge the candidate.

The follower applies the verdicts (traffic, retiring a version, the registry record); this
module holds no router and does no I/O, so its rules are tested on their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from hpcml.serve.config import CanaryConfig
from hpcml.serve.runtime.model_stats import RequestWindow

Verdict = Literal["hold", "next", "done", "rollback"]


def breach(window: RequestWindow, slo: CanaryConfig) -> str | None:
    """Why the window breaches the SLO, or None (also when it is too small to judge)."""
    n = window.requests
    if n < slo.min_requests:
        return None
    if window.error_rate > slo.max_error_rate:
        return (
            f"error rate {window.error_rate:.1%} ({window.server_errors} of {n} requests "
            f"answered with a server error) is over the SLO's {slo.max_error_rate:.1%}"
        )
    p99 = window.p99_ms()
    if slo.max_p99_ms is not None and p99 is not None and p99 > slo.max_p99_ms:
        return (
            f"p99 latency {p99:.1f} ms (over {window.answered} answered requests) is over "
            f"the SLO's {slo.max_p99_ms:g} ms"
        )
    return None


@dataclass
class Canary:
    candidate: str
    previous: str
    slo: CanaryConfig
    step: int = 0
    window: RequestWindow = field(default_factory=RequestWindow)
    reason: str = ""
    """Why it was rolled back (empty until then)."""

    @property
    def share(self) -> float:
        return self.slo.steps[self.step]

    def weights(self) -> dict[str, float]:
        """The traffic policy of the current step."""
        return {self.previous: 1.0 - self.share, self.candidate: self.share}

    def check(self, now_s: float) -> Verdict:
        """The verdict on the current step's window at monotonic time `now_s`; a passed step
        starts the next one's window (the caller attaches it to the candidate's stats)."""
        why = breach(self.window, self.slo)
        if why is not None:
            where = f"step {self.step + 1} of {len(self.slo.steps)} ({self.share:.0%} of traffic)"
            self.reason = f"at {where} {why}"
            return "rollback"
        if (
            now_s - self.window.started_s < self.slo.step_s
            or self.window.requests < self.slo.min_requests
        ):
            return "hold"
        if self.step + 1 == len(self.slo.steps):
            return "done"
        self.step += 1
        self.window = RequestWindow(started_s=now_s)
        return "next"

    def evidence(self) -> dict[str, Any]:
        """The numbers behind the verdict, for the registry's tags and the admin status."""
        p99 = self.window.p99_ms()
        return {
            "candidate": self.candidate,
            "previous": self.previous,
            "step": self.step + 1,
            "steps": len(self.slo.steps),
            "share": self.share,
            "requests": self.window.requests,
            "server_errors": self.window.server_errors,
            "p99_ms": None if p99 is None else round(p99, 3),
            "max_error_rate": self.slo.max_error_rate,
            "max_p99_ms": self.slo.max_p99_ms,
        }
