"""Hypothesis profiles for the fuzz harness.

`ci` (the default, used by `make test`): derandomized, so every run draws the same examples
(a seeded, bounded set: the suite stays deterministic). `long` (`HYPOTHESIS_PROFILE=long`, for
nightly runs): 25x the examples, random each run. Anything either profile finds is copied into
the test as an `@example` so it is checked on every run from then on.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,  # no wall-clock limits in tests; the CI box is shared and slow
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    "database": None,  # nothing written outside the temp folders
}
settings.register_profile("ci", derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("long", derandomize=False, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SCALE = 25 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 1


def examples(n: int) -> int:
    """`n` examples under the ci profile, 25 n under `long`."""
    return n * SCALE
