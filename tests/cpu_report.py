"""Sum the per-test CPU seconds that `HPCML_TEST_CPU=FILE pytest ...` wrote, per test file.

    HPCML_TEST_CPU=/tmp/cpu.jsonl make test; python tests/cpu_report.py /tmp/cpu.jsonl [--write]

The total CPU seconds divided by the cores is the least wall time the suite can take on them;
the top files are where cutting pays. `--write` stores the wall seconds of each unit of work (a
test file, or one docs page) in tests/cost.json, which tests/conftest.py uses to start the
longest units first: how long a unit holds its worker is what balancing needs (a SLURM test
waits on the scheduler with little CPU of its own), so write it from a `make test` run on an
otherwise idle machine.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

COST_FILE = Path(__file__).with_name("cost.json")


def unit_of(nodeid: str) -> str:
    """The unit of work a test ran in (tests/conftest.py's `unit_of`): its file, or the test
    itself for a docs page."""
    own = "tests/integration/test_docs_commands.py::test_the_page_commands_run_as_written["
    return nodeid if nodeid.startswith(own) else nodeid.split("::", 1)[0]


def main(path: str, write: bool = False, top: int = 40) -> None:
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    tests = []
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            name = unit_of(rec["nodeid"])
            cpu[name] += rec["cpu_s"]
            wall[name] += rec["wall_s"]
            count[name] += 1
            tests.append(rec)
    total = sum(cpu.values())
    print(f"{len(tests)} tests, {total:.0f} CPU s in all ({total / 2 / 60:.1f} min on 2 cores)")
    print(f"{'cpu_s':>8} {'wall_s':>8} {'n':>4}  file")
    for name in sorted(cpu, key=cpu.get, reverse=True)[:top]:  # type: ignore[arg-type]
        print(f"{cpu[name]:8.1f} {wall[name]:8.1f} {count[name]:4d}  {name}")
    print("\nslowest tests by CPU:")
    for rec in sorted(tests, key=lambda r: r["cpu_s"], reverse=True)[:top]:
        print(f"{rec['cpu_s']:8.1f} {rec['wall_s']:8.1f}  {rec['nodeid']}")
    if write:
        # Whole seconds: the order is what matters, and small changes should not churn the file.
        cost = {name: round(wall[name]) for name in sorted(wall) if wall[name] >= 1}
        COST_FILE.write_text(json.dumps(cost, indent=1, sort_keys=True) + "\n")
        print(f"wrote {COST_FILE} ({len(cost)} units)")


if __name__ == "__main__":
    main(sys.argv[1], write="--write" in sys.argv[2:])
