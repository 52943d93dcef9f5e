"""`trainwise bench SUITE`: dispatch to a suite's `main(argv)`; `all` runs every suite."""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "cost": "benchmarks.cost",
    "cost_bound": "benchmarks.cost.bound",
    "cost_two_zone_floor": "benchmarks.cost.two_zone_floor",
    "cost_mismatch": "benchmarks.cost.mismatch",
    "controller": "benchmarks.controller_overhead",
    "fast_layer": "benchmarks.fast_layer",
    "data": "benchmarks.data",
    "emulated": "benchmarks.emulated_run",
    "faults": "benchmarks.faults.__main__",
    "cant_be_late": "benchmarks.cant_be_late.__main__",
    "cant_be_late_trainwise": "benchmarks.cant_be_late.trainwise",
    "cant_be_late_ceiling": "benchmarks.cant_be_late.ceiling",
    "stragglers_ddp": "benchmarks.stragglers_ddp",
    "stragglers_learnability": "benchmarks.stragglers_learnability",
    "time_to_quality": "benchmarks.time_to_quality.__main__",
    "rl": "benchmarks.rl.run",
    "ingestion": "benchmarks.ingestion",
    "rl_retraining": "benchmarks.rl.retraining",
    "fidelity": "benchmarks.fidelity",
    "end_to_end": "benchmarks.end_to_end",
    "end_to_end_hf": "benchmarks.end_to_end_hf",
    "hpo": "benchmarks.hpo",
    "sdk_overhead": "benchmarks.sdk_overhead",
    "trainer_speed": "benchmarks.trainer_speed",
    "cluster": "benchmarks.cluster",
    "ui_launch": "benchmarks.ui_launch",
}


def main(argv: list[str]) -> int:
    suite, rest = argv[0], argv[1:]
    names = list(SUITES) if suite == "all" else [suite]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite {unknown[0]!r}; valid: {', '.join(SUITES)}, all")
    status = 0
    for name in names:
        print(f"== benchmark: {name}")
        result = importlib.import_module(SUITES[name]).main(rest)
        # A suite returns its exit status, or its results (a dict) when it has nothing to flag.
        status |= result if isinstance(result, int) else 0
    return status


if __name__ == "__main__":  # `trainwise bench` execs `python -m benchmarks.run_all SUITE ...`
    try:
        sys.exit(main(sys.argv[1:]))
    except ValueError as error:  # an unknown suite name: say so without a traceback
        if not str(error).startswith("unknown suite"):
            raise
        print(f"trainwise bench: {error}", file=sys.stderr)
        sys.exit(2)
