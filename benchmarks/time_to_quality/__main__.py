"""Command line: `python -m benchmarks.time_to_quality [--quick] [--out DIR] [--jobs N]`."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.results_io import provenance, write_results
from benchmarks.time_to_quality import report
from benchmarks.time_to_quality.suite import (
    FULL_WORKLOADS,
    LEVERS,
    QUICK_WORKLOADS,
    run_all,
    workload_records,
)

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results"
STEM = "time_to_quality"
PLOT_NAME = "time_to_quality.png"
PRICE_INSTANCE = ("g4dn.xlarge", "us-east-1")

METHOD = """\
Target: per seed, the fixed schedule's final eval loss + 0.002 (the eval's stability; the same
target for the fixed schedule's own first reach). Samples and CPU-seconds to the target:
first evaluation at or below it, interpolated from the one before. Ratios are lever / fixed
schedule on the same seed (< 1 = cheaper at equal quality); mean and Student-t 95% interval over
seeds. CPU-seconds: thread CPU time inside the training step (one torch thread; the sampler,
forward, backward and optimizer; evaluation left out), plus what a lever spends before training
(goodput's throughput profile, prune_scored's reference-model scores). USD = CPU-seconds x {price}
USD/h / 3600 ({instance} on-demand, {region}, `cloud.prices`, table {date}; the price list has no
CPU-only type, so USD ratios equal CPU ratios). The default configuration is the guard's
(`controllers.lever_guard`), judged leave-one-out over seeds; see `report.py`. `*_guarded`:
the same lever with the guard inside the run (`TrainConfig.lever_guard`, defaults: 2% loss
tolerance, 3 evaluations, after 20% of the budget), judged against the mean eval curve of the
fixed runs of the other seeds; a switched-off pruning gets the fixed schedule's sample budget."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.time_to_quality",
                                     description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="tiny models on a few examples, 3 seeds, in-process (for tests)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for shards and runs (default: a temporary folder)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per setting (>= 2)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default 2; "
                        "quick 1)")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated names (default all: "
                             f"{','.join(w.name for w in FULL_WORKLOADS)})")
    parser.add_argument("--levers", default=",".join(LEVERS),
                        help=f"comma-separated; must include fixed (default {','.join(LEVERS)})")
    parser.add_argument("--reuse", type=Path, action="append", default=[],
                        help="a previous time_to_quality.json (repeatable; a later file's run "
                             "of the same workload, lever and seed wins): keep its runs of the "
                             "levers not in --levers, run only --levers ('none': run nothing)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cloud.prices import PRICE_TABLE_DATE, on_demand_price

    workloads = QUICK_WORKLOADS if args.quick else FULL_WORKLOADS
    if args.workloads:
        wanted = args.workloads.split(",")
        unknown = set(wanted) - {w.name for w in workloads}
        if unknown:
            raise SystemExit(f"unknown workload(s) {sorted(unknown)}; valid: "
                             f"{', '.join(w.name for w in workloads)}")
        workloads = tuple(w for w in workloads if w.name in wanted)
    levers = () if args.levers == "none" else tuple(args.levers.split(","))
    names = {w.name for w in workloads}
    reused: dict[tuple[str, str, int], dict[str, Any]] = {}
    for path in args.reuse:
        for r in json.loads(path.read_text(encoding="utf-8"))["runs"]:
            if r["lever"] not in levers and r["workload"] in names and r["seed"] < args.seeds:
                reused[(r["workload"], r["lever"], r["seed"])] = r
    kept = list(reused.values())
    all_levers = tuple(x for x in LEVERS if x in levers or any(r["lever"] == x for r in kept))
    if "fixed" not in all_levers or set(levers) - set(LEVERS):
        raise SystemExit(f"--levers {args.levers!r} must include fixed and use only {LEVERS}")
    if args.seeds < 2:
        raise SystemExit(f"--seeds {args.seeds}: an interval needs at least 2 seeds (3 advised)")
    jobs = args.jobs or (1 if args.quick else 2)
    seeds = tuple(range(args.seeds))
    price = on_demand_price(*PRICE_INSTANCE)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ttq-") as scratch:
        work = args.work or Path(scratch)
        runs = kept + run_all(workloads, levers, seeds, work, jobs,
                              log=lambda line: print(line, file=sys.stderr), reused=kept)
    summary = report.summarize(runs, all_levers, price)
    payload: dict[str, Any] = {
        "quick": args.quick, "seeds": list(seeds), "levers": list(all_levers), "jobs": jobs,
        "reused_runs_from": [str(p) for p in args.reuse],
        "price": {"instance": PRICE_INSTANCE[0], "region": PRICE_INSTANCE[1],
                  "usd_per_hour": price, "table_date": PRICE_TABLE_DATE},
        "workloads": workload_records(workloads), "summary": summary, "runs": runs,
        "timing": {"suite_wall_s": time.perf_counter() - began},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    plot = report.plot(runs, args.out / PLOT_NAME)
    markdown = render_markdown(payload, plot is not None)
    write_results(args.out, STEM, json.loads(json.dumps(payload, default=float)), markdown,
                  provenance())
    print(markdown)
    return 0


def render_markdown(payload: dict[str, Any], plotted: bool) -> str:
    price = payload["price"]
    run_wall_min = sum(r["wall_s"] for r in payload["runs"]) / 60
    reused = payload.get("reused_runs_from") or []
    parts = ["# Time to quality: training levers against the fixed schedule", "",
             f"{len(payload['seeds'])} seeds per setting; one torch thread per run; "
             f"{len(payload['runs'])} runs, {run_wall_min:.0f} min of run wall time in all (on a "
             "shared 2-core machine: wall times are not the measure, thread CPU time is). Each "
             "process first trains every workload untimed (20 steps), and the settings run in an "
             "order rotated per seed, so that no setting always runs first."
             + (f" Runs taken from {', '.join(reused)}." if reused else "")
             + (" QUICK MODE: tiny models, not a result." if payload["quick"] else ""), "",
             METHOD.format(price=price["usd_per_hour"], instance=price["instance"],
                           region=price["region"], date=price["table_date"]), ""]
    for workload in payload["workloads"]:
        name = workload["name"]
        block = payload["summary"].get(name)
        if block is None:
            continue
        parts += [f"## {name}", "", f"{workload['description']}.", "",
                  report.render_table(block["levers"]), "", "Guard on all seeds:"]
        parts += [f"- {v['lever']}: {'on' if v['on'] else 'off'}: {v['reason']}"
                  for v in block["guard_all_seeds"] if block["levers"][v["lever"]]["seeds"]]
        offs = [f"{r['lever']} s{r['seed']}: {o['lever']} off at step {o['step']} of "
                f"{r['steps']} ({o['reason']})" for r in payload["runs"]
                if r["workload"] == name for o in r.get("guard_switch_offs", [])]
        guarded = [r for r in payload["runs"] if r["workload"] == name
                   and r["lever"].endswith("_guarded")]
        if guarded:
            parts.append(f"- in-run guard: {len(offs)} switch-off(s) in {len(guarded)} guarded "
                         "runs" + (":" if offs else ""))
            parts += [f"  - {line}" for line in offs]
        default = block["levers"]["default"]["cpu_ratio"]
        if default["high"] is not None:
            ok = default["high"] <= 1.0 + 1e-12 and default["reached"] == default["seeds"]
            parts.append(f"- default never worse than fixed (upper end <= 1.0x): "
                         f"{'met' if ok else 'NOT met'}")
        parts.append("")
    parts += [f"Plot: `{PLOT_NAME}` (eval loss against CPU-seconds and against samples)."
              if plotted else "Plot: not written (matplotlib missing)."]
    return "\n".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
