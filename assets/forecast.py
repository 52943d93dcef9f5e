"""`cost_forecast`: what the next run will cost under the current schedule and each alternative.

Monte Carlo over the real spot traces (`cloud/forecast.py`; the embedded market when
$TRAINWISE_DATA_DIR/spot is missing). The metadata carries the P50/P90 table, the deadline risk,
the plot (inline in the markdown, and its file), and the figures also go to MLflow (experiment
`<experiment>-forecast`). A non-blocking check warns when the current schedule's P90 exceeds
TRAINWISE_BUDGET_USD.
"""


import base64
import json
from pathlib import Path

import dagster as dg

from assets.resources import MLflowResource, StateResource
from cloud import forecast as forecast_lib
from cloud.policy_registry import policy_names
from trainwise import approvals, settings

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

        client = mlflow_lib.tracking.MlflowClient(tracking_uri=mlflow.uri())
        name = f"{mlflow.experiment}-forecast"
        found = client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found else client.create_experiment(name)
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


class CostForecastConfig(dg.Config):
    log_to_mlflow: bool = True
    """Also log the figures and the plot to MLflow (experiment <experiment>-forecast)."""
    seed: int = 0
    """Seed of the start-time draw (same seed, same forecast)."""


@dg.asset(group_name="forecast", kinds={"python", "mlflow"})
def cost_forecast(context: dg.AssetExecutionContext, config: CostForecastConfig,
                  state: StateResource, mlflow: MLflowResource) -> dg.MaterializeResult:
    """P50/P90 spend and deadline risk of the next run under the current schedule, each other
    allocation policy, and the pending schedule_change proposal (if any)."""
    work, deadline_s, samples = next_run()
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
    budget = float(current["budget_usd"])  # the published schedule's (trainwise.schedule)
    out = state.path("forecast")
    plot_path = forecast_lib.plot(results, budget, out / "cost_forecast.png")
    (out / "cost_forecast.json").write_text(json.dumps(
        {"rows": rows, "budget_usd": budget, "market": source.source, "schedule": current},
        indent=2))
    image = base64.b64encode(plot_path.read_bytes()).decode()
    mlflow_run = _log_to_mlflow(mlflow, rows, plot_path) if config.log_to_mlflow else "off"
    head = rows[0]
    context.log.info(f"next run under the current schedule: P50 {head['p50_usd']} USD, "
                     f"P90 {head['p90_usd']} USD, deadline risk {head['deadline_risk']:.1%}")
    return dg.MaterializeResult(metadata={
        "forecast": dg.MetadataValue.md(
            table_md(rows) + f"\n\nbudget {budget:g} USD; market: {source.source}\n\n"
            f"![cost forecast](data:image/png;base64,{image})"),
        "plot": dg.MetadataValue.path(str(plot_path)),
        "current_p50_usd": head["p50_usd"], "current_p90_usd": head["p90_usd"],
        "current_deadline_risk": head["deadline_risk"], "budget_usd": budget,
        "market": source.source, "embedded_market": source.embedded,
        "samples": samples, "deadline_h": deadline_s / 3600.0, "work_gpu_h": work,
        "schedule": dg.MetadataValue.json(current), "mlflow_run": mlflow_run,
    })


@dg.asset_check(asset=cost_forecast, name="p90_within_budget", blocking=False)
def p90_within_budget(state: StateResource) -> dg.AssetCheckResult:
    """Warns (does not block) when the current schedule's P90 spend exceeds the budget."""
    path = state.path("forecast") / "cost_forecast.json"
    if not path.is_file():
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN,
                                   description="no forecast yet: materialize cost_forecast")
    saved = json.loads(path.read_text())
    head, budget = saved["rows"][0], float(
        approvals.current_schedule(state.path(*approvals.FOLDER))["budget_usd"])
    passed = head["p90_usd"] <= budget
    return dg.AssetCheckResult(
        passed=passed, severity=dg.AssetCheckSeverity.WARN,
        metadata={"p90_usd": head["p90_usd"], "budget_usd": budget},
        description=(f"P90 {head['p90_usd']} USD within budget {budget:g} USD" if passed else
                     f"P90 {head['p90_usd']} USD exceeds the budget {budget:g} USD "
                     "(the published schedule's budget_usd): pick a cheaper schedule or raise "
                     "the budget through schedule_change"))
