"""A served model's versions and the policy that splits its traffic between them.

`TrafficPolicy` (version weights and an optional shadow) is immutable and checked as a whole
by `check_policy` (known versions, finite non-negative weights normalised to sum 1, a shadow
that is not the only version answering); `ServedModel` holds the versions and the policy in
force with its history, which the router swaps in one step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcml.serve.codec.oip import TensorSpec
from hpcml.serve.config import ModelServeConfig, normalise_weights
from hpcml.serve.runtime.batcher import DynamicBatcher
from hpcml.serve.runtime.model_stats import InferStats
from hpcml.serve.runtime.repository import sorted_versions


class NotFound(Exception):
    """Unknown model or version (HTTP 404)."""


class PolicyError(Exception):
    """A traffic change that cannot be applied (HTTP 400)."""


@dataclass(frozen=True)
class TrafficPolicy:
    weights: dict[str, float]
    shadow_version: str | None = None
    shadow_fraction: float = 1.0

    def describe(self) -> dict[str, Any]:
        return {
            "traffic": dict(self.weights),  # normalised when the policy was checked
            "shadow": (
                {"version": self.shadow_version, "fraction": self.shadow_fraction}
                if self.shadow_version
                else None
            ),
        }


@dataclass
class ShadowStats:
    requests: int = 0
    dropped: int = 0
    failed: int = 0
    samples: int = 0
    disagreements: int = 0
    max_abs_diff: float = 0.0
    latency_s_sum: float = 0.0
    primary_latency_s_sum: float = 0.0

    def describe(self) -> dict[str, Any]:
        n = max(self.requests - self.dropped - self.failed, 0)
        return {
            "requests": self.requests,
            "dropped": self.dropped,
            "failed": self.failed,
            "samples": self.samples,
            "disagreements": self.disagreements,
            "disagreement_rate": self.disagreements / self.samples if self.samples else None,
            "max_abs_diff": self.max_abs_diff,
            "mean_latency_s": self.latency_s_sum / n if n else None,
            "mean_primary_latency_s": self.primary_latency_s_sum / n if n else None,
        }


@dataclass
class ModelVersion:
    model: str
    version: str
    export_dir: Path
    backend_name: str
    platform: str
    input: TensorSpec
    output: TensorSpec
    config: ModelServeConfig
    batcher: DynamicBatcher
    started: bool = False
    stats: InferStats = field(default_factory=InferStats)

    @property
    def ready(self) -> bool:
        """Started and some instance alive: false at once when its only process dies."""
        return self.started and self.batcher.running and self.batcher.healthy

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.model,
            "versions": [self.version],
            "platform": self.platform,
            "inputs": [self.input.metadata()],
            "outputs": [self.output.metadata()],
        }


@dataclass
class ServedModel:
    name: str
    versions: dict[str, ModelVersion]
    policy: TrafficPolicy
    history: list[TrafficPolicy] = field(default_factory=list)
    shadow_stats: dict[str, ShadowStats] = field(default_factory=dict)
    canary: dict[str, Any] | None = None
    """The canary in flight under `--follow` (`Canary.evidence()`), else None."""

    @property
    def newest(self) -> ModelVersion:
        return self.versions[sorted_versions(list(self.versions))[-1]]

    def version(self, version: str | None) -> ModelVersion:
        if version is None:
            return self.newest
        found = self.versions.get(version)
        if found is None:
            raise NotFound(
                f"model '{self.name}' has no version '{version}'; it has "
                f"{', '.join(sorted_versions(list(self.versions)))}."
            )
        return found

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": {
                v: {
                    "backend": mv.backend_name,
                    "export_dir": str(mv.export_dir),
                    "ready": mv.ready,
                    "queue_depth": mv.batcher.queue_depth,
                }
                for v in sorted_versions(list(self.versions))
                for mv in (self.versions[v],)
            },
            **self.policy.describe(),
            "can_roll_back": bool(self.history),
            "shadow_stats": {v: s.describe() for v, s in self.shadow_stats.items()},
            "canary": self.canary,
        }


def check_policy(model: ServedModel, policy: TrafficPolicy) -> TrafficPolicy:
    """`policy` with its weights normalised, or PolicyError saying what is wrong with it."""
    unknown = [v for v in policy.weights if v not in model.versions]
    if policy.shadow_version is not None and policy.shadow_version not in model.versions:
        unknown.append(policy.shadow_version)
    if unknown:
        raise PolicyError(
            f"model '{model.name}' has no version {unknown[0]!r}; it has "
            f"{', '.join(sorted_versions(list(model.versions)))}."
        )
    try:
        weights = normalise_weights(policy.weights)
    except ValueError as exc:
        raise PolicyError(f"traffic of model '{model.name}': {exc}.") from None
    if not math.isfinite(policy.shadow_fraction) or not 0.0 < policy.shadow_fraction <= 1.0:
        raise PolicyError("shadow fraction must be in (0, 1].")
    shadow = policy.shadow_version
    if shadow is not None and all(v == shadow for v, w in policy.weights.items() if w > 0):
        # The router never mirrors a request to the version that answers it.
        raise PolicyError(
            f"shadow version {shadow!r} of model '{model.name}' also takes all of its traffic, "
            "so no request would be mirrored; send the traffic to another version or shadow "
            "another one."
        )
    return TrafficPolicy(weights, policy.shadow_version, policy.shadow_fraction)
