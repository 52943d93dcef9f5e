"""`python -m benchmarks.time_to_quality` (or `trainwise bench time_to_quality`): time to quality.

For each workload a fixed-schedule baseline (fixed batch, full data) and each lever setting, the
samples, CPU-seconds and USD to reach the baseline's final eval loss, >= 3 seeds, mean and 95%
interval, and the guard's default configuration; writes `benchmarks/results/time_to_quality.md`,
`.json` and `time_to_quality.png`. See `suite.py` for the runs, `report.py` for the figures.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from benchmarks.time_to_quality.__main__ import main as run

    return run(argv)
