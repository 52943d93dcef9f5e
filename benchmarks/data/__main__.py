"""Command line of the data suite: `python -m benchmarks.data [--quick] [--out DIR] [--jobs N]`."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.data import report
from benchmarks.data.suite import (
    ANNEAL_FRACTION,
    FULL_SPECS,
    METHODS,
    PRUNING_RATE,
    QUICK_SPECS,
    run_all,
    spec_records,
)
from benchmarks.results_io import provenance, write_atomic, write_results

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results"
STEM = "data"
PLOT_NAME = "data_eval_loss_vs_samples.png"
# The simulator's calibration (pruning_calibration.json) is derived from the time_to_quality runs
# (`python -m benchmarks.time_to_quality.calibration`); this suite's own work fractions go to a file
# of their own so that re-running it never overwrites that calibration.
CALIBRATION_NAME = "data_work_fractions.json"

BUDGET = f"""\
Budget: the same number of epochs for every method, with the same learning-rate schedule over
epochs (linear warmup, cosine to lr/10). A pruned epoch counts as one epoch but costs fewer
sample passes (a left-out example is not forward-passed): this is InfoBatch's protocol, so the
full-data run's sample passes are the budget and a pruning method's saving is the share it did
not spend. First reach of the full-data loss: sample passes at the first evaluation whose eval
loss is at or below the final eval loss of the full-data run with the same seed, as a share of
the full-data budget, and relative to the sample passes the full-data run itself needed to
first get there (the goal's measure: "fewer sample passes to reach the full-data loss"); a
seed that never gets there counts 1.0 (no saving). Evaluations every `eval_every_steps`
optimizer steps (the resolution of that figure) and at the end. Pruning rate {PRUNING_RATE}
(InfoBatch's default; the trainwise policy's maximum); anneal: epochs that end in the last
{ANNEAL_FRACTION} of the budget train on full data. Sampler overhead: time in the dynamic
sampler (draws, loss table, consumption record, control file, slow tick) less the time the
plain sampler takes for the same batches, as a share of the run's training-step time. Wall
times are of 2 runs in parallel on a 2-core machine shared with other work: indicative only."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="tiny models on 256 train examples, 1 seed, in-process (for tests)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for shards and runs (default: <TRAINWISE_HOME>/bench/data; "
                             "quick: a temporary folder)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds per method (default 3; quick 1)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="parallel worker processes, one torch thread each "
                             "(default 2; quick 1)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated (default all: {','.join(METHODS)}; needs full)")
    parser.add_argument("--datasets", default=None,
                        help="comma-separated partitions (default tinyshakespeare,mnist)")
    parser.add_argument("--render-only", action="store_true",
                        help="no training: recompute the summary, table, plot and calibration "
                             "from the runs stored in <out>/data.json (keeps its provenance)")
    return parser.parse_args(argv)


def render_markdown(payload: dict[str, Any]) -> str:
    rows = payload["summary"]
    parts = ["# Data selection at the same budget: full data, random, InfoBatch, trainwise", ""]
    parts.append(f"{len(payload['seeds'])} seeds ({', '.join(map(str, payload['seeds']))}) per "
                 f"method; mean ± standard deviation over seeds. {payload['jobs']} runs in "
                 f"parallel, 1 torch thread each; suite wall time "
                 f"{payload['timing']['suite_wall_s'] / 60:.1f} min." +
                 (" QUICK MODE: tiny models on 256 examples, not a result." if payload["quick"]
                  else ""))
    parts += ["", BUDGET, ""]
    for spec in payload["datasets"]:
        name = spec["name"]
        parts += [f"## {name}", "", f"{spec['description']}. Split: {payload['splits'][name]}", "",
                  report.render_table(rows, name), ""]
        full = next((r for r in rows if r["dataset"] == name and r["method"] == "full"), None)
        if full is not None and full["budget_fraction_mean"] < 0.9:
            parts += [(f"Full data itself first reached its final eval loss at "
                      f"{full['budget_fraction_mean']:.0%} of its budget (mean over seeds): the "
                      "eval curve is flat and noisy over the rest, so the budget is longer than "
                      "this model needs and first-reach shares of the budget mostly measure "
                      "noise; the column relative to full data's own first reach (used for the "
                      "goals) compares like with like."), ""]
        for row in (r for r in rows if r["dataset"] == name and r["method"] != "full"):
            parts.append(_goal_line(row))
        shares = ", ".join(
            f"{r['method']} {r['same_quality_fraction_mean']:.3f} ± "
            f"{r['same_quality_fraction_std']:.3f}"
            for r in rows if r["dataset"] == name and r["method"] != "full")
        parts += ["", f"Work at full-data quality over the same epochs (share of the full-data "
                      f"budget; a seed whose final loss is more than 1% above, or accuracy more "
                      f"than 0.3 points below, its full-data run counts 1.0): {shares}. The "
                      f"trainwise figure is recorded in `{CALIBRATION_NAME}` (the simulator's calibration "
                      f"comes from `time_to_quality`)."]
        parts.append("")
        parts.append(_pruning_line(rows, name, spec["epochs"]))
        parts.append("")
    parts += ["## What limits the savings", "", *payload["limits"], "",
              (f"Plot: `{PLOT_NAME}`. Work fractions: `{CALIBRATION_NAME}` (the trainwise work "
              "fraction per dataset, source runs named; the simulator reads pruning_calibration.json, "
              "derived from time_to_quality).")]
    return "\n".join(parts)


def _goal_line(row: dict[str, Any]) -> str:
    goal = row["goal"]
    checks = [(f"≥40% fewer sample passes to the full-data loss: "
              f"{'yes' if goal['fewer_samples_40pct'] else 'no'} "
              f"({row['reach_vs_full_mean']:.2f}x the full-data run's passes to first reach "
              f"it)"),
              (f"final loss within 1%: {'yes' if goal['loss_within_1pct'] else 'no'} "
              f"({row['loss_vs_full_rel']:+.2%})")]
    if goal["accuracy_within_0p3"] is not None:
        within = "yes" if goal["accuracy_within_0p3"] else "no"
        checks.append(f"accuracy within 0.3 points: {within}")
    if goal["beats_random"] is not None:
        checks.append(f"lower final loss than random: {'yes' if goal['beats_random'] else 'no'}")
    return f"- **{row['method']}**: " + "; ".join(checks) + "."


def _pruning_line(rows: list[dict[str, Any]], dataset: str, epochs: int) -> str:
    notes = []
    for row in (r for r in rows if r["dataset"] == dataset and r["method"] != "full"):
        if row["pruned_epoch_rate_mean"] is None:
            notes.append(f"{row['method']} pruned no epoch")
            continue
        notes.append(f"{row['method']} pruned {row['pruned_epochs_per_run']:.1f} of the "
                     f"{epochs} epochs per run at a mean rate "
                     f"{row['pruned_epoch_rate_mean']:.2f}, leaving out "
                     f"{row['pruned_epoch_skip_share_mean']:.1%} of the examples in those epochs")
    return "Pruning: " + "; ".join(notes) + "."


def limits(rows: list[dict[str, Any]], specs: list[dict[str, Any]]) -> list[str]:
    """The measured reasons the savings stop where they do."""
    lines = []
    for spec in specs:
        name, epochs = spec["name"], spec["epochs"]
        by_method = {r["method"]: r for r in rows if r["dataset"] == name}
        info, full = by_method.get("infobatch"), by_method.get("full")
        if info is None or full is None or info["pruned_epoch_skip_share_mean"] is None:
            continue
        prunable = info["pruned_epochs_per_run"]
        ceiling = prunable * info["pruned_epoch_skip_share_mean"] / epochs
        lines.append(
            f"- {name}, the epoch structure: of {epochs} epochs, epoch 0 trains on full data "
            f"(no losses yet: equal scores for InfoBatch, no eval for the trainwise guard) and "
            f"the anneal takes the last; {prunable:.1f} are pruned, each leaving out rate x share "
            f"below the mean = {info['pruned_epoch_skip_share_mean']:.1%} of the examples, so the "
            f"saving at the same epochs is at most {ceiling:.1%} at rate {PRUNING_RATE} "
            f"(measured {1 - info['samples_share_mean']:.1%}). InfoBatch's ~40% comes from "
            "200-epoch runs in which nearly every example is well learned.")
        random = by_method.get("random")
        if full["budget_fraction_mean"] < 0.9:
            lines.append(
                f"- {name}, a redundant budget: the full-data run first reaches its own final "
                f"loss at {full['budget_fraction_mean']:.0%} of the budget; every pruning method "
                f"ends at full-data quality with {info['samples_share_mean']:.0%} of the passes or "
                "more, but "
                + ("random pruning does as well as InfoBatch (final eval loss "
                   f"{random['final_eval_loss_mean']:.4f} vs {info['final_eval_loss_mean']:.4f}): "
                   "the saving comes from fewer passes over a model that has converged, not from "
                   "choosing examples; a shorter full-data budget would save as much"
                   if random is not None
                   and random["final_eval_loss_mean"] <= info["final_eval_loss_mean"]
                   else "a shorter full-data budget would save a similar share")
                + f". The seed-to-seed spread of the full-data final eval loss "
                f"({full['final_eval_loss_std'] / full['final_eval_loss_mean']:.0%} of its mean) "
                "is larger than the 1% quality bar, so at 3 seeds the final-loss differences "
                "between methods are not significant.")
        else:
            lines.append(
                f"- {name}, an underfit model: the full-data run improves until its last "
                f"evaluation, so every pass left out costs loss: "
                + ", ".join(f"{m} {by_method[m]['loss_vs_full_rel']:+.2%} at "
                            f"{by_method[m]['samples_share_mean']:.0%} of the passes"
                            for m in ("random", "infobatch", "trainwise") if m in by_method)
                + ". Per sample pass the pruned runs learn no faster than full data (final "
                "eval loss against the full-data run's after as many passes: "
                + ", ".join(f"{m} {by_method[m]['loss_vs_full_same_passes_mean']:+.2%}"
                            for m in ("random", "infobatch", "trainwise") if m in by_method)
                + "): they stop sooner. Loss-based selection does not beat random selection "
                "here: per-example losses are close together, so a below-mean example is not a "
                "learned one.")
        trainwise = by_method.get("trainwise")
        if trainwise is not None and trainwise["pruned_epoch_rate_mean"] is not None:
            lines.append(
                f"- {name}, the trainwise policy: mean rate {trainwise['pruned_epoch_rate_mean']:.2f}"
                f" in the epochs it pruned (the rate scales with the loss table's std/mean over "
                "0.5 and halves on a flat or rising eval curve), so it saves "
                f"{1 - trainwise['samples_share_mean']:.0%} of the passes at "
                f"{trainwise['loss_vs_full_rel']:+.2%} final loss.")
    lines.append(
        "- Reaching the full-data loss early is limited by the schedule: every method anneals "
        "its learning rate over the same epochs, so the eval loss falls fastest at the end for "
        "all of them; a pruned run of an underfit model reaches the full-data final loss, if at "
        "all, only at its own end.")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        return render_only(args.out, argv)
    started = time.perf_counter()
    specs = QUICK_SPECS if args.quick else FULL_SPECS
    if args.datasets:
        wanted = args.datasets.split(",")
        unknown = [d for d in wanted if d not in {s.name for s in specs}]
        if unknown:
            raise SystemExit(f"unknown dataset {unknown[0]!r}; valid: "
                             f"{', '.join(s.name for s in specs)}")
        specs = tuple(s for s in specs if s.name in wanted)
    methods = tuple(args.methods.split(","))
    bad = [m for m in methods if m not in METHODS]
    if bad or "full" not in methods:
        raise SystemExit(f"--methods must name some of {', '.join(METHODS)}, including full "
                         f"(the reference); got {args.methods!r}")
    seeds = tuple(range(args.seeds if args.seeds else (1 if args.quick else 3)))
    jobs = args.jobs if args.jobs else (1 if args.quick else 2)
    temporary = None
    if args.work is not None:
        work = args.work
    elif args.quick:
        temporary = tempfile.TemporaryDirectory(prefix="bench-data-")
        work = Path(temporary.name)
    else:
        from trainwise import settings

        work = settings.home_dir() / "bench" / "data"
    try:
        results = run_all(specs, methods, seeds, work, jobs,
                          log=lambda line: print(line, file=sys.stderr, flush=True))
        payload = build_payload(args, specs, methods, seeds, jobs, results, work, started)
    finally:
        if temporary is not None:
            temporary.cleanup()
    meta = provenance(_command(argv))
    payload["timing"]["suite_wall_s"] = time.perf_counter() - started
    write_outputs(args.out, payload, meta)
    return 0


def _command(argv: list[str] | None) -> list[str]:
    return ["python", "-m", "benchmarks.data", *(argv if argv is not None else sys.argv[1:])]


def write_outputs(out: Path, payload: dict[str, Any], meta: dict[str, Any]) -> None:
    """data.md, data.json, the plot and the calibration file, each written atomically."""
    report.plot_curves(payload["runs"], out / PLOT_NAME)
    markdown = render_markdown(payload)
    json_path, md_path = write_results(out, STEM, payload, markdown, meta)
    calibration = report.calibration(payload["summary"], meta, source=f"{STEM}.json")
    write_atomic(out / CALIBRATION_NAME,
                 (json.dumps(calibration, indent=1, default=report.finite) + "\n").encode())
    print(markdown)
    print(f"wrote {md_path}, {json_path}, {out / PLOT_NAME} and {out / CALIBRATION_NAME}")


def render_only(out: Path, argv: list[str] | None) -> int:
    """Recompute every figure from the stored runs (no training); the runs' provenance stays."""
    path = out / f"{STEM}.json"
    if not path.is_file():
        raise SystemExit(f"no {path} to render from: run `python -m benchmarks.data` first")
    payload = json.loads(path.read_text())
    meta = payload.pop("meta")
    meta["rendered_by"] = " ".join(_command(argv))
    payload["summary"] = report.summarize(payload["runs"])
    payload["limits"] = limits(payload["summary"], payload["datasets"])
    payload["budget_definition"] = BUDGET
    write_outputs(out, payload, meta)
    return 0


def build_payload(args, specs, methods, seeds, jobs, results, work, started) -> dict[str, Any]:
    from benchmarks.data.suite import load_examples

    splits = {}
    for spec in specs:
        examples = load_examples(spec, work / "shards" / spec.name)
        ids = examples.example_ids
        splits[spec.name] = (
            f"{len(examples.train_positions):,} train / {len(examples.eval_positions):,} eval "
            f"examples (eval ids {int(ids[examples.eval_positions].min())}.."
            f"{int(ids[examples.eval_positions].max())}"
            + (", the corpus's contiguous tail" if examples.kind == "text"
               else ", every 10th image") + "), fixed in the shards")
    summary = report.summarize(results)
    spec_list = spec_records(specs)
    return {
        "quick": args.quick, "methods": list(methods), "seeds": list(seeds), "jobs": jobs,
        "torch_threads_per_run": 1, "pruning_rate": PRUNING_RATE,
        "anneal_fraction": ANNEAL_FRACTION, "budget_definition": BUDGET,
        "datasets": spec_list, "splits": splits, "summary": summary,
        "limits": limits(summary, spec_list), "runs": results, "work_dir": str(work),
        "timing": {"suite_wall_s": time.perf_counter() - started},
    }


if __name__ == "__main__":
    sys.exit(main())
