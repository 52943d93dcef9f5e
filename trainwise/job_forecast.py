"""The forecast of a registered job (issue 28, item 4): P50/P90 cost and completion time of a
`train` partition from its measured throughput, its deadline and its region's spot market.

1. Throughput (trainer clock): step time per sample of its step events (`step_time_ms` over
   micro_batch_size x grad_accum_steps; the first step of each trainer process is warm-up), one
   evaluation (`eval_ms`) and one save (`save_ms`); from the partition's newest MAX_RUNS runs
   (their request.json names it), else a probe: PROBE_STEPS steps of the trainer itself
   (`training.loop.train`, the launch config, a no-op fast policy) in a scratch folder.
2. Work: its steps (fewer by the schedule's pruning rate under dynamic selection) x samples per
   step x seconds per sample, plus evaluations and saves, x the provider's clock (the emulated
   provider replays its trace accelerated; a real one runs on the wall clock), so the figures
   are on the bill's clock; x nodes = node-hours.
3. Monte Carlo (`cloud.forecast`) over the region's zones of TRAINWISE_SPOT_TRACES for the
   launch's allocation policy (else the published schedule's): P50/P90 USD and hours.

A live run (`reforecast_run`): its bill so far (gang.json `cost_usd`, plus the node time since
that record) plus the forecast of its steps left in the time left of its deadline. The budget
(`launch_gate`): a launch whose P90 exceeds the published schedule's `budget_usd` is refused
unless it gives `schedule_override_reason`; figures and reason go to `launch_forecast.json`.

A team's registered job is forecast by the same engine (`trainwise.user_job_forecast`): its
throughput source is its own runs (`runs_naming` of user_job.json) or a probe of its command,
sized per step (`trainer_seconds` with no batch), and its gate is `budget_gate`."""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cloud import forecast as forecast_lib
from cloud import prices
from trainwise import settings

PROBE_STEPS = 3  # trainer steps of a probe (the first is warm-up), one evaluation at the end
MAX_RUNS = 5  # newest runs of a partition measured
GATE_QUICK_SAMPLES = 8  # the gate first draws these; a P90 under half the budget passes at once
LAUNCH_FILE = "launch_forecast.json"


class BudgetExceededError(ValueError):
    """A launch whose forecast P90 exceeds the budget; `record` holds the figures."""

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


@dataclass(frozen=True)
class Throughput:
    s_per_sample: float  # trainer seconds of step time per training sample
    eval_s: float  # one evaluation (0 when none was measured)
    save_s: float  # one checkpoint save's blocking time (0 when none was measured)
    steps: int  # steps measured
    source: str  # "runs a, b (N steps)" or "probe of N steps"
    s_per_step: float = 0.0  # trainer seconds per step (a registered job's own batch)


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value > 0

def measure(records: list[dict[str, Any]], source: str) -> Throughput | None:
    """The throughput of a trainer's records (one rank, in order), or None without a step."""
    samples = step_s = 0.0
    steps, warm = 0, False
    evals, saves = [], []
    for record in records:
        kind = record["type"]
        if kind == "run_start":
            warm = False
        elif kind == "eval" and _number(record.get("eval_ms")):
            evals.append(record["eval_ms"] / 1000.0)
        elif kind == "checkpoint" and type(record.get("save_ms")) in (int, float):
            saves.append(max(0.0, record["save_ms"]) / 1000.0)
        elif kind == "step" and _number(record.get("step_time_ms")):
            if not warm:  # the first step of a trainer process: warm-up, not throughput
                warm = True
                continue
            batch = int(record.get("micro_batch_size") or 1) * int(
                record.get("grad_accum_steps") or 1)
            samples += batch
            step_s += record["step_time_ms"] / 1000.0
            steps += 1
    if not steps:
        return None
    return Throughput(step_s / samples, statistics.median(evals) if evals else 0.0,
                      statistics.median(saves) if saves else 0.0, steps, source, step_s / steps)


def _read_rank0(run_dir: Path) -> list[dict[str, Any]]:
    from telemetry.reader import read_run

    telemetry = run_dir / "telemetry" / run_dir.name
    return read_run(telemetry, rank=0, warn=False).records if telemetry.is_dir() else []


def runs_naming(state_dir: Path, record_file: str, key: str, value: str, *,
                exclude: str = "") -> list[Path]:
    """The run folders whose `record_file` (a JSON object) has `key` == `value`, newest first
    (the source of a measured throughput: request.json's partition for the train job,
    user_job.json's job for a registered one)."""
    found = []
    for record_path in (Path(state_dir) / "runs").glob(f"*/{record_file}"):
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get(key) == value and \
                record_path.parent.name != exclude:
            found.append((record_path.stat().st_mtime, record_path.parent))
    return [run_dir for _, run_dir in sorted(found, reverse=True)]


def measured_throughput(state_dir: Path, partition: str, *, exclude: str = "",
                        runs: list[Path] | None = None) -> Throughput | None:
    """The throughput of the partition's newest runs, or of `runs` (newest first) when given
    (None when none has steps). A run whose telemetry is malformed is left out, named in the
    source."""
    if runs is None:
        runs = runs_naming(state_dir, "request.json", "partition", partition, exclude=exclude)
    records, used, skipped = [], [], []
    for run_dir in runs[:MAX_RUNS]:
        try:
            run_records = _read_rank0(run_dir)
        except ValueError as error:  # TelemetryFormatError: named, never guessed around
            skipped.append(f"{run_dir.name} ({str(error)[:80]})")
            continue
        if any(r["type"] == "step" for r in run_records):
            records += [{"type": "run_start"}, *run_records]  # each run warms up on its own
            used.append(run_dir.name)
    measured = measure(records, "")
    if measured is None:
        return None
    note = f"; left out: {', '.join(skipped)}" if skipped else ""
    return replace(measured, source=f"measured: runs {', '.join(used)} ({measured.steps} steps)"
                                    f"{note}")


def probe_throughput(state_dir: Path, request: Any, steps: int = PROBE_STEPS) -> Throughput:
    """`steps` steps (at most the job's own, at least 2) of the job's trainer on its data and one
    evaluation, timed (FileNotFoundError/ValueError when its shards are missing: materialize
    data_shards for the partition first)."""
    steps = max(2, min(steps, request.max_steps))
    from controllers.fast_types import NoOpFastPolicy
    from telemetry.reader import read_run
    from training import curriculum as curriculum_lib
    from training import loop, shards
    from trainwise.run_request import trainer_config

    examples = shards.load_shards(Path(state_dir) / "shards" / request.partition)
    try:
        curriculum = curriculum_lib.load_curriculum(
            Path(state_dir) / "curricula" / request.partition)
    except (FileNotFoundError, ValueError):
        curriculum = None  # every example at weight 1: the same step cost
    config = trainer_config(
        request, run_id="probe", eval_every_steps=steps, checkpoint_every_steps=0,
        checkpoint_autotune=False, lever_guard=False, max_steps=max(request.max_steps, steps),
        min_learning_rate=min(loop.TrainConfig.min_learning_rate, request.learning_rate),
        num_threads=settings.torch_threads())
    with tempfile.TemporaryDirectory(prefix="trainwise-probe-") as scratch:
        loop.train(config, examples, curriculum, scratch, fast_policy=NoOpFastPolicy(),
                   stop_after_steps=steps)
        records = read_run(Path(scratch) / "telemetry" / "probe", rank=0, warn=False).records
    measured = measure(records, f"probe of {steps} steps")
    if measured is None:
        raise ValueError(f"the probe of {request.partition} recorded no step; run the job once "
                         "(its telemetry sizes the next forecast)")
    return measured


def throughput_of(state_dir: Path, request: Any, *, probe: bool = True) -> Throughput | None:
    measured = measured_throughput(state_dir, request.partition, exclude=request.run_id)
    return probe_throughput(state_dir, request) if measured is None and probe else measured


def provider_clock(instance_type: str, region: str) -> tuple[float, str]:
    """(provider seconds per trainer second, what it is) for a new run's nodes."""
    from cloud.providers import provider_name

    name = provider_name()
    if name != "emulated":
        return 1.0, f"{name} provider: the wall clock"
    from trainwise.gang import provider_for_run

    factor = float(provider_for_run(instance_type, region).clock.emulated_per_wall_s)
    return factor, f"emulated provider: {factor:g} provider s per trainer s (replayed trace)"


def trainer_seconds(throughput: Throughput, request: Any, steps: float) -> float:
    """Trainer seconds of `steps` steps of the launch, with its evaluations and saves. A
    request with no batch of its own (micro_batch_size 0: a registered job, whose batch is its
    code's) runs at the measured seconds per step; no eval_every_steps: one evaluation."""
    batch = request.micro_batch_size * request.grad_accum_steps
    step_s = batch * throughput.s_per_sample if batch else throughput.s_per_step
    evals = (steps / request.eval_every_steps if request.eval_every_steps else 0) + 1
    saves = (steps / request.checkpoint_every_steps if request.checkpoint_every_steps else 0) + 1
    return steps * step_s + evals * throughput.eval_s + saves * throughput.save_s


@dataclass(frozen=True)
class JobForecast:
    partition: str
    policy: str
    steps: float  # steps forecast (the steps left, for a live run)
    nodes: int
    work_node_h: float  # node-hours on the provider's clock
    deadline_h: float
    p50_usd: float
    p90_usd: float
    p50_h: float  # completion, hours from the start (provider clock)
    p90_h: float
    deadline_risk: float
    samples: int
    s_per_sample: float
    throughput_source: str
    clock_factor: float
    clock_source: str
    market: str
    budget_usd: float
    note: str = ""
    s_per_step: float = 0.0  # trainer seconds per measured step

    def row(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def market_for(request: Any) -> forecast_lib.MarketSource:
    # A type no price table lists is the user's typo, not a gap in the traces: name the
    # valid types before looking for a zone that has it.
    if request.instance_type:
        prices.instance_type(request.instance_type)
    return forecast_lib.load_market(settings.data_dir() / "spot",
                                    settings.get("TRAINWISE_SPOT_TRACES"),
                                    request.instance_type or forecast_lib.DEFAULT_INSTANCE,
                                    region=request.region)


def samples_setting() -> int:
    return settings.get_int("TRAINWISE_FORECAST_SAMPLES", 1, 100_000)


def simulate_job(request: Any, published: Any, *, steps: float, throughput: Throughput,
                 clock: tuple[float, str] | None = None, deadline_s: float | None = None,
                 samples: int | None = None, seed: int = 0) -> JobForecast:
    """The Monte Carlo of `steps` steps of the launch `request` on the published schedule
    (`deadline_s`, `samples`: the settings' unless given)."""
    clock = clock or provider_clock(request.instance_type, request.region)
    if deadline_s is None:
        deadline_s = settings.get_float("TRAINWISE_FORECAST_DEADLINE_H", 0.0) * 3600.0
    samples = samples or samples_setting()
    run_s = trainer_seconds(throughput, request, steps) * clock[0]
    source, rules = market_for(request), forecast_lib.ClusterRules()
    tick, trace_s = source.market.tick_s, source.market.n_ticks * source.market.tick_s
    note, missed = "", 0.0
    least_s = math.ceil((run_s + rules.changeover_s) / tick + 1e-9) * tick + tick
    if least_s > trace_s:
        raise ValueError(f"{request.partition}: {run_s / 3600:.1f} h of work do not fit in the "
                         f"trace ({trace_s / 3600:.0f} h); forecast fewer steps or set "
                         "TRAINWISE_SPOT_TRACES to a longer trace")
    if deadline_s < least_s:
        note = (f"deadline {deadline_s / 3600:.2f} h is shorter than the work on on-demand "
                f"({least_s / 3600:.2f} h): forecast to that earliest finish, every start misses")
        deadline_s, missed = least_s, 1.0
    deadline_s = min(deadline_s, trace_s)
    policy = request.allocation_policy or str(published.schedule["allocation_policy"])
    work_node_h = run_s / 3600.0 * request.nodes
    result = forecast_lib.forecast({"job": (policy, work_node_h)}, deadline_s, source,
                                   samples=samples, seed=seed, rules=rules,
                                   node_count=request.nodes)["job"]
    return JobForecast(request.partition, policy, steps, request.nodes, work_node_h,
                       deadline_s / 3600.0, result.p50_usd, result.p90_usd, result.p50_h,
                       result.p90_h, max(result.deadline_risk, missed), samples,
                       throughput.s_per_sample, throughput.source, clock[0], clock[1],
                       source.source, float(published.schedule["budget_usd"]), note,
                       throughput.s_per_step)


def request_for(partition: str, published: Any, **fields: Any) -> Any:
    """The launchpad's default request of a partition on the published schedule."""
    from trainwise import schedule as schedule_lib
    from trainwise.run_request import TrainRequest

    request = TrainRequest(partition=partition, region=settings.get("TRAINWISE_REGION"),
                           instance_type=settings.get("TRAINWISE_INSTANCE_TYPE"), **fields)
    return schedule_lib.apply_to_request(request, published, asked={}, override_reason="")


def forecast_job(state_dir: Path, request: Any, published: Any, *, probe: bool = True,
                 throughput: Throughput | None = None, **options: Any) -> JobForecast | None:
    """P50/P90 of a launch (None when it has no runs and `probe` is False); `options`:
    deadline_s, samples, seed (`simulate_job`)."""
    throughput = throughput or throughput_of(state_dir, request, probe=probe)
    if throughput is None:
        return None
    steps = float(request.max_steps)
    if request.data_selection == "dynamic":
        steps = forecast_lib.work_for_rate(steps, float(published.schedule["pruning_rate"]))
    return simulate_job(request, published, steps=steps, throughput=throughput, **options)


@dataclass(frozen=True)
class LiveForecast:
    run_id: str
    steps_done: int
    max_steps: int
    bill_so_far_usd: float
    bill_source: str
    elapsed_h: float  # provider clock
    p50_usd: float  # the whole run: the bill so far plus the remaining forecast
    p90_usd: float
    p50_h: float
    p90_h: float
    remaining: JobForecast | None  # None when no step is left

    def row(self) -> dict[str, Any]:
        return asdict(self)


def _live_clock(gang: dict[str, Any] | None, request: Any) -> tuple[float, str]:
    history = (gang or {}).get("history") or []
    if len(history) >= 2:
        wall = history[-1]["wall_time_s"] - history[0]["wall_time_s"]
        provider = history[-1]["provider_time_s"] - history[0]["provider_time_s"]
        if wall > 0.5 and provider > 0:
            return provider / wall, (f"this run's provider: {provider / wall:.0f} provider s "
                                     "per trainer s (gang.json)")
    return provider_clock(request.instance_type, request.region)


def _bill_so_far(run_dir: Path, records: list[dict[str, Any]], request: Any,
                 clock: tuple[float, str]) -> tuple[float, float, str]:
    """(USD billed so far, provider seconds gone, where the bill came from): the newest bill
    record the nodes' holder wrote into the telemetry (`telemetry.bill`, at most a wall second
    old); a run written before bills were recorded falls back to gang.json."""
    from telemetry.bill import bills
    from telemetry.reader import read_run
    from trainwise.gang import PROVIDER_RANK, read_gang
    from trainwise.runs import OUTCOME_NAME

    telemetry = run_dir / "telemetry" / run_dir.name
    recorded = bills(read_run(telemetry, rank=PROVIDER_RANK, warn=False).records
                     if telemetry.is_dir() else [])
    if recorded:
        last = recorded[-1]
        return (float(last["bill_usd"]), float(last.get("provider_time_s") or 0.0),
                "the provider's bill" + (" (final)" if last.get("final") else
                                         f" at step {last['step']} (telemetry)"))
    gang = read_gang(run_dir) or {}
    last_wall = max((r["wall_time_s"] for r in records), default=time.time())
    if gang.get("cost_usd") is None:
        first = min((r["wall_time_s"] for r in records), default=last_wall)
        elapsed_s = (last_wall - first) * clock[0]
        return (_price({}, request) * elapsed_s * request.nodes / 3600, elapsed_s,
                "estimated at the on-demand price (no bill in gang.json yet)")
    # A live run's gang.json is written at its last node event: the node time since then is
    # billed too (a finished run's, written when it closed, holds it already).
    history = [] if (run_dir / OUTCOME_NAME).is_file() else gang.get("history") or []
    since_s = max(0.0, last_wall - history[-1]["wall_time_s"]) * clock[0] if history else 0.0
    bill = float(gang["cost_usd"]) + _price(gang, request) * since_s * int(
        gang.get("nodes") or 1) / 3600
    return (bill, float(gang.get("provider_now_s") or 0.0) + since_s,
            "gang.json cost_usd" + (f" + {since_s:.0f} node s since its record" if since_s
                                    else ""))


def reforecast_run(state_dir: Path, run_id: str, *, deadline_s: float | None = None,
                   samples: int | None = None, seed: int = 0) -> LiveForecast:
    """The whole run's P50/P90 from a live (or stopped) run's folder: its bill so far and the
    steps left at the throughput it measured (before its own first steps: its partition's
    earlier runs'), from the time left of its deadline."""
    from trainwise import explain
    from trainwise import schedule as schedule_lib
    from trainwise.gang import read_gang
    from trainwise.run_request import TrainRequest

    run_dir = explain.find_run_dir(run_id, Path(state_dir) / "runs")
    request_path = run_dir / "request.json"
    if not request_path.is_file():
        raise FileNotFoundError(f"run {run_dir.name} has no request.json yet (not started); "
                                "forecast its partition instead: trainwise forecast PARTITION")
    raw = json.loads(request_path.read_text(encoding="utf-8"))
    request = TrainRequest(**{k: (tuple(v) if isinstance(v, list) else v)
                              for k, v in raw.items() if k in TrainRequest.__dataclass_fields__})
    records = _read_rank0(run_dir)
    done = max((r["step"] for r in records if r["type"] == "step"), default=0)
    throughput = measure(records, f"measured: this run ({done} steps)") or \
        measured_throughput(state_dir, request.partition, exclude=run_dir.name)
    clock = _live_clock(read_gang(run_dir), request)
    bill, elapsed_s, bill_source = _bill_so_far(run_dir, records, request, clock)
    left = max(0, request.max_steps - done)
    if left and throughput is None:
        raise ValueError(f"run {run_dir.name} has {left} steps left, none measured yet and no "
                         "earlier run of its partition; ask again after its first steps")
    remaining = None
    if left:
        if deadline_s is None:
            deadline_s = settings.get_float("TRAINWISE_FORECAST_DEADLINE_H", 0.0) * 3600.0
        remaining = simulate_job(request, schedule_lib.published(state_dir), steps=float(left),
                                 throughput=throughput, clock=clock, samples=samples, seed=seed,
                                 deadline_s=max(0.0, deadline_s - elapsed_s))
    hours = elapsed_s / 3600.0
    add = (lambda name: getattr(remaining, name)) if remaining else (lambda name: 0.0)
    return LiveForecast(run_dir.name, done, request.max_steps, bill, bill_source, hours,
                        bill + add("p50_usd"), bill + add("p90_usd"), hours + add("p50_h"),
                        hours + add("p90_h"), remaining)


def _price(gang: dict[str, Any], request: Any) -> float:
    """The run's node price now (its gang's market and zone), else the on-demand list price."""
    from cloud import prices
    from cloud.providers.base import node_price_usd_per_hour

    try:
        return node_price_usd_per_hour(gang["provider"], gang["instance_type"], gang["zone"],
                                       gang["market"])
    except (ValueError, KeyError, LookupError):
        return prices.on_demand_price(request.instance_type or forecast_lib.DEFAULT_INSTANCE,
                                      request.region)


def launch_gate(request: Any, published: Any, state_dir: Path) -> dict[str, Any]:
    """The budget check of a launch: the forecast (a resumed run's: its bill so far plus the
    rest) against the published schedule's budget_usd. Over budget raises BudgetExceededError
    naming the figures and the fix, unless `schedule_override_reason` is given; either way that
    passes, the record is written to `<run folder>/launch_forecast.json` and returned."""
    run_dir = Path(state_dir) / "runs" / request.run_id
    if any(r["type"] == "step" for r in _read_rank0(run_dir)):
        live = reforecast_run(state_dir, request.run_id)
        figures = {"what": f"the resumed run (bill so far {live.bill_so_far_usd:.2f} USD + "
                           f"its {live.max_steps - live.steps_done} steps left)",
                   **live.row()}
        p90 = live.p90_usd
    else:
        try:
            throughput = throughput_of(state_dir, request)
        except (FileNotFoundError, ValueError) as error:  # no shards: the run cannot start
            return {"run_id": request.run_id, "skipped": f"not forecast ({error}); the run "
                    "checks its data itself before any node is launched"}
        job = gate_forecast(state_dir, request, published, throughput)
        figures, p90 = {"what": f"{request.max_steps} steps", **job.row()}, job.p90_usd
    return budget_gate(state_dir, request.run_id, request.partition, figures, p90, published,
                       request.schedule_override_reason)


def gate_forecast(state_dir: Path, request: Any, published: Any, throughput: Throughput,
                  **options: Any) -> JobForecast:
    """The gate's forecast: GATE_QUICK_SAMPLES draws first, all of the setting's only when
    that P90 is above half the budget."""
    budget = float(published.schedule["budget_usd"])
    job = forecast_job(state_dir, request, published, throughput=throughput,
                       samples=min(GATE_QUICK_SAMPLES, samples_setting()), **options)
    assert job is not None
    if job.p90_usd > budget / 2 and samples_setting() > GATE_QUICK_SAMPLES:
        job = forecast_job(state_dir, request, published, throughput=throughput, **options)
    assert job is not None
    return job


def budget_gate(state_dir: Path, run_id: str, what: str, figures: dict[str, Any], p90: float,
                published: Any, override_reason: str,
                override_field: str = "schedule_override_reason",
                what_key: str = "partition") -> dict[str, Any]:
    """The verdict of a forecast `figures` (its "what" and "p90_h") of the launch `run_id` of
    `what` (a partition; a registered job, `what_key` "job") against the published budget:
    BudgetExceededError naming the figures and the fix when over it without `override_reason`
    (the launch's `override_field`), else the record written to
    `runs/<run_id>/launch_forecast.json`."""
    budget = float(published.schedule["budget_usd"])
    reason, over = override_reason.strip(), p90 > budget
    summary = (f"forecast P90 {p90:.2f} USD, done in {figures['p90_h']:.2f} h (P90), for "
               f"{figures['what']} of {what}: {'over' if over else 'within'} the "
               f"budget of {budget:g} USD (budget_usd of the published schedule "
               f"{published.version})")
    record = {"run_id": run_id, what_key: what, "p90_usd": p90,
              "p90_h": figures["p90_h"], "budget_usd": budget,
              "schedule_version": published.version, "over_budget": over,
              "override_reason": reason if over else "", "summary": summary,
              "forecast": figures, "written_at_s": time.time()}
    if over and not reason:
        raise BudgetExceededError(
            f"launch refused: {summary}. Fix: fewer max_steps, a cheaper allocation policy, "
            "raise budget_usd through schedule_change and its approval, or launch anyway with "
            f"{override_field} (recorded with the run)", record)
    from training.safe_files import write_atomic

    run_dir = Path(state_dir) / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / LAUNCH_FILE, json.dumps(record, indent=1, default=str).encode())
    return record
