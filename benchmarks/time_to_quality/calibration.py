"""The simulator's pruning progress model re-derived from the time-to-quality runs.

`python -m benchmarks.time_to_quality.calibration [--source time_to_quality.json] [--out DIR]`
writes `<out>/pruning_calibration.json` (`training.pruning_calibration`'s format) and a short
`pruning_calibration.md`, from the `prune_scored` lever of `time_to_quality.json`:

- per workload, per seed: the pruned run's samples to the fixed schedule's final eval loss over
  the fixed schedule's own (`samples_ratio`); a seed that never reached it counts 1.0;
- the lever's guard verdict on all seeds (`controllers.lever_guard.judge_from_calibration` on
  the CPU ratios, as the report gives it): a lever judged off is not used by the default
  configuration, so a job does the full work (1.0), whatever the ratio;
- per dataset (a simulator knows the dataset, not the regime): the largest of its workloads'
  fractions, so a saving is assumed only where every regime measured shows it.

Before this, the file came from `benchmarks.data`, which judged the saving at the end of the
same schedule (final eval loss within 1%), not at equal quality as `time_to_quality` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.results_io import provenance, write_results

CALIBRATION_FORMAT = "trainwise.pruning_calibration/1"  # training.pruning_calibration reads it
LEVER = "prune_scored"
DATASET_OF = {"shakespeare_multi": "tinyshakespeare", "shakespeare_short": "tinyshakespeare",
              "mnist": "mnist"}
RESULTS = Path(__file__).resolve().parent.parent / "results"
DEFINITION = (
    "work_fraction: per workload, the mean over seeds of the prune_scored run's samples to the "
    "fixed schedule's final eval loss (+0.002) over the fixed schedule's own, a seed that never "
    "reached it counting 1.0; 1.0 when the lever guard judges the lever off on all seeds (the "
    "default configuration then runs full data); per dataset the largest over its workloads")


def workload_fraction(block: dict[str, Any], lever: str = LEVER) -> dict[str, Any]:
    """The work fraction of one workload's summary block (see the module docstring)."""
    if lever not in block["levers"]:
        raise ValueError(f"time_to_quality summary has no {lever!r} runs for this workload; "
                         f"run `python -m benchmarks.time_to_quality --levers fixed,{lever}`")
    seeds = block["levers"][lever]["seeds"]
    ratios = [s["samples_ratio"] for s in seeds.values()]
    counted = [1.0 if r is None else float(r) for r in ratios]
    verdict = next((v for v in block.get("guard_all_seeds", []) if v["lever"] == lever), None)
    guard_on = bool(verdict and verdict["on"])
    measured = statistics.fmean(counted)
    return {
        "work_fraction": measured if guard_on else 1.0,
        "samples_ratio_mean": measured,
        "samples_ratio_std": statistics.stdev(counted) if len(counted) > 1 else 0.0,
        "seeds": len(ratios), "seeds_reached": sum(r is not None for r in ratios),
        "per_seed_samples_ratio": ratios,
        "guard": {"on": guard_on, "reason": verdict["reason"] if verdict else "not judged"},
    }


def derive(document: dict[str, Any], source: str, lever: str = LEVER) -> dict[str, Any]:
    """The calibration document from a `time_to_quality.json` document."""
    per_workload = {name: workload_fraction(block, lever)
                    for name, block in document["summary"].items() if name in DATASET_OF}
    if not per_workload:
        raise ValueError(f"{source} has none of the workloads {sorted(DATASET_OF)}")
    datasets: dict[str, Any] = {}
    for name, figures in per_workload.items():
        entry = datasets.setdefault(DATASET_OF[name], {"work_fraction": 0.0, "workloads": {}})
        entry["workloads"][name] = figures
        entry["work_fraction"] = max(entry["work_fraction"], figures["work_fraction"])
    meta = document.get("meta", {})
    return {"format": CALIBRATION_FORMAT, "method": lever, "source": source,
            "source_commit": meta.get("commit"), "source_tree_dirty": meta.get("tree_dirty"),
            "definition": DEFINITION, "datasets": datasets}


def render(calibration: dict[str, Any]) -> str:
    lines = ["# Pruning calibration (re-derived from time_to_quality)", "",
             f"Source: `{calibration['source']}` (commit {calibration['source_commit']}, "
             f"tree dirty: {calibration['source_tree_dirty']}). {DEFINITION}.", "",
             "| dataset | work_fraction | workload | samples ratio to target (mean, per seed) "
             "| guard |", "|---|---|---|---|---|"]
    for dataset, entry in calibration["datasets"].items():
        for name, f in entry["workloads"].items():
            seeds = ", ".join("never" if r is None else f"{r:.3f}"
                              for r in f["per_seed_samples_ratio"])
            lines.append(f"| {dataset} | {entry['work_fraction']:.3f} | {name} | "
                         f"{f['samples_ratio_mean']:.3f} ({seeds}) | "
                         f"{'on' if f['guard']['on'] else 'off'}: {f['guard']['reason']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.time_to_quality.calibration",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=RESULTS / "time_to_quality.json")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    document = json.loads(args.source.read_text(encoding="utf-8"))
    calibration = derive(document, str(args.source.name))
    meta = provenance()
    # training.pruning_calibration reads the top-level fields; the provenance sits beside them.
    calibration.update(command=meta.get("command"), commit=meta.get("commit"),
                       date_utc=meta.get("date_utc"))
    write_results(args.out, "pruning_calibration", calibration, render(calibration), meta)
    print(render(calibration))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
