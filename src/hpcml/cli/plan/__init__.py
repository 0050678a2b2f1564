"""`hpcml plan ...`: predict memory, communication, step time, layout and cost, and check the
predictions against measured runs. One module per verb; shared options in `options`."""

from hpcml.cli.plan import (  # noqa: F401  (each module registers its verbs)
    advise,
    check,
    comm,
    cost,
    memory,
    models,
    owned,
    step,
)
from hpcml.cli.plan.options import app, cost_app, parse_size

__all__ = ["app", "cost_app", "parse_size"]
