"""What a study (`trainwise.hpo`) found: trials, the Pareto front, the choice, the proposal.

- `trial_row`: one Optuna trial as the result holds it (its runs, bills, eval loss, pruned);
- `pareto_front` / `choose`: the non-dominated completed, feasible trials by (run bill, eval
  loss), and the cheapest of them within `loss_tolerance` of the best eval loss;
- `finish`: the front's plot (`front.png`) and `study.json`, written atomically, and the study's
  MLflow parent run closed with both;
- `proposed_schedule` / `propose`: the chosen configuration's schedule knobs as a schedule
  proposal (`trainwise.approvals.propose`), the gate `schedule_approved` audits it as any
  schedule_change; its eval-loss change is measured against the reference run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from training.safe_files import save_figure_atomic, write_atomic
from trainwise import approvals
from trainwise import schedule as schedule_lib
from trainwise.hpo_space import SCHEDULE_KNOBS, TRAINING_KNOBS

STUDY_TAG = "trainwise/hpo_study"
TRIAL_TAG = "trainwise/hpo_trial"
ROLE_TAG = "trainwise/hpo_role"
PARENT_TAG = "mlflow.parentRunId"  # nests the trial runs under the study's run in the MLflow UI
OBJECTIVE = ("minimise the eval loss at the full budget; constraint: run bill <= "
             "max_run_cost_usd; choice: the cheapest Pareto-front trial within loss_tolerance "
             "of the best eval loss")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def trial_row(trial: Any, full_steps: int, max_run_cost_usd: float) -> dict[str, Any]:
    """One Optuna FrozenTrial: its configuration, runs (one per rung reached), figures."""
    runs = list(trial.user_attrs.get("runs", []))
    last = runs[-1] if runs else {}
    bill = last.get("bill_usd", math.nan)
    return {"number": trial.number, "state": trial.state.name,
            "params": dict(trial.user_attrs.get("params", trial.params)), "runs": runs,
            "steps": int(last.get("steps", 0)), "eval_loss": last.get("eval_loss", math.nan),
            "run_bill_usd": bill, "trial_bill_usd": sum(r["bill_usd"] for r in runs),
            "pruned": trial.state.name == "PRUNED",
            "stopped_by": trial.user_attrs.get("stopped_by", ""),
            "feasible": _finite(bill) and bill <= max_run_cost_usd,
            "full_budget": int(last.get("steps", 0)) >= full_steps}


def dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """a is no dearer and no worse than b, and better in one."""
    return (a["run_bill_usd"] <= b["run_bill_usd"] and a["eval_loss"] <= b["eval_loss"]
            and (a["run_bill_usd"] < b["run_bill_usd"] or a["eval_loss"] < b["eval_loss"]))


def _pool(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["state"] == "COMPLETE" and r["feasible"]
            and _finite(r["eval_loss"])]


def pareto_front(rows: list[dict[str, Any]]) -> list[int]:
    """Trial numbers of the completed, feasible trials no other such trial dominates, by
    run bill (ascending)."""
    pool = _pool(rows)
    front = [r for r in pool if not any(dominates(o, r) for o in pool if o is not r)]
    return [r["number"] for r in sorted(front, key=lambda r: (r["run_bill_usd"], r["eval_loss"]))]


def choose(rows: list[dict[str, Any]], loss_tolerance: float) -> dict[str, Any] | None:
    """The cheapest front trial whose eval loss is within `loss_tolerance` of the best; None
    when no trial completed within the cost constraint."""
    pool = _pool(rows)
    if not pool:
        return None
    front = set(pareto_front(rows))
    best = min(r["eval_loss"] for r in pool)
    near = [r for r in pool if r["number"] in front and r["eval_loss"] <= best + loss_tolerance]
    row = min(near, key=lambda r: (r["run_bill_usd"], r["eval_loss"]))
    return {**row, "schedule": {k: row["params"][k] for k in SCHEDULE_KNOBS if k in row["params"]},
            "training": {k: row["params"][k] for k in TRAINING_KNOBS if k in row["params"]},
            "run_id": row["runs"][-1]["run_id"]}


def result(spec: Any, ctx: Any, rows: list[dict[str, Any]], chosen: dict[str, Any] | None,
           reference: dict[str, Any] | None) -> dict[str, Any]:
    import dataclasses

    compared = chosen is not None and reference is not None
    reference_bill = (reference["bill_usd"] if reference and reference["role"] == "reference"
                      else 0.0)
    return {
        "study": spec.name, "partition": spec.partition, "objective": OBJECTIVE,
        "pruner": spec.pruner, "reduction_factor": spec.reduction_factor,
        "rung_steps": ctx.rungs, "n_trials_asked": spec.n_trials, "seed": spec.seed,
        "space": dataclasses.asdict(spec.space), "searched": spec.space.searched(),
        "schedule_version": ctx.published.version, "schedule": ctx.published.schedule,
        "market": ctx.market or "(as the train config says)",
        "max_run_cost_usd": ctx.max_run_cost_usd, "max_study_cost_usd": spec.max_study_cost_usd,
        "loss_tolerance": spec.loss_tolerance, "trials": rows, "front": pareto_front(rows),
        "chosen": chosen, "reference": reference,
        "eval_loss_change": (chosen["eval_loss"] - reference["eval_loss"]) if compared else None,
        "measured_saving_usd": (reference["bill_usd"] - chosen["run_bill_usd"]) if compared
        else None,
        "study_bill_usd": sum(r["trial_bill_usd"] for r in rows) + reference_bill,
        "runs_trained": sum(len(r["runs"]) for r in rows) + (1 if reference_bill else 0),
        "storage": str(ctx.folder / "optuna.db"), "trial_state": str(ctx.trial_state),
        "experiment": ctx.experiment, "mlflow_parent_run_id": ctx.parent_run_id,
        "notes": ctx.notes,
    }


def _client(tracking_uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def open_parent_run(tracking_uri: str, experiment: str, spec: Any, schedule_version: str
                    ) -> tuple[str, str]:
    """(the study's MLflow run id, a note when MLflow could not be written)."""
    from trainwise import tracking

    try:
        client = _client(tracking_uri)
        experiment_id = tracking.experiment_id(client, tracking_uri, experiment, None,
                                               tracking.mlflow_caller(tracking_uri))
        run = client.create_run(experiment_id, run_name=f"hpo-{spec.name}", tags={
            STUDY_TAG: spec.name, ROLE_TAG: "study", "partition": spec.partition,
            "trainwise/schedule_version": schedule_version})
        for key, value in (("hpo/pruner", spec.pruner), ("hpo/n_trials", spec.n_trials),
                           ("hpo/searched", ",".join(spec.space.searched())),
                           ("hpo/reduction_factor", spec.reduction_factor),
                           ("hpo/seed", spec.seed)):
            client.log_param(run.info.run_id, key, value)
        return run.info.run_id, ""
    except Exception as error:  # noqa: BLE001 - MLflow down must not stop the search
        return "", f"study run not opened in MLflow ({type(error).__name__}: {error})"


def close_parent_run(tracking_uri: str, parent: str, status: str) -> None:
    """Ends the study's MLflow run (a failed search must not leave it RUNNING)."""
    if parent:
        try:
            _client(tracking_uri).set_terminated(parent, status)
        except Exception:  # noqa: BLE001 - the search's own error is the one to raise
            pass


def tag_mlflow_runs(tracking_uri: str, record: dict[str, Any], study: str, parent: str) -> str:
    """Each MLflow run of `record` grouped under the study (tags), its bill and eval loss as
    `hpo/*` metrics on the last; a note when MLflow could not be written."""
    ids = record["mlflow_run_ids"]
    if not ids:
        return f"run {record['run_id']} has no MLflow run to tag"
    try:
        client = _client(tracking_uri)
        tags = {STUDY_TAG: study, ROLE_TAG: record["role"],
                TRIAL_TAG: "" if record["trial"] is None else str(record["trial"]),
                "trainwise/hpo_params": json.dumps(record["params"], sort_keys=True)[:500]}
        if parent:
            tags[PARENT_TAG] = parent
        for run_id in ids:
            for key, value in tags.items():
                client.set_tag(run_id, key, value)
        for key in ("bill_usd", "eval_loss", "steps"):
            client.log_metric(ids[-1], f"hpo/{key}", float(record[key]))
        return ""
    except Exception as error:  # noqa: BLE001 - the run and its bill are on disk
        return f"MLflow tags of {record['run_id']} not written ({type(error).__name__}: {error})"


def plot_front(res: dict[str, Any], path: Path) -> Path:
    """Eval loss against run bill: every trial, the front, the choice and the reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, front = res["trials"], res["front"]
    by_number = {r["number"]: r for r in rows}
    figure, axis = plt.subplots(figsize=(7, 4.5))
    groups = (("completed", lambda r: r["state"] == "COMPLETE" and r["feasible"], "o", "C0"),
              ("over max_run_cost_usd", lambda r: r["state"] == "COMPLETE" and not r["feasible"],
               "s", "C1"),
              ("pruned (at its last rung, fewer steps)", lambda r: r["pruned"], "x", "0.5"))
    for label, keep, marker, colour in groups:
        shown = [r for r in rows if keep(r) and _finite(r["eval_loss"])]
        if shown:
            axis.scatter([r["run_bill_usd"] for r in shown], [r["eval_loss"] for r in shown],
                         marker=marker, color=colour, label=label, zorder=3)
        for r in shown:
            axis.annotate(f"t{r['number']} ({r['steps']})", (r["run_bill_usd"], r["eval_loss"]),
                          fontsize=7, xytext=(3, 3), textcoords="offset points")
    if front:
        points = [(by_number[n]["run_bill_usd"], by_number[n]["eval_loss"]) for n in front]
        axis.step([p[0] for p in points], [p[1] for p in points], where="post", color="C3",
                  label="Pareto front", zorder=2)
    if res["chosen"]:
        axis.scatter([res["chosen"]["run_bill_usd"]], [res["chosen"]["eval_loss"]], marker="*",
                     s=220, color="C3", label="chosen", zorder=4)
    ref = res["reference"]
    if ref and _finite(ref["eval_loss"]):
        axis.scatter([ref["bill_usd"]], [ref["eval_loss"]], marker="D", color="k", zorder=4,
                     label="chosen hyperparameters on the schedule in force")
    axis.set_xlabel("run bill (USD, the provider's)")
    axis.set_ylabel(f"eval loss (at the run's steps, in brackets; full budget "
                    f"{res['rung_steps'][-1]})")
    axis.set_title(f"hpo study {res['study']}: eval loss against cost")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    return save_figure_atomic(figure, path)


def _clean(value: Any) -> Any:
    """NaN and infinities as null: study.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def finish(res: dict[str, Any], folder: Path, tracking_uri: str, parent: str) -> None:
    """The plot and study.json (atomic), and the study's MLflow run closed with both."""
    res["plot"] = str(plot_front(res, Path(folder) / "front.png"))
    res["result_path"] = str(Path(folder) / "study.json")
    if parent:
        try:
            client = _client(tracking_uri)
            metrics = {"hpo/study_bill_usd": res["study_bill_usd"],
                       "hpo/trials": len(res["trials"]),
                       "hpo/pruned": sum(r["pruned"] for r in res["trials"])}
            if res["chosen"]:
                metrics.update({"hpo/chosen_eval_loss": res["chosen"]["eval_loss"],
                                "hpo/chosen_run_bill_usd": res["chosen"]["run_bill_usd"]})
            for key, value in metrics.items():
                client.log_metric(parent, key, float(value))
            client.log_artifact(parent, res["plot"])
            client.log_text(parent, json.dumps(_clean(res), indent=1, default=str),
                            "study.json")
            client.set_terminated(parent)
        except Exception as error:  # noqa: BLE001 - the files are written below either way
            res["notes"].append(f"study run not closed in MLflow ({type(error).__name__}: "
                                f"{error})")
    write_atomic(Path(res["result_path"]),
                 json.dumps(_clean(res), indent=1, default=str).encode("utf-8"))


def proposed_schedule(folder: Path, res: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(the schedule to propose, "") or (None, why nothing is proposed)."""
    current = approvals.current_schedule(folder)
    if schedule_lib.version_of(current) != res["schedule_version"]:
        return None, (f"the published schedule changed during the search ({res['schedule_version']}"
                      f" -> {schedule_lib.version_of(current)}): run the study again on it")
    chosen = res["chosen"]
    if chosen is None:
        return None, ("no trial completed within max_run_cost_usd "
                      f"({res['max_run_cost_usd']:g} USD): nothing to propose")
    to = schedule_lib.validate({**current, **chosen["schedule"]})
    if to == current:
        return None, (f"the chosen trial {chosen['number']} is on the schedule in force: nothing "
                      f"to propose (its training hyperparameters: {chosen['training']})")
    return to, ""


def propose(folder: Path, res: dict[str, Any], to: dict[str, Any], *,
            forecast_savings_usd: float, forecast_rows: dict[str, Any], reason: str,
            requested_by: str) -> dict[str, Any]:
    """The chosen schedule knobs as a proposal for the gate (`approvals.propose`)."""
    chosen, ref = res["chosen"], res["reference"]
    detail = (f"trial {chosen['number']} ({chosen['run_id']}) eval loss "
              f"{chosen['eval_loss']:.4f} at {chosen['steps']} steps on the proposed schedule"
              + (f" vs {ref['eval_loss']:.4f} for the same hyperparameters on the schedule in "
                 f"force ({ref['run_id']})" if ref else "; no reference run"))
    evidence = {"source": f"hpo study {res['study']}", "detail": detail,
                "runs": f"{len(res['trials'])} trials, {res['runs_trained']} runs, "
                        f"{sum(r['pruned'] for r in res['trials'])} pruned",
                "chosen": _clean({k: chosen[k] for k in ("number", "run_id", "params",
                                                         "eval_loss", "run_bill_usd", "steps")}),
                "reference": _clean({k: ref[k] for k in ("run_id", "eval_loss", "bill_usd",
                                                         "steps")}) if ref else None,
                "measured_saving_usd": res["measured_saving_usd"],
                "study_result": res.get("result_path", ""), "forecast": forecast_rows}
    why = reason or (f"hpo study {res['study']}: trial {chosen['number']} "
                     f"{chosen['schedule']} (training {chosen['training']})")
    return approvals.propose(folder, to, forecast_savings_usd=forecast_savings_usd,
                             eval_loss_change=res["eval_loss_change"], evidence=evidence,
                             reason=why, requested_by=requested_by)


def markdown(res: dict[str, Any]) -> str:
    """The trials and the front as a table (Dagster metadata, the benchmark's page)."""
    front, chosen = set(res["front"]), res["chosen"]
    lines = ["| trial | state | steps | eval loss | run bill USD | trial bill USD | front | "
             "params |", "|---|---|---|---|---|---|---|---|"]
    for r in res["trials"]:
        mark = "chosen" if chosen and r["number"] == chosen["number"] else (
            "yes" if r["number"] in front else "")
        state = r["state"].lower() + (f" ({r['stopped_by']})" if r["stopped_by"] else "")
        loss = f"{r['eval_loss']:.4f}" if _finite(r["eval_loss"]) else "-"
        bill = f"{r['run_bill_usd']:.4f}" if _finite(r["run_bill_usd"]) else "-"
        params = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in sorted(r["params"].items()))
        lines.append(f"| {r['number']} | {state} | {r['steps']} | {loss} | {bill} | "
                     f"{r['trial_bill_usd']:.4f} | {mark} | {params} |")
    ref = res["reference"]
    if ref:
        lines.append(f"\nReference (chosen hyperparameters on the schedule in force): "
                     f"{ref['run_id']}, eval loss {ref['eval_loss']:.4f}, bill "
                     f"{ref['bill_usd']:.4f} USD; eval-loss change of the proposal "
                     f"{res['eval_loss_change']:+.4f}, measured saving "
                     f"{res['measured_saving_usd']:+.4f} USD per run.")
    lines.append(f"\nStudy bill {res['study_bill_usd']:.4f} USD over {res['runs_trained']} runs; "
                 f"rungs {res['rung_steps']} steps, pruner {res['pruner']}; "
                 f"objective: {res['objective']}.")
    return "\n".join(lines)
