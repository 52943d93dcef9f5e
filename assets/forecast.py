"""`cost_forecast`: what each registered job, and a generic next run, will cost.

Your jobs (issue 28, item 4): one row per `train` partition, sized from its measured throughput
(its earlier runs' telemetry, else a probe of its first steps: `trainwise.job_forecast`), its
deadline and its region's market: P50/P90 USD and hours, the throughput and where it came from.
The schedules: the generic next run (TRAINWISE_FORECAST_WORK_GPU_H) under the current schedule,
each other allocation policy and a pending proposal, as the schedule gate compares them.

Monte Carlo over the real spot traces (`cloud/forecast.py`; the embedded market when
$TRAINWISE_DATA_DIR/spot is missing). The metadata carries both tables, the deadline risk, the
plot (inline in the markdown, and its file), and the figures also go to MLflow (experiment
`<experiment>-forecast`). The blocking check `p90_within_budget` fails (ERROR) when a job's P90
exceeds the published schedule's budget_usd; with no job sized it warns on the generic run's.
The `train` launch itself is refused over budget (`trainwise.job_forecast.launch_gate`).
"""


import base64
import json
from pathlib import Path

import dagster as dg

from assets.partitions import DATA_PARTITIONS
from assets.resources import MLflowResource, StateResource
from cloud import forecast as forecast_lib
from cloud.policy_registry import policy_names
from training.safe_files import write_atomic
from trainwise import approvals, job_forecast, settings
from trainwise import schedule as schedule_lib

CURRENT = "current"


def next_run() -> tuple[float, float, int]:
    """(work GPU-h before pruning, deadline s, samples) of the next run, from the settings."""
    work = settings.get_float("TRAINWISE_FORECAST_WORK_GPU_H", 0.0)
    if work <= 0:
        raise settings.SettingError("TRAINWISE_FORECAST_WORK_GPU_H must be above 0")
    deadline_s = settings.get_float("TRAINWISE_FORECAST_DEADLINE_H", 0.0) * 3600.0
    return work, deadline_s, settings.get_int("TRAINWISE_FORECAST_SAMPLES", 1, 100_000)


def market(state: StateResource) -> forecast_lib.MarketSource:
    return forecast_lib.load_market(state.data_dir() / "spot",
                                    settings.get("TRAINWISE_SPOT_TRACES"))


def scenario(schedule: dict, base_work_gpu_h: float) -> tuple[str, float]:
    return (schedule["allocation_policy"],
            forecast_lib.work_for_rate(base_work_gpu_h, schedule["pruning_rate"]))


def schedule_savings(current: dict, to: dict, state: StateResource
                     ) -> tuple[float, dict[str, dict]]:
    """(forecast P50 saving in USD of `to` over `current`, each scenario's forecast row): what a
    schedule proposal records (schedule_change and the HPO search's proposal alike)."""
    work, deadline_s, samples = next_run()
    results = forecast_lib.forecast(
        {"current": scenario(current, work), "proposed": scenario(to, work)},
        deadline_s, market(state), samples=samples)
    return (results["current"].p50_usd - results["proposed"].p50_usd,
            {k: v.row() for k, v in results.items()})


def table_md(rows: list[dict]) -> str:
    head = "| scenario | policy | work GPU-h | P50 USD | P90 USD | mean USD | deadline risk |\n"
    head += "|---|---|---|---|---|---|---|\n"
    return head + "\n".join(
        f"| {r['label']} | {r['policy']} | {r['work_gpu_h']} | {r['p50_usd']} | {r['p90_usd']} | "
        f"{r['mean_usd']} | {r['deadline_risk']:.1%} |" for r in rows)


def _log_to_mlflow(mlflow: MLflowResource, rows: list[dict], plot_path: Path) -> str:
    """The figures in MLflow, one run per forecast; a failure is a note, never a failed asset."""
    try:
        import mlflow as mlflow_lib

        from trainwise import tracking

        uri = mlflow.uri()
        client = mlflow_lib.tracking.MlflowClient(tracking_uri=uri)
        # Through tracking.experiment_id: a new experiment keeps its artifacts next to the
        # database, not in <cwd>/mlruns (MLflow's default), where the plot used to land.
        experiment_id = tracking.experiment_id(client, uri, f"{mlflow.experiment}-forecast",
                                               None, tracking.mlflow_caller(uri))
        run = client.create_run(experiment_id, run_name="cost_forecast")
        for row in rows:
            key = row["label"].replace(" ", "_").replace("@", "_at_")
            for figure in ("p50_usd", "p90_usd", "deadline_risk"):
                client.log_metric(run.info.run_id, f"{key}/{figure}", row[figure])
        client.log_artifact(run.info.run_id, str(plot_path))
        client.set_terminated(run.info.run_id)
        return run.info.run_id
    except Exception as error:  # noqa: BLE001 - MLflow down must not hide the forecast
        return f"not logged ({type(error).__name__}: {error})"


def job_rows(state_dir: Path, published: schedule_lib.Published, *, max_steps: int,
             deadline_h: float, probe: bool, seed: int) -> list[dict]:
    """One forecast per partition, on the launchpad's defaults and the published schedule; a
    partition that cannot be sized says why."""
    rows = []
    for partition in DATA_PARTITIONS:
        request = job_forecast.request_for(partition, published,
                                           **({"max_steps": max_steps} if max_steps else {}))
        has_data = (state_dir / "shards" / partition).is_dir()
        try:
            job = job_forecast.forecast_job(
                state_dir, request, published, seed=seed, probe=probe and has_data,
                deadline_s=deadline_h * 3600.0 if deadline_h else None)
        except (FileNotFoundError, ValueError) as error:
            rows.append({"partition": partition, "not_sized": str(error)[:300]})
            continue
        rows.append(job.row() if job is not None else {
            "partition": partition, "not_sized": "no runs yet" + (
                "" if has_data else f" and no shards: materialize data_shards[{partition}]")})
    return rows


def jobs_md(rows: list[dict], budget_usd: float) -> str:
    head = ("| job | steps | P50 USD | P90 USD | P50 h | P90 h | deadline risk | within budget | "
            "s per sample | sized from |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if "not_sized" in r:
            lines.append(f"| {r['partition']} | - | - | - | - | - | - | - | - | not sized: "
                         f"{r['not_sized']} |")
            continue
        lines.append(f"| {r['partition']} | {r['steps']:.0f} | {r['p50_usd']:.2f} | "
                     f"{r['p90_usd']:.2f} | {r['p50_h']:.2f} | {r['p90_h']:.2f} | "
                     f"{r['deadline_risk']:.1%} | "
                     f"{'no' if r['p90_usd'] > budget_usd else 'yes'} | {r['s_per_sample']:.3g} "
                     f"| {r['throughput_source']}; {r['clock_source']} |")
    return head + "\n".join(lines)


class CostForecastConfig(dg.Config):
    log_to_mlflow: bool = True
    """Also log the figures and the plot to MLflow (experiment <experiment>-forecast)."""
    seed: int = 0
    """Seed of the start-time draw (same seed, same forecast)."""
    max_steps: int = 0
    """Steps of each partition's job; 0 = the launchpad's default (TrainRequest.max_steps)."""
    deadline_h: float = 0.0
    """Deadline of each job in hours; 0 = TRAINWISE_FORECAST_DEADLINE_H."""
    probe: bool = True
    """Size a partition without runs by a probe of its first steps (on its shards)."""


@dg.asset(group_name="forecast", kinds={"python", "mlflow"})
def cost_forecast(context: dg.AssetExecutionContext, config: CostForecastConfig,
                  state: StateResource, mlflow: MLflowResource) -> dg.MaterializeResult:
    """P50/P90 spend and completion time of each registered job (its measured throughput), and
    the generic next run under the current schedule, each other allocation policy, and the
    pending schedule_change proposal (if any)."""
    work, deadline_s, samples = next_run()
    published = schedule_lib.published(state.path())
    jobs = job_rows(state.path(), published, max_steps=config.max_steps,
                    deadline_h=config.deadline_h, probe=config.probe, seed=config.seed)
    sized = [r for r in jobs if "p90_usd" in r]
    folder = state.path(*approvals.FOLDER)
    current = approvals.current_schedule(folder)
    scenarios = {CURRENT: scenario(current, work)}
    for name in policy_names():
        if name != current["allocation_policy"]:
            scenarios[name] = (name, scenarios[CURRENT][1])
    candidate = approvals.read_candidate(folder)
    if candidate is not None:
        scenarios[f"proposal {candidate['hash']}"] = scenario(candidate["to"], work)
    source = market(state)
    results = forecast_lib.forecast(scenarios, deadline_s, source, samples=samples,
                                    seed=config.seed)
    rows = [{"label": label, "policy": scenarios[label][0], **result.row()}
            for label, result in results.items()]
    budget = float(published.schedule["budget_usd"])  # the published schedule's
    out = state.path("forecast")
    plot_path = forecast_lib.plot(results, budget, out / "cost_forecast.png")
    write_atomic(out / "cost_forecast.json", json.dumps(
        {"rows": rows, "jobs": jobs, "budget_usd": budget, "market": source.source,
         "schedule": current, "schedule_version": published.version}, indent=2).encode())
    image = base64.b64encode(plot_path.read_bytes()).decode()
    mlflow_run = _log_to_mlflow(mlflow, rows, plot_path) if config.log_to_mlflow else "off"
    head = rows[0]
    context.log.info(f"next run under the current schedule: P50 {head['p50_usd']} USD, "
                     f"P90 {head['p90_usd']} USD, deadline risk {head['deadline_risk']:.1%}")
    for r in sized:
        context.log.info(f"job {r['partition']}: P50 {r['p50_usd']:.2f} USD / {r['p50_h']:.2f} h,"
                         f" P90 {r['p90_usd']:.2f} USD / {r['p90_h']:.2f} h "
                         f"({r['throughput_source']})")
    return dg.MaterializeResult(metadata={
        "jobs": dg.MetadataValue.md(
            jobs_md(jobs, budget) + f"\n\nbudget {budget:g} USD (published schedule "
            f"{published.version}); each job: the launchpad's defaults on that schedule"),
        "jobs_max_p90_usd": max((r["p90_usd"] for r in sized), default=0.0),
        **{f"job/{r['partition']}": dg.MetadataValue.json(r) for r in jobs},
        "forecast": dg.MetadataValue.md(
            "generic next run (TRAINWISE_FORECAST_WORK_GPU_H) per schedule:\n\n" +
            table_md(rows) + f"\n\nbudget {budget:g} USD; market: {source.source}\n\n"
            f"![cost forecast](data:image/png;base64,{image})"),
        "plot": dg.MetadataValue.path(str(plot_path)),
        "current_p50_usd": head["p50_usd"], "current_p90_usd": head["p90_usd"],
        "current_deadline_risk": head["deadline_risk"], "budget_usd": budget,
        "market": source.source, "embedded_market": source.embedded,
        "samples": samples, "deadline_h": deadline_s / 3600.0, "work_gpu_h": work,
        "schedule": dg.MetadataValue.json(current), "mlflow_run": mlflow_run,
    })


@dg.asset_check(asset=cost_forecast, name="p90_within_budget", blocking=True)
def p90_within_budget(state: StateResource) -> dg.AssetCheckResult:
    """Blocks (ERROR) when a registered job's forecast P90 exceeds the published schedule's
    budget_usd; with no job sized, warns when the generic next run's P90 does."""
    path = state.path("forecast") / "cost_forecast.json"
    if not path.is_file():
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN,
                                   description="no forecast yet: materialize cost_forecast")
    saved = json.loads(path.read_text())
    published = schedule_lib.published(state.path())
    budget = float(published.schedule["budget_usd"])
    fix = ("fewer max_steps, a cheaper allocation policy, or raise budget_usd through "
           "schedule_change and its approval; a launch over budget is refused unless it gives "
           "schedule_override_reason")
    jobs = [r for r in saved.get("jobs", []) if "p90_usd" in r]
    if jobs:
        over = [r for r in jobs if r["p90_usd"] > budget]
        figures = "; ".join(f"{r['partition']} P90 {r['p90_usd']:.2f} USD "
                            f"({r['p90_h']:.2f} h)" for r in (over or jobs))
        return dg.AssetCheckResult(
            passed=not over, severity=dg.AssetCheckSeverity.ERROR,
            metadata={"budget_usd": budget, "schedule_version": published.version,
                      "over_budget": [r["partition"] for r in over],
                      **{f"{r['partition']}_p90_usd": r["p90_usd"] for r in jobs}},
            description=(f"every job's P90 within the budget {budget:g} USD: {figures}"
                         if not over else f"over the budget {budget:g} USD (budget_usd of the "
                         f"published schedule {published.version}): {figures}. Fix: {fix}"))
    head = saved["rows"][0]
    passed = head["p90_usd"] <= budget
    return dg.AssetCheckResult(
        passed=passed, severity=dg.AssetCheckSeverity.WARN,
        metadata={"p90_usd": head["p90_usd"], "budget_usd": budget},
        description=(f"no job sized (no runs or shards); the generic next run's P90 "
                     f"{head['p90_usd']} USD is within budget {budget:g} USD" if passed else
                     f"no job sized (no runs or shards); the generic next run's P90 "
                     f"{head['p90_usd']} USD exceeds the budget {budget:g} USD (the published "
                     f"schedule's budget_usd): {fix}"))
