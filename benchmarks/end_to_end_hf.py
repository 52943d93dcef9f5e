"""The end-to-end figure for a user's own job: the HF workload, four ways to buy the compute.

    python -m benchmarks.end_to_end_hf [--quick] [--steps 120] [--windows 8]
        [--example examples/hf_trainer] [--job NAME] [--job-arg ARG ...] [--seconds-per-tick 0.2]

`benchmarks/end_to_end.py` runs the built-in GPT; this runs a team's registered job (the first
`[jobs.NAME]` of `--example`'s project file, `trainwise.toml`: by default the Hugging Face
Trainer example, a GPT-2-style LM on text) through the product's entry for a user's job under an
allocation policy, `trainwise.user_job_supervised.supervise_user_job` (what the Launchpad's
`user_job_run` calls with `allocation_policy` set): the same supervised engine, the same real
spot-trace windows, the same four strategies (`end_to_end.STRATEGIES`: fixed on-demand,
managed_spot, uniform_progress, trainwise), the same work model (the fixed run measures this
machine's wall seconds a step, the others' deadline and progress use it), the same equal-quality
rule (every strategy's final eval loss, the job's `run.finish(eval_loss=)`, within
`end_to_end.LOSS_TOLERANCE` of fixed's, reported, never loosened) and the same tables
(`end_to_end_report.window_tables`). The registered dataset is sharded as `data_shards` shards it
(`training.user_datasets.build_user_shards`) and named in the run spec (`run.dataset()`).

What differs from the built-in rows, because the SDK's run spec cannot take it: the trainwise
strategy's trainers get the fast heuristic (the SDK's: batch from the noise scale where the
framework lets it, the answer to the notice, and a checkpoint on Young's interval for the
engine's observed preemption risk, given at each start) but not the live checkpoint interval
the slow layer writes while the job runs (`checkpoint_autotune`); each payload lists this under
`not_applied`. The checkpoint period is `driver_run.every_steps` (as the built-in rows); where
the job's registered arguments set `--max-steps` / `--checkpoint-every-steps` (both examples do,
and a job's arguments override its run spec), the benchmark's values are appended to them.

`--quick`: one window (the first of the rule, `end_to_end_windows.default_window`), 40 steps.
The full mode runs `--windows` windows of `end_to_end_windows.windows_by_rule` and reports the
mean ratio to fixed with a 95% t interval (`end_to_end.windows_payload`). Writes
benchmarks/results/end_to_end_hf.{md,json} (`benchmarks.results_io`: command, commit, dirty tree).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.driver_run import every_steps
from benchmarks.end_to_end import (
    BASELINE,
    DEFAULT_STEP_WALL_S,
    FAST_POLICY,
    LOSS_TOLERANCE,
    STRATEGIES,
    checkpoint_save_wall_s,
    compare,
    measured_step_wall_s,
    rescaled_deadline,
    strategy_record,
    windows_payload,
)
from benchmarks.end_to_end_report import (
    LEGEND,
    SUMMARY_HEADER,
    _interval_text,
    window_tables,
)
from benchmarks.end_to_end_windows import (
    WINDOW_ZONES,
    WINDOWS_PER_ZONE,
    default_window,
    notice_wall_s,
    windows_by_rule,
)
from benchmarks.results_io import provenance, write_results
from cloud import emulated as replay
from telemetry.reader import read_run_events
from trainwise import settings
from trainwise.emulated import DEFAULT_TRACE_FOLDER, DEFAULT_ZONE_FILE, EmulatedResult, ReplaySpec
from trainwise.sdk.spec import RunSpec
from trainwise.user_job_supervised import supervise_user_job
from trainwise.user_project import load_project_file

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
NAME = "end_to_end_hf"
DEFAULT_EXAMPLE = ROOT / "examples" / "hf_trainer"
QUICK_STEPS = 40
SEED = 0
NOT_APPLIED = {"trainwise": [
    "checkpoint_autotune (the live Young/Daly interval the slow layer writes while the job "
    "runs): the SDK's run spec has no live interval; the risk reaches the SDK's fast heuristic "
    "at each start, which checkpoints on Young's interval for it"]}


def fast_layer(result: EmulatedResult) -> dict[str, Any]:
    """The SDK's fast decisions (telemetry rank 0, layer "fast") and the batch changes applied
    (an SDK decision names micro_batch_size only when it changed it)."""
    folder = result.run_dir / "telemetry" / result.run_id
    if not (folder / "rank0").is_dir():
        return {"policies": [], "decisions": 0, "batch_changes": 0}
    decisions = [e for e in read_run_events(folder, rank=0)
                 if e["type"] == "decision" and e["layer"] == "fast"]
    return {"policies": sorted({d["policy"] for d in decisions}), "decisions": len(decisions),
            "batch_changes": sum("micro_batch_size" in d["action"] for d in decisions)}


def _dataset_dir(project: Any, job: Any, work_dir: Path) -> str | None:
    """The job's registered dataset as `data_shards` shards it (built once per work folder)."""
    spec = project.datasets.get(job.dataset)
    if spec is None:
        return None
    from training.user_datasets import build_user_shards

    out = work_dir / "shards" / spec.name
    if not (out / "manifest.json").is_file():
        build_user_shards(spec, out)
    return str(out)


def run(steps: int, example: Path, job_name: str | None, window: tuple[str, str, int],
        seconds_per_tick: float, work_dir: Path, max_wall_s: float = 600.0,
        job_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every strategy on one window; the window's JSON payload (`end_to_end.run`'s shape)."""
    project = load_project_file(example / "trainwise.toml")
    job = project.jobs[job_name] if job_name else next(iter(project.jobs.values()))
    # A job's own arguments override its run spec (`trainwise.init`): where they name the steps
    # or the checkpoint period, the benchmark's are appended (the last one wins in argparse).
    ours = {"--max-steps": steps, "--checkpoint-every-steps": every_steps(steps)}
    pinned = [str(a) for flag, value in ours.items() if flag in job.args for a in (flag, value)]
    job = dataclasses.replace(job, args=(*job.args, *job_args, *pinned))
    dataset_dir = _dataset_dir(project, job, work_dir)
    trace_folder, zone_file, start = window
    probe = replay.load_replay_market(trace_folder, zone_file, start, 1,
                                      settings.data_dir() / "spot")
    emulated_per_wall_s = probe.tick_s / seconds_per_tick
    changeover_s = replay.default_rules().changeover_s
    tag = f"{Path(zone_file).stem}-{start}"
    rows, first, step_wall_s = [], None, DEFAULT_STEP_WALL_S
    for name, policy, _ in STRATEGIES:
        run_id = f"e2e-hf-{name}-{tag}"
        spec = RunSpec(run_id=run_id, run_dir=str(work_dir / "runs" / run_id), max_steps=steps,
                       seed=SEED, checkpoint_every_steps=every_steps(steps),
                       store_root=str(work_dir / "objects"), dataset_dir=dataset_dir)
        out = supervise_user_job(
            job, example, spec,
            ReplaySpec(trace_folder=trace_folder, zone_files=(zone_file,),
                       window_start_tick=start, seconds_per_tick=seconds_per_tick,
                       max_wall_s=max_wall_s, step_wall_s_estimate=step_wall_s,
                       freeze_after_last_step=True),
            policy, fast_policy=FAST_POLICY.get(name) or "noop")
        result = out.figures
        if first is None:  # the baseline measures the step speed for the others
            first = result
            step_wall_s = measured_step_wall_s(result) or DEFAULT_STEP_WALL_S
            result = rescaled_deadline(result, step_wall_s, emulated_per_wall_s, changeover_s)
        rows.append(strategy_record(name, result, emulated_per_wall_s, changeover_s,
                                    checkpoint_save_wall_s(result)))
        rows[-1].update(step_wall_s_estimate=step_wall_s, fast_policy=FAST_POLICY.get(name),
                        fast_layer=fast_layer(result), job_status=out.result["status"],
                        failure=out.result["failure"][-1500:],
                        segments=[{k: s[k] for k in ("returncode", "status", "step",
                                                     "stop_reason")}
                                  for s in out.result["segments"]])
    assert first is not None and rows[0]["strategy"] == BASELINE
    payload = {"steps": steps, "example": str(example.relative_to(ROOT)
                                              if example.is_relative_to(ROOT) else example),
               "job": job.name, "entry": job.entry, "framework": job.framework,
               "job_args": list(job.args), "dataset": job.dataset, "seed": SEED,
               "trace_folder": trace_folder, "zone_file": zone_file, "window_start_tick": start,
               "seconds_per_tick": seconds_per_tick, "tick_s": probe.tick_s,
               "emulated_per_wall_s": emulated_per_wall_s,
               "notice_wall_s": notice_wall_s(probe.tick_s, seconds_per_tick),
               "step_emulated_s": step_wall_s * emulated_per_wall_s, "step_wall_s": step_wall_s,
               "trace_source": first.trace_source, "zone": first.zone,
               "instance_type": first.instance_type, "not_applied": NOT_APPLIED,
               "strategies": rows}
    payload.update(compare(rows))
    return payload


def _header(payload: dict[str, Any], windows: int) -> str:
    where = (f"from tick {payload['window_start_tick']} of `{payload['trace_source']}` "
             f"({payload['zone']}, {payload['instance_type']})" if windows == 1 else
             f"on {windows} windows by `end_to_end_windows.windows_by_rule` (fixed before any "
             "run, never by outcome)")
    job = f"`{payload['job']}` ({payload['framework']})"
    return f"""# End to end, a user's job: {job}, four ways to buy the compute

{payload['steps']} optimizer steps of the registered job `{payload['job']}` (`{payload['entry']}`
in `{payload['example']}`, seed {payload['seed']}) per strategy, {where}, through the product's
entry for a user's job under an allocation policy (`trainwise.user_job_supervised`, the
Launchpad's `user_job_run` with `allocation_policy`): the job's own process on the emulated
provider's node, SIGTERM on a reclaim, its checkpoint committed to the object store by the SDK,
the replacement resuming from the store on an empty disk, the provider's bill. The work model,
deadline, windows and tables are `benchmarks/end_to_end.py`'s. Equal quality: every strategy's
final eval loss (the job's own, `run.finish(eval_loss=)`) within {LOSS_TOLERANCE:.0%} of the
fixed schedule's: {'met by every strategy' if payload['equal_quality'] else
'**NOT met by every strategy**'}.

Not applied to this job's trainwise row (the SDK's run spec cannot take them):
{'; '.join(NOT_APPLIED['trainwise'])}.
"""


def window_markdown(payload: dict[str, Any]) -> str:
    return (f"{_header(payload, 1)}\nA step stands for {payload['step_emulated_s']:.1f} emulated s "
            f"({payload['step_wall_s']:.3f} s measured on the fixed run); notice "
            f"{payload['notice_wall_s']:.1f} s wall.\n\n{window_tables(payload)}\n{LEGEND}\n")


def windows_markdown(payload: dict[str, Any]) -> str:
    windows = payload["windows"]
    summary = "\n".join(
        f"| {name} | {_interval_text(a['cost_ratio_vs_fixed'], '.3f')} | "
        f"{_interval_text(a['trace_time_ratio_vs_fixed'], '.2f')} | "
        f"{_interval_text(a['spot_share'], '.2f')} | "
        f"{_interval_text(a['preemption_waste_share'], '.3f')} | "
        f"{_interval_text(a['eval_loss_gap'], '.4f')} | {a['target_met']}/{a['windows']} | "
        f"{a['deadline_met']}/{a['windows']} | {a['completed']}/{a['windows']} |"
        for name, a in payload["aggregate"].items())
    sections = "\n".join(
        f"## Window {k}: `{w['trace_source']}` from tick {w['window_start_tick']}\n\n"
        f"{window_tables(w)}" for k, w in enumerate(windows, 1))
    return (f"{_header(windows[0] | {'equal_quality': payload['equal_quality']}, len(windows))}"
            f"\nMean over windows, 95% t interval [low, high]; ratios to the same window's fixed "
            f"run.\n\n{SUMMARY_HEADER}\n{summary}\n\n{LEGEND}\n\n{sections}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.end_to_end_hf")
    parser.add_argument("--quick", action="store_true",
                        help=f"one window, {QUICK_STEPS} steps")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--windows", type=int, default=len(WINDOW_ZONES) * WINDOWS_PER_ZONE)
    parser.add_argument("--example", type=Path, default=DEFAULT_EXAMPLE,
                        help="a folder with a trainwise.toml project file")
    parser.add_argument("--job", default=None, help="default: the first registered job")
    parser.add_argument("--job-arg", action="append", default=[],
                        help="an argument appended to the job's own (e.g. a slower step)")
    parser.add_argument("--seconds-per-tick", type=float, default=0.2)
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    example = args.example.resolve()
    if not (example / "trainwise.toml").is_file():
        parser.error(f"{example} has no trainwise.toml (the project file registering its job)")
    steps = QUICK_STEPS if args.quick else args.steps
    windows = ([(DEFAULT_TRACE_FOLDER, DEFAULT_ZONE_FILE,
                 default_window(DEFAULT_TRACE_FOLDER, DEFAULT_ZONE_FILE))] if args.quick
               else windows_by_rule()[:args.windows])
    with tempfile.TemporaryDirectory(prefix="trainwise-e2e-hf-") as work:
        payloads = []
        for number, window in enumerate(windows, 1):
            print(f"window {number}/{len(windows)}: {window}", file=sys.stderr, flush=True)
            payloads.append(run(steps, example, args.job, window, args.seconds_per_tick,
                                Path(work), max_wall_s=300.0 if args.quick else 600.0,
                                job_args=tuple(args.job_arg)))
    if args.quick:
        payload, markdown = {"mode": "quick", **payloads[0]}, window_markdown(payloads[0])
    else:
        payload = windows_payload(payloads)  # end_to_end's: the rule, the aggregate
        markdown = windows_markdown(payload)
    write_results(Path(args.results_dir), NAME, payload, markdown,
                  provenance(["python", "-m", "benchmarks.end_to_end_hf", *argv]))
    print(markdown)
    ok = payload["equal_quality"] and all(r["status"] == "completed"
                                          for p in payloads for r in p["strategies"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
