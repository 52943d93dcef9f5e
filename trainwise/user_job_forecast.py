"""The forecast of a team's registered job (`[jobs.NAME]` of its project file; issue 28 item 4):
P50/P90 cost and completion time of a launch before any node is held, and the budget it must
fit. The engine is the train job's (`trainwise.job_forecast`); what differs is where the
throughput comes from and how a step is sized:

1. Throughput: the seconds per step of the step events (the SDK's, `trainwise/sdk/run.py`) of
   the job's newest runs, those whose `user_job.json` names it (the first step of each job
   process is warm-up, left out: `job_forecast.measure`); else a probe: the job's own command
   with a run spec of PROBE_STEPS steps in a scratch folder (no object store, the no-op fast
   policy) whose step_limit caps the job's own max_steps (a loop that ignores `run.done` is
   sent SIGTERM once its telemetry shows those steps), its steps timed from its telemetry. The
   forecast names which (`throughput_source`).
2. Steps: the launch's max_steps. Without it (the job's code decides when it is done) there is
   no forecast: `CannotSizeError` says so, and the launch gate lets the launch go on unforecast.
3. Work: steps x measured seconds per step (a job's batch is its code's: micro_batch_size 0 in
   `job_forecast.trainer_seconds`), plus its checkpoint saves, x the provider's clock; then the
   Monte Carlo of the region's market for the launch's allocation policy, or for a fixed market
   the policy that stands for it (spot: managed_spot, on_demand: on_demand).

The gate (`launch_gate`): a launch whose P90 exceeds the published schedule's budget_usd is
refused (`job_forecast.BudgetExceededError`, the figures in the message) unless it gives
`budget_override_reason`; the record goes to `runs/<run_id>/launch_forecast.json`. A launch of a
run that already has steps (the same run_id resumes) is forecast as its bill so far plus its
steps left. Pure of Dagster: `assets/user_jobs.py` calls it.

A live (or stopped) run of a registered job is re-forecast the same way (`reforecast_user_run`,
`trainwise forecast --run RUN_ID`): its bill so far plus its steps left at its own measured
pace, on its provider's clock (`job_forecast._live_clock`), in the time left of its deadline.
Its job: `user_job.json` (written when the run ends), else the launch gate's record (written
before its first node). Its max_steps: its newest `run_start` (the job's own arguments override
the spec's), else the newest run spec its launcher wrote.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwise import job_forecast, settings
from trainwise.agent.task import MAX_GANG_NODES
from trainwise.job_forecast import JobForecast, Throughput
from trainwise.user_project import JobSpec

PROBE_STEPS = job_forecast.PROBE_STEPS  # the first is warm-up
PROBE_TIMEOUT_S = 300.0  # a probe that has not stepped PROBE_STEPS times by then is stopped
PROBE_STOP_S = 60.0  # what a SIGTERMed probe is given to leave before SIGKILL
OVERRIDE_FIELD = "budget_override_reason"
# The policy a fixed-market launch (`UserJobLaunch`, no allocation_policy) is forecast as.
FIXED_MARKET_POLICY = {"spot": "managed_spot", "on_demand": "on_demand"}


class CannotSizeError(ValueError):
    """A launch without max_steps: its work is unknown, so it has no forecast."""


@dataclass(frozen=True)
class UserJobAsk:
    """A launch of a registered job, in the fields `job_forecast` reads of a train request."""

    partition: str  # the registered job's name (job_forecast's name for what it forecasts)
    max_steps: int
    allocation_policy: str  # the launch's, or the one its fixed market stands for
    instance_type: str
    region: str
    run_id: str = ""
    market_note: str = ""
    checkpoint_every_steps: int = 0
    budget_override_reason: str = ""
    nodes: int = 1
    micro_batch_size: int = 0  # its batch is its code's: sized by measured seconds per step
    grad_accum_steps: int = 1
    eval_every_steps: int = 0  # its evaluations run inside its steps (one at the end)
    data_selection: str = "fixed"


def ask_for(job_name: str, *, max_steps: int, market: str = "spot", allocation_policy: str = "",
            run_id: str = "", checkpoint_every_steps: int = 0,
            budget_override_reason: str = "", nodes: int = 1) -> UserJobAsk:
    """The launch as the Launchpad (or the CLI) gives it; ValueError names a market or policy
    that does not exist (before any probe)."""
    from cloud.policy_registry import policy_names
    from cloud.providers.base import check_market

    if allocation_policy:
        if allocation_policy not in policy_names():
            raise ValueError(f"unknown allocation policy {allocation_policy!r}; valid: "
                             f"{', '.join(policy_names())}")
        policy, note = allocation_policy, ""
    else:
        policy = FIXED_MARKET_POLICY[check_market(market)]
        note = f"fixed market {market}: forecast as {policy}"
        if market == "spot":
            note += " (spot, on-demand when spot is refused)"
    if max_steps < 0:
        raise ValueError(f"max_steps {max_steps} must be >= 0 (0: the job decides)")
    if not 1 <= nodes <= MAX_GANG_NODES:
        raise ValueError(f"nodes {nodes} must be 1-{MAX_GANG_NODES}")
    return UserJobAsk(job_name, int(max_steps), policy, settings.get("TRAINWISE_INSTANCE_TYPE"),
                      settings.get("TRAINWISE_REGION"), run_id=run_id, market_note=note,
                      checkpoint_every_steps=int(checkpoint_every_steps or 0),
                      budget_override_reason=budget_override_reason, nodes=int(nodes))


def measured_throughput(state_dir: Path, job_name: str, *, exclude: str = ""
                        ) -> Throughput | None:
    """The seconds per step of the job's newest runs (None when none has steps)."""
    from trainwise.user_jobs import RECORD_FILE

    runs = job_forecast.runs_naming(state_dir, RECORD_FILE, "job", job_name, exclude=exclude)
    return job_forecast.measured_throughput(state_dir, job_name, runs=runs)


def _steps_written(telemetry: Path) -> int:
    folder = telemetry / "rank0"
    if not folder.is_dir():
        return 0
    return sum(p.read_text(errors="replace").count('"type":"step"')
               for p in folder.glob("*.jsonl"))


def probe_throughput(job: JobSpec, project_dir: Path, dataset_dir: Path | None = None, *,
                     steps: int = PROBE_STEPS, timeout_s: float = PROBE_TIMEOUT_S) -> Throughput:
    """`steps` steps (at least 2) of the job's own command in a scratch folder, timed from its
    telemetry (module doc, 1). ValueError with its log's tail when it times no step."""
    from telemetry.reader import read_run
    from trainwise.sdk.spec import RunSpec, write_spec
    from trainwise.user_jobs import _log_tail, job_command, job_env, spec_for_framework

    steps = max(2, int(steps))
    with tempfile.TemporaryDirectory(prefix="trainwise-probe-") as scratch:
        run_dir = Path(scratch) / "probe"
        spec = spec_for_framework(job, RunSpec(
            run_id="probe", run_dir=str(run_dir), max_steps=steps, step_limit=steps,
            checkpoint_every_steps=None,
            fast_policy="noop", dataset_dir=str(dataset_dir) if dataset_dir else None))
        spec_path = write_spec(spec, Path(scratch) / "probe.spec.json")
        log, telemetry, why = Path(scratch) / "probe.log", run_dir / "telemetry" / "probe", ""
        with log.open("w") as output:
            child = subprocess.Popen(job_command(job), cwd=project_dir,
                                     env=job_env(Path(project_dir), spec_path), stdout=output,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            began = time.monotonic()
            try:
                while child.poll() is None:
                    # step_limit stops an SDK job at `steps`; a job whose loop ignores run.done
                    # is told to leave once its telemetry shows them.
                    if _steps_written(telemetry) >= steps:
                        try:  # the SDK leaves at its next step
                            os.killpg(child.pid, signal.SIGTERM)
                        except ProcessLookupError:
                            pass
                        child.wait(timeout=PROBE_STOP_S)
                        break
                    if time.monotonic() - began > timeout_s:
                        why = f"it had not stepped {steps} times in {timeout_s:.0f} s"
                        break
                    time.sleep(0.05)
            except subprocess.TimeoutExpired:
                pass
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        records = read_run(telemetry, rank=0, warn=False).records if telemetry.is_dir() else []
        stepped = sum(1 for r in records if r["type"] == "step")  # a fast job outruns the poll
        measured = job_forecast.measure(records, f"probe of {stepped} steps")
        if measured is None:
            raise ValueError(
                f"the probe of job {job.name!r} timed no step ({why or f'exit {child.returncode}'}"
                f"); run the job once (its telemetry sizes the next forecast). Its log ends:\n"
                f"{_log_tail(log)}")
    return measured


def throughput_of(state_dir: Path, job: JobSpec, project_dir: Path,
                  dataset_dir: Path | None = None, *, exclude: str = "",
                  probe: bool = True) -> Throughput | None:
    measured = measured_throughput(state_dir, job.name, exclude=exclude)
    if measured is None and probe:
        return probe_throughput(job, project_dir, dataset_dir)
    return measured


def _cannot_size(ask: UserJobAsk) -> CannotSizeError:
    return CannotSizeError(
        f"job {ask.partition!r}: cannot size the job without max_steps (its code decides when "
        "it is done, so its work is unknown); give max_steps (the Launchpad's, or --max-steps) "
        "for a forecast")


def _noted(job: JobForecast, ask: UserJobAsk) -> JobForecast:
    return dataclasses.replace(job, note="; ".join(n for n in (ask.market_note, job.note) if n))


def forecast_user_job(state_dir: Path, job: JobSpec, project_dir: Path, ask: UserJobAsk,
                      published: Any, dataset_dir: Path | None = None, *, probe: bool = True,
                      throughput: Throughput | None = None, **options: Any
                      ) -> JobForecast | None:
    """P50/P90 of the launch `ask` of `job` (None when it has no runs and `probe` is False);
    CannotSizeError without max_steps. `options`: deadline_s, samples, seed."""
    if not ask.max_steps:
        raise _cannot_size(ask)
    throughput = throughput or throughput_of(state_dir, job, project_dir, dataset_dir,
                                             exclude=ask.run_id, probe=probe)
    if throughput is None:
        return None
    forecast = job_forecast.forecast_job(state_dir, ask, published, throughput=throughput,
                                         **options)
    assert forecast is not None
    return _noted(forecast, ask)


def _live_forecast(state_dir: Path, run_dir: Path, records: list[dict[str, Any]], *,
                   done: int, left: int, throughput: Throughput | None, ask: UserJobAsk,
                   published: Any, clock: tuple[float, str], gate: bool = False,
                   deadline_s: float | None = None, samples: int | None = None, seed: int = 0
                   ) -> job_forecast.LiveForecast:
    """A run that has stepped already (`done` steps, `left` to go): its bill so far plus the
    forecast of its steps left in the time left of its deadline (the setting's unless
    `deadline_s`). `gate`: drawn as the launch gate draws (`job_forecast.gate_forecast`: a few
    starts first), else `samples` draws with `seed`."""
    bill, elapsed_s, bill_source = job_forecast._bill_so_far(run_dir, records, ask, clock)
    remaining = None
    if left:
        assert throughput is not None
        if deadline_s is None:
            deadline_s = settings.get_float("TRAINWISE_FORECAST_DEADLINE_H", 0.0) * 3600.0
        rest_ask = dataclasses.replace(ask, max_steps=left)
        options = {"clock": clock, "deadline_s": max(0.0, deadline_s - elapsed_s)}
        rest = (job_forecast.gate_forecast(state_dir, rest_ask, published, throughput, **options)
                if gate else job_forecast.forecast_job(state_dir, rest_ask, published,
                                                       throughput=throughput, samples=samples,
                                                       seed=seed, **options))
        assert rest is not None  # a throughput was given
        remaining = _noted(rest, ask)
    hours = elapsed_s / 3600.0
    add = (lambda name: getattr(remaining, name)) if remaining else (lambda name: 0.0)
    return job_forecast.LiveForecast(
        run_dir.name, done, ask.max_steps, bill, bill_source, hours, bill + add("p50_usd"),
        bill + add("p90_usd"), hours + add("p50_h"), hours + add("p90_h"), remaining)


def _resumed_figures(live: job_forecast.LiveForecast) -> dict[str, Any]:
    """The gate's figures of a launch of a run that has stepped already: its bill so far plus
    its steps left."""
    left = int(live.remaining.steps) if live.remaining else 0
    figures = {"what": f"the resumed run (bill so far {live.bill_so_far_usd:.2f} USD + its "
                       f"{left} steps left)",
               "steps_done": live.steps_done, "bill_so_far_usd": live.bill_so_far_usd,
               "bill_source": live.bill_source, "p50_usd": live.p50_usd,
               "p90_usd": live.p90_usd, "p50_h": live.p50_h, "p90_h": live.p90_h}
    if live.remaining:
        figures["remaining"] = live.remaining.row()
    return figures


def _read_json(path: Path) -> dict[str, Any]:
    """A run folder's JSON object, {} when it is missing or not one (a record being written)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def job_of_run(run_dir: Path) -> str:
    """The registered job a run folder is of, "" when none names one: `user_job.json`'s (written
    when the run ends), else the launch gate's record's (written before its first node, so a run
    still going has it; a built-in run's names a partition instead)."""
    from trainwise.user_jobs import RECORD_FILE

    for name in (RECORD_FILE, job_forecast.LAUNCH_FILE):
        job = _read_json(Path(run_dir) / name).get("job")
        if isinstance(job, str) and job:
            return job
    return ""


def is_user_job_run(run_dir: Path) -> bool:
    """A run of a registered job (re-forecast by `reforecast_user_run`), not a built-in one
    (its request.json: `job_forecast.reforecast_run`)."""
    return not (Path(run_dir) / "request.json").is_file() and bool(job_of_run(run_dir))


def _max_steps_of_run(run_dir: Path, records: list[dict[str, Any]]) -> int:
    """The steps the run goes to, 0 when its code decides: its newest `run_start` (the job's own
    arguments override the spec's), else the newest run spec its launcher wrote (the fixed
    market's segments, the supervised engine's spawns), for a run not started yet."""
    from trainwise.sdk.spec import read_spec

    started = [r for r in records if r["type"] == "run_start"
               and "max_steps" in (r.get("train_config") or {})]
    if started:
        return int(started[-1]["train_config"]["max_steps"] or 0)
    specs = [*run_dir.glob("user_job/segment-*.spec.json"), *run_dir.glob("emulated/spec-*.json")]
    for path in sorted(specs, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            return int(read_spec(path).max_steps or 0)
        except ValueError:  # RunSpecError: one being written; an older one still says it
            continue
    return 0


def _finished(run_dir: Path, record: dict[str, Any]) -> bool:
    """The job called run.finish(): nothing is left, whatever its max_steps said."""
    outcome = _read_json(run_dir / "outcome-rank0.json")
    return "completed" in (record.get("status"), outcome.get("status"))


def _placement_of_run(run_dir: Path, record: dict[str, Any]) -> dict[str, str]:
    """`ask_for`'s market or allocation_policy of the run: the supervised engine's policy
    (user_job.json), else its node's market (gang.json, after any fallback), else the policy
    its launch was forecast as (a supervised run still going), else the default (spot)."""
    from trainwise.gang import read_gang

    if record.get("allocation_policy"):
        return {"allocation_policy": str(record["allocation_policy"])}
    market = ((read_gang(run_dir) or {}).get("allocation") or {}).get("market")
    if market:
        return {"market": str(market)}
    figures = _read_json(run_dir / job_forecast.LAUNCH_FILE).get("forecast") or {}
    policy = figures.get("policy") or (figures.get("remaining") or {}).get("policy")
    return {"allocation_policy": str(policy)} if policy else {}


def reforecast_user_run(state_dir: Path, run_id: str, *, deadline_s: float | None = None,
                        samples: int | None = None, seed: int = 0) -> job_forecast.LiveForecast:
    """The whole run's P50/P90 of a live (or stopped) run of a registered job (module doc): its
    bill so far plus its steps left at the pace it measured (before its own first steps: the
    job's earlier runs'). CannotSizeError without max_steps; FileNotFoundError for a folder
    that names no registered job."""
    from trainwise import explain
    from trainwise import schedule as schedule_lib
    from trainwise.gang import read_gang
    from trainwise.user_jobs import RECORD_FILE

    run_dir = explain.find_run_dir(run_id, Path(state_dir) / "runs")
    job_name = job_of_run(run_dir)
    if not job_name:
        raise FileNotFoundError(
            f"run {run_dir.name} names no registered job (no {RECORD_FILE}, no "
            f"{job_forecast.LAUNCH_FILE} naming one): a built-in run is re-forecast from its "
            "request.json, and a registered job's run launched without max_steps has no forecast")
    records = job_forecast._read_rank0(run_dir)
    record = _read_json(run_dir / RECORD_FILE)
    max_steps = _max_steps_of_run(run_dir, records)
    if not max_steps:
        raise CannotSizeError(
            f"run {run_dir.name} of job {job_name!r}: cannot size its steps left without "
            "max_steps (its code decides when it is done, so its work is unknown); launch it "
            "with max_steps (the Launchpad's) for a forecast")
    ask = ask_for(job_name, max_steps=max_steps, run_id=run_dir.name,
                  **_placement_of_run(run_dir, record))
    done = max((r["step"] for r in records if r["type"] == "step"), default=0)
    left = 0 if _finished(run_dir, record) else max(0, max_steps - done)
    throughput = job_forecast.measure(records, f"measured: this run ({done} steps)") or \
        measured_throughput(state_dir, job_name, exclude=run_dir.name)
    if left and throughput is None:
        raise ValueError(f"run {run_dir.name} of job {job_name!r} has {left} steps left, none "
                         "measured yet and no earlier run of the job; ask again after its "
                         "first steps")
    return _live_forecast(state_dir, run_dir, records, done=done, left=left,
                          throughput=throughput, ask=ask,
                          published=schedule_lib.published(state_dir),
                          clock=job_forecast._live_clock(read_gang(run_dir), ask),
                          deadline_s=deadline_s, samples=samples, seed=seed)


def launch_gate(state_dir: Path, job: JobSpec, project_dir: Path, ask: UserJobAsk,
                published: Any, dataset_dir: Path | None = None) -> dict[str, Any]:
    """The budget check of a launch of a registered job (module doc): the record (written to
    `runs/<run_id>/launch_forecast.json`), or BudgetExceededError over budget without
    `budget_override_reason`. Unforecast (no max_steps, a probe that timed no step): a record
    with "skipped" naming why, nothing written; the launch goes on."""
    if not ask.max_steps:
        return {"run_id": ask.run_id, "job": ask.partition,
                "skipped": f"not forecast: {_cannot_size(ask)}"}
    run_dir = Path(state_dir) / "runs" / ask.run_id
    records = job_forecast._read_rank0(run_dir)
    done = max((r["step"] for r in records if r["type"] == "step"), default=0)
    try:  # a resumed run's own steps first; else the job's earlier runs; else a probe
        throughput = (job_forecast.measure(records, f"measured: this run ({done} steps)")
                      if done else None) or throughput_of(state_dir, job, project_dir,
                                                          dataset_dir, exclude=ask.run_id)
    except (OSError, ValueError) as error:  # the launch itself shows what is wrong
        return {"run_id": ask.run_id, "job": ask.partition, "skipped": f"not forecast ({error})"}
    assert throughput is not None
    if done:
        figures = _resumed_figures(_live_forecast(
            state_dir, run_dir, records, done=done, left=max(0, ask.max_steps - done),
            throughput=throughput, ask=ask, published=published, gate=True,
            clock=job_forecast.provider_clock(ask.instance_type, ask.region)))
    else:
        forecast = _noted(job_forecast.gate_forecast(state_dir, ask, published, throughput), ask)
        figures = {"what": f"{ask.max_steps} steps", **forecast.row()}
    return job_forecast.budget_gate(state_dir, ask.run_id, ask.partition, figures,
                                    figures["p90_usd"], published, ask.budget_override_reason,
                                    override_field=OVERRIDE_FIELD, what_key="job")


def forecast_metadata(record: dict[str, Any]) -> dict[str, Any]:
    """The gate's record as plain materialization metadata: P50/P90 USD and hours, the budget,
    what sized it; or why there was no forecast."""
    if "skipped" in record:
        return {"forecast": record["skipped"]}
    figures = record["forecast"]
    meta = {f"forecast_{name}": round(float(figures[name]), 6)
            for name in ("p50_usd", "p90_usd", "p50_h", "p90_h")}
    meta["budget_usd"] = record["budget_usd"]
    meta["forecast_sized_from"] = str(figures.get("throughput_source")
                                      or (figures.get("remaining") or {}).get("throughput_source")
                                      or figures["what"])
    if record.get("override_reason"):
        meta["budget_override_reason"] = record["override_reason"]
    return meta


__all__ = ["CannotSizeError", "OVERRIDE_FIELD", "PROBE_STEPS", "UserJobAsk", "ask_for",
           "forecast_metadata", "forecast_user_job", "is_user_job_run", "job_of_run",
           "launch_gate", "measured_throughput", "probe_throughput", "reforecast_user_run",
           "throughput_of"]
