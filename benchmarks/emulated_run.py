"""One job on the emulated cloud: real trainer processes, a real spot trace replayed fast.

    python -m benchmarks.emulated_run [--steps 60] [--policy trainwise_heuristic]
        [--partition pystdlib] [--window-start-tick N] [--seconds-per-tick 0.2]
        [--object-store]

The job runs through the product's driver (`trainwise.runs.run_training`, the `train` job's
function) with the request's `allocation_policy` set to `--policy` (`benchmarks/driver_run.py`):
the `emulated` provider (`cloud/providers/emulated.py`), the trainer as a child process, every
checkpoint uploaded to the run's local object store, a stopped node's disk deleted and each
replacement restored from the store, MLflow and DuckDB as for any run. (`--object-store` is
accepted for old command lines: the store is always on now.)

Without `--window-start-tick` the first window of the trace (after tick 200) where spot is up
for 4 ticks and then reclaimed is replayed, so the run meets at least one preemption. Writes
benchmarks/results/emulated_run.{md,json} (command, commit, machine).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.driver_run import run_job, workspace
from benchmarks.results_io import provenance, write_results
from cloud import emulated as replay
from cloud.traces import FOLDER_MEANING, load_trace
from trainwise import settings
from trainwise.emulated import DEFAULT_TRACE_FOLDER, DEFAULT_ZONE_FILE, ReplaySpec, result_record

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NAME = "emulated_run"


def default_window(folder: str, zone_file: str) -> int:
    path = settings.data_dir() / "spot" / folder / zone_file
    if not path.exists():
        return 0  # the synthetic fallback; the result says so in trace_source
    trace = load_trace(path, FOLDER_MEANING[folder])
    return replay.find_drop_window(trace.available, up_ticks=4, max_down_ticks=10, min_start=200)


def to_markdown(r: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {h['kind']} | {h['launch_s']:.0f} | {h['end_s']:.0f} | {h['price_usd_per_hour']:.3f} "
        f"| {h['end_reason']} |" for h in r["holdings"])
    return f"""# Emulated cloud: one job

Provider `{r['provider']}`{' with checkpoints restored from the object store' if r['object_store'] else ''}.
Real trainer processes on this machine; the spot trace `{r['trace_source']}` ({r['zone']},
{r['instance_type']}) replayed from tick {r['window_start_tick']} at {r['seconds_per_tick']} s of
wall time per trace tick. A reclaim sends SIGTERM to the trainer's pid; it checkpoints and exits;
the allocation policy `{r['policy']}` decides when (and on what) the job resumes.

| figure | value |
|---|---|
| status | {r['status']} ({r['steps']}/{r['max_steps']} steps) |
| preemptions (SIGTERM) | {r['preemptions']} |
| resumes from a checkpoint | {r['resumes']} |
| launches | {r['launches']} |
| notices missed (SIGKILL) | {r['notices_missed']} |
| spot share of node time | {r['spot_share']:.2f} |
| cost | {r['cost_usd']:.4f} USD (spot {r['spot_usd_per_hour']:.3f}, on-demand \
{r['on_demand_usd_per_hour']:.2f} USD/h) |
| finish / deadline (emulated) | {r['finish_s']} s / {r['deadline_s']:.0f} s |
| final eval loss | {r['final_eval_loss']} |
| wall time | {r['wall_s']:.1f} s |

Billing: each holding from launch (changeover of 360 s included) to its end, per emulated second.

| node | launch_s | end_s | USD/h | ended |
|---|---|---|---|---|
{rows}
"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.emulated_run")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--policy", default="trainwise_heuristic")
    parser.add_argument("--partition", default="pystdlib")
    parser.add_argument("--window-start-tick", type=int, default=None)
    parser.add_argument("--seconds-per-tick", type=float, default=0.2)
    parser.add_argument("--object-store", action="store_true",
                        help="kept for old command lines: replacements always restore from the "
                             "run's local object store (disks are lost)")
    args = parser.parse_args(argv)
    start = (args.window_start_tick if args.window_start_tick is not None
             else default_window(DEFAULT_TRACE_FOLDER, DEFAULT_ZONE_FILE))
    with tempfile.TemporaryDirectory(prefix="trainwise-emulated-") as work:
        result = run_job(workspace(Path(work), args.partition), args.partition,
                         max_steps=args.steps, policy_name=args.policy, run_id="emulated-bench",
                         replay=ReplaySpec(window_start_tick=start,
                                           seconds_per_tick=args.seconds_per_tick))
        record = result_record(result)
    record["provider"] = "emulated"
    record["object_store"] = True
    record["driver"] = "trainwise.runs.run_training (supervised engine)"
    record.pop("run_dir")  # a temporary folder, gone now
    record.pop("trainer_pids")
    write_results(RESULTS_DIR, NAME, record, to_markdown(record),
                  provenance(["python", "-m", "benchmarks.emulated_run", *argv]))
    print(to_markdown(record))
    return 0 if result.status == "completed" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
