"""`python -m benchmarks.cost` (or `trainwise bench cost`): the cost suite.

Every allocation policy and the hindsight oracle on the same windows of the real spot traces;
writes `benchmarks/results/cost.md`, `cost.json` and `cost_vs_slack.png`. See `cloud/scenarios.py`
for the settings and scenarios, `suite.py` for the run, `report.py` for the figures.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the suite (imported lazily so `python -m benchmarks.cost` imports it only once)."""
    from benchmarks.cost.__main__ import main as run

    return run(argv)
