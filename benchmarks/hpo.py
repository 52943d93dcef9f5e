"""Cost-aware hyperparameter search: a small real study through the `hpo_search` Dagster job.

    python -m benchmarks.hpo [--trials 8] [--partition pystdlib] [--min-steps 8]
        [--reduction-factor 2] [--rungs 3] [--pruner asha] [--seed 0]

A fresh state folder (the partition's shards, difficulty scores and a keep-everything
curriculum, as `make demo` lays them out; MLflow sqlite, DuckDB and a local object store in it)
and the default published schedule. The job `hpo_search` (assets/hpo.py -> trainwise/hpo.py)
searches the learning rate, the micro-batch size and two schedule knobs (pruning rate, fast
policy) with Optuna's TPE sampler and ASHA: every rung of every trial is a real run of
`trainwise.runs.run_training` at the emulated provider replaying the real spot trace of
$TRAINWISE_DATA_DIR/spot (on spot: the default schedule allows it), its bill the provider's
(`gang.json`). The chosen configuration's schedule knobs become a proposal; the gate's audit of
it (before any approval) is recorded. Writes benchmarks/results/hpo.{md,json} (trials, each
trial's runs with bill and eval loss, pruned or not, the front, the proposal; command, commit,
tree state, machine) and hpo_front.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.results_io import provenance, write_atomic, write_results

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NAME = "hpo"
STUDY = "bench"
# The trainer sizes of the other emulated benchmarks (benchmarks/driver_run.py), a 2-core box.
TRAIN = {"eval_batches": 2, "eval_batch_size": 32, "fast_every_steps": 2,
         "checkpoint_every_steps": 0, "micro_batch_size": 8}


def _state(root: Path, partition: str) -> None:
    """Shards, difficulty scores and a keep-everything curriculum of `partition` under `root`."""
    from benchmarks.driver_run import workspace
    from training import scoring, shards

    workspace(root, partition)
    examples = shards.load_shards(root / "shards" / partition)
    scoring.write_scores(scoring.difficulty_scores(examples), root / "scores" / partition)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {"n_trials": args.trials, "min_steps": args.min_steps,
            "reduction_factor": args.reduction_factor, "rungs": args.rungs,
            "pruner": args.pruner, "seed": args.seed, "learning_rate_min": 3e-4,
            "learning_rate_max": 3e-2, "micro_batch_sizes": [4, 8, 16],
            "pruning_rates": [0.0, 0.15, 0.3, 0.45], "fast_policies": ["heuristic", "noop"],
            "checkpoint_interval_rules": [], "study_name": STUDY, "requested_by": "benchmark",
            "train": TRAIN}


def _rows(study: dict[str, Any]) -> list[dict[str, Any]]:
    keep = ("run_id", "steps", "bill_usd", "eval_loss", "market", "spot_share", "calls")
    return [{**{k: t[k] for k in ("number", "state", "params", "steps", "eval_loss",
                                  "run_bill_usd", "trial_bill_usd", "pruned", "stopped_by",
                                  "feasible")},
             "runs": [{k: r[k] for k in keep} for r in t["runs"]]} for t in study["trials"]]


_CHOSEN = ("number", "params", "schedule", "training", "eval_loss", "run_bill_usd",
           "trial_bill_usd", "steps", "run_id")
_REFERENCE = ("run_id", "role", "params", "steps", "eval_loss", "bill_usd", "market")


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    os.environ.update({"TRAINWISE_HOME": str(work), "TRAINWISE_TORCH_THREADS": "1",
                       "TRAINWISE_MLFLOW_URI": "", "TRAINWISE_POSTGRES_URL": "",
                       "TRAINWISE_S3_BUCKET": "", "TRAINWISE_DUCKDB_PATH": ""})
    _state(work, args.partition)
    from pipelines.headless import run_hpo_search
    from trainwise import approvals, gang, hpo, settings

    started = time.perf_counter()
    metadata = run_hpo_search(args.partition, _config(args))
    wall_s = time.perf_counter() - started
    study = hpo.read_result(work, STUDY)
    folder = work / "governance" / "schedule"
    candidate = approvals.read_candidate(folder)
    gate = approvals.gate_report(folder, settings.min_forecast_savings_usd(),
                                 settings.max_eval_loss_regression())
    first_run = Path(study["trials"][0]["runs"][0]["run_dir"])
    record = gang.read_gang(first_run) or {}
    return {
        "config": _config(args), "partition": args.partition, "wall_s": round(wall_s, 1),
        "provider": record.get("provider"), "replay": record.get("replay"),
        "data_dir": str(settings.data_dir()), "objective": study["objective"],
        "pruner": study["pruner"], "rung_steps": study["rung_steps"],
        "schedule_version": study["schedule_version"], "market": study["market"],
        "max_run_cost_usd": study["max_run_cost_usd"], "trials": _rows(study),
        "front": study["front"],
        "chosen": study["chosen"] and {k: study["chosen"][k] for k in _CHOSEN},
        "reference": study["reference"] and {k: study["reference"][k] for k in _REFERENCE},
        "eval_loss_change": study["eval_loss_change"],
        "measured_saving_usd": study["measured_saving_usd"],
        "study_bill_usd": study["study_bill_usd"], "runs_trained": study["runs_trained"],
        "proposal": None if candidate is None else {
            "hash": candidate["hash"], "to": candidate["to"], "from": candidate["from"],
            "forecast_savings_usd": candidate["forecast_savings_usd"],
            "eval_loss_change": candidate["eval_loss_change"]},
        "proposal_note": str(metadata.get("proposal", "")),
        "gate_before_approval": {"passed": gate["passed"], "status": gate["status"]},
        "notes": study["notes"], "plot_bytes": Path(study["plot"]).read_bytes(),
    }


def to_markdown(r: dict[str, Any]) -> str:
    from trainwise import hpo_report

    table = hpo_report.markdown(r)
    chosen, proposal = r["chosen"], r["proposal"]
    changed = ({k: (proposal["from"][k], v) for k, v in proposal["to"].items()
                if proposal["from"].get(k) != v} if proposal else {})
    lines = [
        "# Cost-aware hyperparameter search (`hpo_search`)", "",
        f"{len(r['trials'])} trials on `{r['partition']}`, rungs {r['rung_steps']} steps "
        f"(pruner {r['pruner']}), every rung a real run of `run_training` at the "
        f"`{r['provider']}` provider replaying `{(r['replay'] or {}).get('trace_folder')}` on "
        f"{r['market']}; the bill is the provider's. {r['runs_trained']} runs, "
        f"{r['study_bill_usd']:.4f} USD in all, {r['wall_s']:.0f} s of wall time.", "",
        "Each row: the trial's last rung (a pruned trial stopped at a lower one). Run bill: that "
        "run's bill; trial bill: all its rungs.", "", table, "",
        f"Front (trial numbers, by run bill): {r['front']}. ![front](hpo_front.png)", ""]
    if chosen:
        lines.append(f"Chosen: trial {chosen['number']}, schedule knobs {chosen['schedule']}, "
                     f"training {chosen['training']}, eval loss {chosen['eval_loss']:.4f}, run "
                     f"bill {chosen['run_bill_usd']:.4f} USD.")
    if proposal:
        lines.append(f"\nProposal {proposal['hash']}: {changed} (from -> to); forecast savings "
                     f"{proposal['forecast_savings_usd']:+.2f} USD per run (P50), eval-loss "
                     f"change {proposal['eval_loss_change']}. The gate before any approval: "
                     f"{r['gate_before_approval']['status']}.")
    else:
        lines.append(f"\nNo proposal: {r['proposal_note']}")
    if r["notes"]:
        lines.append(f"\nNotes: {'; '.join(r['notes'])}")
    lines.append("\nOn a 2-core machine shared with other work the bills carry the noise of the "
                 "trainer's wall time (the emulated provider bills node-seconds on a clock that "
                 "follows it); eval losses are deterministic for a configuration.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.hpo", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--partition", default="pystdlib")
    parser.add_argument("--min-steps", type=int, default=8)
    parser.add_argument("--reduction-factor", type=int, default=2)
    parser.add_argument("--rungs", type=int, default=3)
    parser.add_argument("--pruner", default="asha", choices=("asha", "hyperband", "none"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trainwise-hpo-") as work:
        record = run(args, Path(work))
    plot = record.pop("plot_bytes")
    write_atomic(RESULTS_DIR / "hpo_front.png", plot)
    command = ["python", "-m", "benchmarks.hpo", *(argv if argv is not None else sys.argv[1:])]
    write_results(RESULTS_DIR, NAME, record, to_markdown(record), provenance(command))
    print(to_markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
