"""Cost-aware hyperparameter search (issue 28, item 5): Optuna over real runs, pruned by ASHA.

A *study* searches the `train` job's configuration (its launchpad config, `TrainRequest`) over
training hyperparameters (learning rate, micro-batch size) and the published schedule's knobs
(pruning rate, fast policy, checkpoint-interval rule); `trainwise.hpo_space` holds the space.

- A *trial* is one configuration. Each of its *rungs* is a REAL run of the product's own run
  driver (`trainwise.runs.run_training`) at the compute provider (emulated by default, replaying
  a real spot trace) with `min_steps * reduction_factor**k` optimizer steps; its bill is the
  provider's (`gang.json` `cost_usd`), its eval loss the run's final one. A rung is a fresh run,
  not a resumed one: `run_training` refuses to train a completed run id again, and the cosine
  learning-rate schedule is sized by `max_steps`, so a run of `s` steps is what the
  configuration does at a budget of `s` steps. A run the provider interrupts (a reclaim with no
  replacement) is resumed under its run id and its bill summed over the calls.
- Each rung's eval loss is reported to the trial, and Optuna's pruner (`SuccessiveHalvingPruner`,
  asynchronous successive halving; or `HyperbandPruner`) stops trials that are behind: a pruned
  trial ran fewer steps and paid less. A promoted trial pays for its lower rungs too (the
  price of fresh rungs; with `reduction_factor` 3 at most half again).
- Cost: every run is on spot where the published schedule allows it (its allocation policy is
  not `on_demand`); a configuration whose run bill exceeds `max_run_cost_usd` (default: the
  schedule's `budget_usd`) is infeasible (TPE's `constraints_func`) and is stopped at the first
  rung that exceeds it; the search stops after the trial that spends `max_study_cost_usd`.
  Objective: the eval loss at the full budget. Choice (`trainwise.hpo_report.choose`): the
  cheapest configuration on the Pareto front of run bill against eval loss whose eval loss is
  within `loss_tolerance` of the best feasible one.
- A *reference* run then trains the chosen training hyperparameters on the schedule in force,
  so the proposal's eval-loss change and measured saving compare the two schedules alone.

Trials train in the study's own state folder `<state>/hpo/<study>/state` (the partition's shards,
difficulty scores and curriculum copied in; one curriculum built there per pruning rate), so a
search never changes the curriculum the `train` job reads, and the slow-policy sensor (which
watches `<state>/runs`) never steers a trial. Optuna's storage is SQLite at
`<state>/hpo/<study>/optuna.db` (a study of the same name continues where it stopped).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwise import gang, runs
from trainwise import schedule as schedule_lib
from trainwise.hpo_space import SCHEDULE_KNOBS, TRAINING_KNOBS, HpoError, SearchSpace, rung_steps
from trainwise.object_store import ObjectStore

HPO_FOLDER = "hpo"
PRUNERS = ("asha", "hyperband", "none")
MAX_RESUMES = 3  # an interrupted run is resumed this often before the trial fails
CURRICULUM_SEED = 0  # the curriculum asset's default seed
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class StudySpec:
    """What to search and how; see the module docstring for each rule."""

    name: str
    partition: str
    space: SearchSpace
    launchpad: dict[str, Any]  # the train job's launchpad config (TrainRunConfig.model_dump())
    instance_type: str
    region: str
    n_trials: int = 8
    min_steps: int = 10
    reduction_factor: int = 3
    rungs: int = 3
    pruner: str = "asha"
    seed: int = 0
    spot: bool = True
    max_run_cost_usd: float | None = None
    max_study_cost_usd: float | None = None
    loss_tolerance: float = 0.01
    reference_run: bool = True
    first_trials: tuple[dict[str, Any], ...] = ()  # configurations tried first (enqueued)


@dataclass(frozen=True)
class Services:
    """Where runs record: the deployment's state folder, MLflow, object store and DuckDB."""

    state_dir: Path
    tracking_uri: str
    experiment: str  # the runs go to experiment `<experiment>-hpo`
    store: ObjectStore
    duckdb_path: Path


@dataclass
class _Context:
    spec: StudySpec
    services: Services
    published: schedule_lib.Published
    rungs: list[int]
    market: str | None
    max_run_cost_usd: float
    folder: Path
    trial_state: Path
    log: Callable[[str], None]
    parent_run_id: str = ""
    spent_usd: float = 0.0
    notes: list[str] = field(default_factory=list)
    _examples: Any = None
    _scores: Any = None

    @property
    def experiment(self) -> str:
        return f"{self.services.experiment}-hpo"


def check(spec: StudySpec, published: schedule_lib.Published) -> list[int]:
    """The rung steps, or HpoError naming the field and the fix (nothing is trained first)."""
    if not isinstance(spec.n_trials, int) or isinstance(spec.n_trials, bool) or spec.n_trials < 1:
        raise HpoError(f"n_trials={spec.n_trials!r}: a search needs a trial budget of at least 1 "
                       "trial; set n_trials to a whole number >= 1")
    if not _NAME.fullmatch(spec.name or ""):
        raise HpoError(f"study_name={spec.name!r} must be 1-64 letters, digits, '.', '_' or '-', "
                       "starting with a letter or digit (it names a folder and the run ids)")
    if spec.pruner not in PRUNERS:
        raise HpoError(f"pruner={spec.pruner!r}; valid: {', '.join(PRUNERS)}")
    if not (math.isfinite(spec.loss_tolerance) and spec.loss_tolerance >= 0):
        raise HpoError(f"loss_tolerance={spec.loss_tolerance!r} must be a finite eval-loss "
                       "difference >= 0 (0: the lowest eval loss wins)")
    for name in ("max_run_cost_usd", "max_study_cost_usd"):
        value = getattr(spec, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise HpoError(f"{name}={value!r} must be > 0 USD, or unset (run: the schedule's "
                           "budget_usd; study: no limit)")
    spec.space.validate(published.schedule)
    for point in spec.first_trials:
        spec.space.check_point(point)
    steps = rung_steps(spec.min_steps, spec.reduction_factor, spec.rungs)
    try:  # the launchpad config as the train job reads it (a departure needs a reason)
        _base_request(spec, published, "check")
    except schedule_lib.ScheduleError as error:
        raise HpoError(f"the study's train config: {error}") from error
    return steps


def _base_request(spec: StudySpec, published: schedule_lib.Published, run_id: str) -> Any:
    return schedule_lib.request_from_launchpad(
        spec.launchpad, published, instance_type=spec.instance_type, partition=spec.partition,
        run_id=run_id, region=spec.region)


def _request(ctx: _Context, params: dict[str, Any], steps: int, run_id: str, why: str) -> Any:
    """The run request of `params` at `steps`: the launchpad config on the published schedule,
    the trial's schedule knobs as a recorded departure, its hyperparameters, spot if allowed."""
    base = _base_request(ctx.spec, ctx.published, run_id)
    wanted = {"fast_policy": params.get("fast_policy", base.fast_policy),
              "checkpoint_interval_rule": params.get("checkpoint_interval_rule",
                                                     base.checkpoint_interval_rule),
              "fast_levers": list(base.fast_levers)}
    departs = schedule_lib.run_departures(ctx.published, wanted)
    reason = base.schedule_override_reason
    if departs:
        reason = "; ".join(r for r in (reason, f"hpo study {ctx.spec.name} {why}: searching "
                                       f"{', '.join(sorted(departs))}") if r)
    request = schedule_lib.apply_to_request(base, ctx.published, asked=wanted,
                                            override_reason=reason)
    changes: dict[str, Any] = {"max_steps": steps, "schedule_override_reason": reason}
    changes.update({k: params[k] for k in TRAINING_KNOBS if k in params})
    if ctx.market is not None:
        changes["market"] = ctx.market
    return dataclasses.replace(request, **changes)


def _prepare(ctx: _Context) -> None:
    """The study's own state folder: the partition's inputs copied from the deployment's."""
    main, partition = Path(ctx.services.state_dir), ctx.spec.partition
    need_scores = bool(ctx.spec.space.pruning_rates)
    for part in ("shards", "scores", "curricula"):
        source, target = main / part / partition, ctx.trial_state / part / partition
        if target.is_dir():
            continue
        if not source.is_dir():
            if part == "shards":
                raise HpoError(f"no shards of partition {partition!r} at {source}: materialize "
                               f"data_shards for {partition} first (the demo job does)")
            if part == "scores" and need_scores:
                raise HpoError(f"pruning_rates needs the difficulty scores of {partition!r} "
                               f"({source} is missing): materialize difficulty_scores for "
                               f"{partition}, or leave pruning_rates empty")
            if part == "curricula" and not need_scores:
                raise HpoError(f"no curriculum of {partition!r} at {source}: materialize "
                               f"curriculum for {partition}, or search pruning_rates")
            continue
        shutil.copytree(source, target)


def _use_rate(ctx: _Context, rate: float | None) -> None:
    """Point the study state's curriculum at `rate` (built as the curriculum asset builds it);
    None: the deployment's current curriculum, copied in `_prepare`."""
    if rate is None:
        return
    from training import curriculum, scoring, shards

    partition = ctx.spec.partition
    if ctx._examples is None:
        ctx._examples = shards.load_shards(ctx.trial_state / "shards" / partition)
        ctx._scores = scoring.read_scores(ctx.trial_state / "scores" / partition)
    built = curriculum.build_curriculum(ctx._examples, ctx._scores, rate, seed=CURRICULUM_SEED)
    curriculum.write_curriculum(built, ctx.trial_state / "curricula" / partition,
                                summary=curriculum.summarize_curriculum(built, ctx._examples,
                                                                        ctx._scores))


def _bill_usd(run_dir: Path) -> float:
    record = gang.read_gang(run_dir)
    bill = None if record is None else record.get("cost_usd")
    if bill is None or not math.isfinite(float(bill)):
        raise HpoError(f"run {run_dir.name} has no provider bill in {run_dir / gang.GANG_FILE}; "
                       "the search cannot price it (see the run's pending notes)")
    return float(bill)


def train(ctx: _Context, params: dict[str, Any], steps: int, run_id: str, *, role: str,
          trial: int | None) -> dict[str, Any]:
    """One real run of `params` at `steps` (resumed when the provider interrupts it): its run
    folder, bill, eval loss, and its MLflow run(s) tagged with the study."""
    from trainwise import hpo_report

    run_dir = ctx.trial_state / "runs" / run_id
    done = runs.read_outcome(run_dir)
    if done is not None and done.get("status") == "completed":  # a continued study's run
        summary_rows = [(done, _bill_usd(run_dir))]
    else:
        why = f"trial {trial}" if trial is not None else role
        request = _request(ctx, params, steps, run_id, why)
        _use_rate(ctx, params.get("pruning_rate"))
        summary_rows = []
        for _ in range(MAX_RESUMES + 1):
            try:
                summary = runs.run_training(
                    request, state_dir=ctx.trial_state, tracking_uri=ctx.services.tracking_uri,
                    experiment=ctx.experiment, store=ctx.services.store,
                    duckdb_path=ctx.services.duckdb_path, register_model=False)
            except runs.RunInterruptedError as stopped:
                summary_rows.append((stopped.summary.metadata(), _bill_usd(run_dir)))
                ctx.log(f"{run_id} interrupted at step {stopped.summary.steps} "
                        f"({stopped.summary.status}); resuming it")
                continue
            summary_rows.append((summary.metadata(), _bill_usd(run_dir)))
            break
        else:
            raise HpoError(f"run {run_id} was interrupted {MAX_RESUMES + 1} times; its "
                           f"checkpoint is kept in {run_dir}: rerun the study to resume it")
    last = summary_rows[-1][0]
    loss = last.get("final_eval_loss")
    record = {"run_id": run_id, "role": role, "trial": trial, "steps": int(last["steps"]),
              "eval_loss": math.nan if loss is None else float(loss),
              "bill_usd": sum(bill for _, bill in summary_rows), "calls": len(summary_rows),
              "run_dir": str(run_dir), "market": last.get("market", ""),
              "spot_share": last.get("spot_share"), "params": dict(params),
              "mlflow_run_ids": [m.get("mlflow_run_id") for m, _ in summary_rows
                                 if m.get("mlflow_run_id")]}
    note = hpo_report.tag_mlflow_runs(ctx.services.tracking_uri, record, ctx.spec.name,
                                      ctx.parent_run_id)
    if note:
        ctx.notes.append(note)
    ctx.spent_usd += record["bill_usd"]
    return record


def _objective(ctx: _Context, trial: Any) -> float:
    import optuna

    params = ctx.spec.space.suggest(trial)
    trial.set_user_attr("params", params)
    records: list[dict[str, Any]] = []
    for k, steps in enumerate(ctx.rungs):
        record = train(ctx, params, steps, f"hpo-{ctx.spec.name}-t{trial.number:03d}-s{steps}",
                       role="trial", trial=trial.number)
        records.append(record)
        trial.set_user_attr("runs", records)
        trial.report(record["eval_loss"], steps)
        ctx.log(f"trial {trial.number} rung {k} ({steps} steps): eval loss "
                f"{record['eval_loss']:.4f}, bill {record['bill_usd']:.4f} USD, params {params}")
        last = k == len(ctx.rungs) - 1
        stop = ("" if last else "cost" if record["bill_usd"] > ctx.max_run_cost_usd
                else "pruner" if trial.should_prune() else "")
        if last or stop:
            # The cost constraint TPE reads (set once, when the trial ends): > 0 is infeasible.
            trial.set_constraint("run_bill_over_max_usd",
                                 record["bill_usd"] - ctx.max_run_cost_usd)
        if stop:
            trial.set_user_attr("stopped_by", stop)
            raise optuna.TrialPruned(f"{stop}: at {steps} steps, eval loss "
                                     f"{record['eval_loss']:.4f}, run bill "
                                     f"{record['bill_usd']:.4f} USD")
    return records[-1]["eval_loss"]


def _study(ctx: _Context) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = ctx.spec
    pruner: optuna.pruners.BasePruner
    if spec.pruner == "asha":
        pruner = optuna.pruners.SuccessiveHalvingPruner(
            min_resource=ctx.rungs[0], reduction_factor=spec.reduction_factor,
            min_early_stopping_rate=0)
    elif spec.pruner == "hyperband":
        pruner = optuna.pruners.HyperbandPruner(
            min_resource=ctx.rungs[0], max_resource=ctx.rungs[-1],
            reduction_factor=spec.reduction_factor)
    else:
        pruner = optuna.pruners.NopPruner()
    # TPE reads each trial's constraint (`trial.set_constraint`: > 0 is infeasible).
    sampler = optuna.samplers.TPESampler(seed=spec.seed,
                                         n_startup_trials=max(1, spec.n_trials // 2))
    storage = optuna.storages.RDBStorage(f"sqlite:///{ctx.folder / 'optuna.db'}")
    return optuna.create_study(storage=storage, study_name=spec.name, direction="minimize",
                               sampler=sampler, pruner=pruner, load_if_exists=True)


def run_study(spec: StudySpec, services: Services,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the search (see the module docstring) and returns its result, also written to
    `<state>/hpo/<study>/study.json` with the front's plot beside it."""
    from trainwise import hpo_report

    published = schedule_lib.published(Path(services.state_dir))
    steps = check(spec, published)
    base = _base_request(spec, published, "check")
    allowed = published.schedule["allocation_policy"] != "on_demand"
    market = "spot" if spec.spot and allowed and not base.allocation_policy else None
    folder = Path(services.state_dir) / HPO_FOLDER / spec.name
    ctx = _Context(spec=spec, services=services, published=published, rungs=steps,
                   market=market, max_run_cost_usd=float(spec.max_run_cost_usd or
                                                         published.schedule["budget_usd"]),
                   folder=folder, trial_state=folder / "state", log=log)
    ctx.trial_state.mkdir(parents=True, exist_ok=True)
    _prepare(ctx)
    if spec.spot and not allowed:
        ctx.notes.append("the published schedule's allocation policy is on_demand: trials run "
                         "on demand")
    ctx.parent_run_id, note = hpo_report.open_parent_run(services.tracking_uri, ctx.experiment,
                                                         spec, published.version)
    if note:
        ctx.notes.append(note)
    study = _study(ctx)
    if not study.trials:  # a fresh study: the configurations asked for first
        for point in spec.first_trials:
            study.enqueue_trial(point)
    # A continued study's earlier runs count toward max_study_cost_usd.
    ctx.spent_usd = sum(r["bill_usd"] for t in study.trials for r in t.user_attrs.get("runs", []))

    def budget_spent(study: Any, _trial: Any) -> None:
        if spec.max_study_cost_usd is not None and ctx.spent_usd >= spec.max_study_cost_usd:
            ctx.notes.append(f"stopped after {ctx.spent_usd:.4f} USD spent (max_study_cost_usd "
                             f"{spec.max_study_cost_usd:g})")
            study.stop()

    log(f"hpo study {spec.name}: {spec.n_trials} trial(s), rungs {steps} steps, pruner "
        f"{spec.pruner}, searching {', '.join(spec.space.searched())}, market "
        f"{market or base.market}, max run bill {ctx.max_run_cost_usd:g} USD")
    try:
        study.optimize(lambda trial: _objective(ctx, trial), n_trials=spec.n_trials,
                       callbacks=[budget_spent])
    except BaseException:
        hpo_report.close_parent_run(services.tracking_uri, ctx.parent_run_id, "FAILED")
        raise
    rows = [hpo_report.trial_row(t, steps[-1], ctx.max_run_cost_usd) for t in study.trials]
    chosen = hpo_report.choose(rows, spec.loss_tolerance)
    reference = None
    if chosen is not None and spec.reference_run:
        reference = _reference(ctx, chosen, rows)
    result = hpo_report.result(spec, ctx, rows, chosen, reference)
    hpo_report.finish(result, folder, services.tracking_uri, ctx.parent_run_id)
    return result


def _reference(ctx: _Context, chosen: dict[str, Any], rows: list[dict[str, Any]]
               ) -> dict[str, Any] | None:
    """The chosen training hyperparameters on the schedule in force, at the full budget (a
    completed trial with exactly these parameters stands in for it)."""
    params = {**chosen["params"], **{k: ctx.published.schedule[k] for k in SCHEDULE_KNOBS
                                     if k in chosen["params"]}}
    if params == chosen["params"]:
        return None  # the chosen configuration is on the schedule in force: nothing to compare
    for row in rows:
        if row["state"] == "COMPLETE" and row["params"] == params:
            return {**row["runs"][-1], "role": "reference (trial)"}
    digest = schedule_lib.content_hash(params)[:8]
    return train(ctx, params, ctx.rungs[-1], f"hpo-{ctx.spec.name}-ref-{digest}", role="reference",
                 trial=None)


def read_result(state_dir: Path, name: str) -> dict[str, Any]:
    """A finished study's result (`study.json`), or HpoError naming the study."""
    path = Path(state_dir) / HPO_FOLDER / name / "study.json"
    if not path.is_file():
        raise HpoError(f"no result of hpo study {name!r} at {path}: run the hpo_search job")
    return json.loads(path.read_text(encoding="utf-8"))
