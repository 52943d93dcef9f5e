# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""The forecast of a team's registered job (issue 28 item 4, for `[jobs.NAME]` of a project file;
`trainwise.user_job_forecast` on `trainwise.job_forecast`'s engine).

P50/P90 cost and hours of a launch from the job's measured seconds per step (its earlier runs'
step events, else a probe of its own command), its max_steps, the provider's clock and its
region's market; printed by `trainwise forecast --job`; the Launchpad's launch (`user_job_run`)
is refused before any node when its P90 exceeds the published schedule's budget, unless it gives
`budget_override_reason` (recorded in the run's tags and launch_forecast.json).

The synthetic run folders are unit-test data (a step time we choose); the probe runs the
plain-loop example (`examples/plain_loop`) and the asset test's job, for real."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import dagster as dg
import pytest

from assets.data import data_shards_asset
from assets.partitions import partitions_for
from assets.resources import MLflowResource, ObjectStoreResource, StateResource
from assets.user_jobs import user_job_defs
from telemetry.events import RunStartEvent, StepEvent
from telemetry.writer import SegmentWriter
from tests.test_user_job_asset import _provider, project  # noqa: F401
from trainwise import cli, gang, job_forecast, user_job_forecast
from trainwise import schedule as schedule_lib
from trainwise.sdk.spec import RunSpec
from trainwise.user_jobs import RECORD_FILE, UserJobLaunch
from trainwise.user_project import JobSpec, load_project_file

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ROOT / "examples" / "plain_loop"
PLAIN_JOB = "blobs-classifier"


@pytest.fixture(autouse=True)
def _small(monkeypatch, tmp_path):
    # The embedded market, a few samples and a provider whose clock is known (650 provider s
    # per wall s): each Monte Carlo in about a second.
    monkeypatch.setenv("TRAINWISE_DATA_DIR", str(tmp_path / "no-shared-data"))
    monkeypatch.setenv("TRAINWISE_FORECAST_DEADLINE_H", "24")
    monkeypatch.setenv("TRAINWISE_FORECAST_SAMPLES", "6")
    monkeypatch.setattr(gang, "provider_for_run", _provider)


def _job(name: str = "fit") -> JobSpec:
    return JobSpec(name=name, entry="train.py", entry_kind="script", script=None,
                   dataset="points")


def _earlier_run(state: Path, run_id: str, job: str, *, step_time_ms: float, steps: int,
                 record: str = RECORD_FILE, max_steps: int | None = None) -> Path:
    """A finished run of `job` as the launcher leaves it: user_job.json and the SDK's rank-0
    step events (its first step slow: warm-up); `max_steps` in its run_start as the SDK
    records it (none: the job decides)."""
    folder = state / "runs" / run_id
    folder.mkdir(parents=True)
    (folder / record).write_text(json.dumps({"job": job, "run_id": run_id,
                                             "status": "completed"}))
    with SegmentWriter(folder / "telemetry", run_id) as writer:
        writer.write(RunStartEvent(
            run_id=run_id, step=0, wall_time_s=0.0, model_kind="user:Linear", model_config={},
            model_fingerprint="", data_fingerprint="", curriculum_version=None,
            train_config={} if max_steps is None else {"max_steps": max_steps},
            instance_type="p3.2xlarge", price_usd_per_hour=3.06))
        for step in range(1, steps + 1):
            ms = step_time_ms * (5 if step == 1 else 1)
            writer.write(StepEvent(
                run_id=run_id, step=step, wall_time_s=step * step_time_ms / 1000.0,
                train_loss=1.0, learning_rate=1e-3, grad_norm=float("nan"),
                grad_noise_scale=float("nan"), micro_batch_size=16, grad_accum_steps=1,
                step_time_ms=ms, samples_seen=16 * step, tokens_seen=0,
                elapsed_s=step * step_time_ms / 1000.0, cost_usd=0.0))
    return folder


def _ask(max_steps: int, **fields) -> user_job_forecast.UserJobAsk:
    return user_job_forecast.ask_for("fit", max_steps=max_steps, **fields)


def test_a_job_is_sized_from_its_earlier_runs_and_scales_with_max_steps(tmp_path):
    state = tmp_path / "state"
    _earlier_run(state, "fit-old", "fit", step_time_ms=20.0, steps=20)
    _earlier_run(state, "other-1", "other", step_time_ms=5000.0, steps=20)  # another job
    _earlier_run(state, "train-1", "fit", step_time_ms=5000.0, steps=20,
                 record="request.json")  # not a registered job's run
    published = schedule_lib.published(state)
    small = user_job_forecast.forecast_user_job(state, _job(), tmp_path, _ask(300), published,
                                                probe=False)
    assert small.throughput_source == "measured: runs fit-old (19 steps)"
    assert small.s_per_step == pytest.approx(0.02)  # the warm-up step left out
    assert small.partition == "fit" and small.steps == 300
    assert small.clock_factor == pytest.approx(650.0)  # the provider's clock
    assert small.policy == "managed_spot" and "fixed market spot" in small.note
    # Work: 300 steps x 0.02 s (+ one final save, none measured) x 650 on the provider's clock.
    assert small.work_node_h == pytest.approx(300 * 0.02 * 650 / 3600, rel=1e-6)
    assert 0 < small.p50_usd <= small.p90_usd and small.p50_h <= small.p90_h
    large = user_job_forecast.forecast_user_job(state, _job(), tmp_path, _ask(3000), published,
                                                probe=False)
    assert large.work_node_h == pytest.approx(10 * small.work_node_h)
    assert large.p50_usd > small.p50_usd and large.p90_usd > small.p90_usd
    assert large.p50_h > small.p50_h
    # On-demand: its P50 and P90 are one price; the allocation policy, as the Launchpad gives it.
    on_demand = user_job_forecast.forecast_user_job(
        state, _job(), tmp_path, _ask(300, market="on_demand"), published, probe=False)
    assert on_demand.policy == "on_demand" and on_demand.p50_usd == pytest.approx(
        on_demand.p90_usd)
    assert user_job_forecast.forecast_user_job(
        state, _job(), tmp_path, _ask(300, allocation_policy="uniform_progress"), published,
        probe=False).policy == "uniform_progress"
    # A job without runs, not probed: no forecast; without max_steps: it cannot be sized.
    assert user_job_forecast.forecast_user_job(state, _job("new"), tmp_path, _ask(300),
                                               published, probe=False) is None
    with pytest.raises(user_job_forecast.CannotSizeError, match="cannot size the job"):
        user_job_forecast.forecast_user_job(state, _job(), tmp_path, _ask(0), published)
    with pytest.raises(ValueError, match="uniform_progress"):  # the valid names
        _ask(300, allocation_policy="nope")


def test_a_job_without_runs_is_probed_on_its_own_command(tmp_path):
    """The plain-loop example's own arguments ask for 40 steps: the probe stops it after its
    first few, in a scratch folder, and times them from its telemetry."""
    home = tmp_path / "home"
    job = load_project_file(PLAIN / "trainwise.toml").jobs[PLAIN_JOB]
    published = schedule_lib.published(home)
    forecast = user_job_forecast.forecast_user_job(
        home, job, PLAIN, user_job_forecast.ask_for(job.name, max_steps=400), published)
    assert forecast.throughput_source.startswith("probe of ")
    probed = int(forecast.throughput_source.split()[2])
    assert probed == user_job_forecast.PROBE_STEPS  # its step_limit, not its own 40 steps
    assert forecast.s_per_step > 0 and 0 < forecast.p50_usd <= forecast.p90_usd
    assert not (home / "runs").exists()  # a scratch probe: no run folder, no store
    # A job that never steps: named, with its log.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "train.py").write_text("print('no trainwise here')\nraise SystemExit(3)\n")
    job = JobSpec(name="broken", entry="train.py", entry_kind="script",
                  script=broken / "train.py", dataset="points")
    with pytest.raises(ValueError, match="timed no step") as failed:
        user_job_forecast.probe_throughput(job, broken)
    assert "exit 3" in str(failed.value) and "no trainwise here" in str(failed.value)


def test_the_cli_prints_a_registered_jobs_forecast(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("TRAINWISE_HOME", str(home))
    monkeypatch.setenv("TRAINWISE_PROJECT_FILE", str(PLAIN / "trainwise.toml"))
    _earlier_run(home, "blobs-1", PLAIN_JOB, step_time_ms=100.0, steps=20)
    assert cli.main(["forecast", "--job", PLAIN_JOB, "--max-steps", "400"]) == 0
    out = capsys.readouterr().out
    [row] = [line.split() for line in out.splitlines() if line.startswith(f"job {PLAIN_JOB}")]
    assert "P50 USD" in out and "P90 h" in out and row[2] == "400"
    assert float(row[3]) <= float(row[4])  # P50 <= P90
    assert "measured: runs blobs-1 (19 steps)" in out and "0.1 s per step" in out
    assert "within the budget" in out
    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "0.0001")
    assert cli.main(["forecast", "--job", PLAIN_JOB, "--max-steps", "400"]) == 0
    assert "OVER the budget" in (out := capsys.readouterr().out)
    assert "budget_override_reason" in out
    assert cli.main(["forecast", "--job", PLAIN_JOB]) == 2
    assert "cannot size the job without max_steps" in capsys.readouterr().err
    assert cli.main(["forecast", "--job", "nope", "--max-steps", "10"]) == 2
    assert "not registered" in capsys.readouterr().err


def test_the_gate_refuses_over_budget_and_records_an_override(tmp_path, monkeypatch):
    state = tmp_path / "state"
    _earlier_run(state, "fit-old", "fit", step_time_ms=200.0, steps=20)
    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "0.01")
    published = schedule_lib.published(state)
    with pytest.raises(job_forecast.BudgetExceededError) as refused:
        user_job_forecast.launch_gate(state, _job(), tmp_path, _ask(300, run_id="fit-2"),
                                      published)
    message, record = str(refused.value), refused.value.record
    assert record["over_budget"] and record["p90_usd"] > 0.01 and record["job"] == "fit"
    assert f"P90 {record['p90_usd']:.2f} USD" in message and "budget of 0.01 USD" in message
    assert "budget_override_reason" in message and published.version in message
    assert not (state / "runs" / "fit-2").exists()  # nothing written for a refused launch
    forced = user_job_forecast.launch_gate(
        state, _job(), tmp_path, _ask(300, run_id="fit-2", budget_override_reason="demo"),
        published)
    saved = json.loads((state / "runs" / "fit-2" / job_forecast.LAUNCH_FILE).read_text())
    assert forced["override_reason"] == saved["override_reason"] == "demo"
    assert saved["forecast"]["throughput_source"] == "measured: runs fit-old (19 steps)"
    meta = user_job_forecast.forecast_metadata(forced)
    assert meta["forecast_p50_usd"] <= meta["forecast_p90_usd"] == pytest.approx(
        record["p90_usd"], abs=1e-6)
    # No max_steps: not forecast, said so, and the launch goes on (nothing written).
    skipped = user_job_forecast.launch_gate(state, _job(), tmp_path, _ask(0, run_id="fit-3"),
                                            published)
    assert "cannot size the job" in skipped["skipped"]
    assert not (state / "runs" / "fit-3").exists()
    assert "cannot size" in user_job_forecast.forecast_metadata(skipped)["forecast"]
    # The same run_id again (a resume): its bill so far plus its steps left, at its own pace.
    _earlier_run(state, "fit-4", "fit", step_time_ms=20.0, steps=100)
    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "1000")
    resumed = user_job_forecast.launch_gate(state, _job(), tmp_path, _ask(300, run_id="fit-4"),
                                            schedule_lib.published(state))
    figures = resumed["forecast"]
    assert figures["steps_done"] == 100 and "100 steps left" not in figures["what"]
    assert "200 steps left" in figures["what"] and figures["remaining"]["steps"] == 200
    assert figures["remaining"]["throughput_source"] == "measured: this run (100 steps)"
    assert figures["p50_usd"] == pytest.approx(figures["bill_so_far_usd"]
                                               + figures["remaining"]["p50_usd"], abs=1e-5)


def test_the_launchpad_refuses_a_launch_over_budget_before_any_node(
        tmp_path, project, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("TRAINWISE_HOME", str(home))
    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "0.0001")
    sessions = []
    real_session = gang.GangSession
    monkeypatch.setattr(gang, "GangSession",
                        lambda *a, **k: sessions.append(a) or real_session(*a, **k))
    shards = data_shards_asset(partitions_for(project), project.datasets)
    [asset] = user_job_defs(project, shards)["assets"]
    resources = {"state": StateResource(home=str(home)),
                 "object_store": ObjectStoreResource(local_root=str(tmp_path / "store")),
                 "mlflow": MLflowResource(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")}
    assert dg.materialize([shards], partition_key="points", resources=resources).success
    config = {"job": "fit", "max_steps": 12, "market": "on_demand", "checkpoint_every_steps": 5}
    with dg.instance_for_test() as instance:
        refused = dg.materialize(
            [shards.to_source_asset(), asset], resources=resources, instance=instance,
            raise_on_error=False,
            run_config={"ops": {"user_job_run": {"config": {**config, "run_id": "fit-1"}}}})
        assert not refused.success
        failure = refused.get_step_failure_events()[0].step_failure_data.error.message
        assert "launch refused" in failure and "budget of 0.0001 USD" in failure
        assert "P90" in failure and "budget_override_reason" in failure
        assert "for 12 steps of fit" in failure
        run_dir = home / "runs" / "fit-1"
        assert not sessions  # no node was asked for
        for name in (RECORD_FILE, "gang.json", job_forecast.LAUNCH_FILE):
            assert not (run_dir / name).exists(), name

        forced = dg.materialize(
            [shards.to_source_asset(), asset], resources=resources, instance=instance,
            run_config={"ops": {"user_job_run": {"config": {
                **config, "run_id": "fit-2", "budget_override_reason": "budget test, ops"}}}})
        assert forced.success and len(sessions) == 1
        tags = instance.get_run_by_id(forced.run_id).tags
        assert tags["trainwise/budget_override"] == "budget test, ops"
    saved = json.loads((home / "runs" / "fit-2" / job_forecast.LAUNCH_FILE).read_text())
    assert saved["over_budget"] and saved["override_reason"] == "budget test, ops"
    assert saved["forecast"]["throughput_source"].startswith("probe of ")
    [materialization] = forced.asset_materializations_for_node("user_job_run")
    meta = {k: v.value for k, v in materialization.metadata.items()}
    assert meta["status"] == "completed" and meta["steps"] >= 12
    assert 0 < meta["forecast_p50_usd"] <= meta["forecast_p90_usd"]
    assert meta["forecast_p50_h"] <= meta["forecast_p90_h"]
    assert meta["budget_usd"] == pytest.approx(0.0001)
    assert meta["budget_override_reason"] == "budget test, ops"


def _launch_plain(home: Path, run_id: str, job: JobSpec, market: str) -> dict:
    """A run of the plain-loop example as the Launchpad launches it on a fixed market (the
    test provider: spot reclaimed after 4 ticks of 0.3 wall s), its own 40 steps."""
    run_dir = home / "runs" / run_id
    session = gang.GangSession(_provider(), gang.Allocation(market=market, nodes=1,
                                                            reason="test", source="test"),
                               "p3.2xlarge", run_dir, run_id)
    spec = RunSpec(run_id=run_id, run_dir=str(run_dir), store_root=str(home / "store"))
    return UserJobLaunch(job, PLAIN, session, spec).run()


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    """Two runs of the plain-loop example, launched for real: one stopped part-way (its spot
    node reclaimed a few steps in, no replacement allowed: interrupted, as a run whose market
    flapped too often is), one finished on on-demand."""
    home = tmp_path_factory.mktemp("plain") / "home"
    job = load_project_file(PLAIN / "trainwise.toml").jobs[PLAIN_JOB]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gang, "MAX_REPLACEMENTS", 0)
        slowed = dataclasses.replace(job, args=(*job.args, "--step-sleep-s", "0.1"))
        stopped = _launch_plain(home, "blobs-stopped", slowed, "spot")
        finished = _launch_plain(home, "blobs-finished", job, "on_demand")
    assert stopped["status"] == "interrupted" and stopped["reclaims"] == 1, stopped
    assert finished["status"] == "completed", finished
    return home


def test_a_stopped_user_job_run_is_reforecast_from_its_bill_and_its_steps_left(plain_runs):
    home = plain_runs
    records = job_forecast._read_rank0(home / "runs" / "blobs-stopped")
    stepped = max(r["step"] for r in records if r["type"] == "step")
    assert 2 <= stepped < 40  # stopped part-way, with a measured step past the warm-up
    live = user_job_forecast.reforecast_user_run(home, "blobs-stopped")
    assert live.run_id == "blobs-stopped" and live.steps_done == stepped
    assert live.max_steps == 40  # the job's own --max-steps (its run_start), not the spec's
    assert live.bill_so_far_usd > 0 and live.bill_source == "the provider's bill (final)"
    rest = live.remaining
    assert rest is not None and rest.steps == 40 - stepped and rest.partition == PLAIN_JOB
    assert rest.throughput_source == f"measured: this run ({stepped} steps)"
    assert rest.s_per_step >= 0.1  # its --step-sleep-s is inside each step
    assert rest.policy == "managed_spot" and "fixed market spot" in rest.note  # its node's
    assert rest.clock_source.startswith("this run's provider")  # gang.json's history
    assert live.bill_so_far_usd < live.p50_usd <= live.p90_usd
    assert live.p50_usd == pytest.approx(live.bill_so_far_usd + rest.p50_usd)
    assert live.p90_usd == pytest.approx(live.bill_so_far_usd + rest.p90_usd)
    assert live.elapsed_h < live.p50_h <= live.p90_h
    # The same seed gives the same figures (the CLI test compares its printout with them).
    assert user_job_forecast.reforecast_user_run(home, "blobs-stopped") == live


def test_a_finished_user_job_run_has_nothing_left(plain_runs):
    live = user_job_forecast.reforecast_user_run(plain_runs, "blobs-finished")
    assert live.remaining is None and live.steps_done == live.max_steps == 40
    assert live.bill_so_far_usd > 0 and "final" in live.bill_source
    assert live.p50_usd == live.p90_usd == live.bill_so_far_usd
    assert live.p50_h == live.p90_h == live.elapsed_h


def test_a_user_job_run_still_going_is_sized_from_its_launch_record(tmp_path):
    """A run still going has no user_job.json yet: the gate's launch_forecast.json names its
    job, its run_start its max_steps; no gang.json yet: its node time at the on-demand price."""
    state = tmp_path / "state"
    _earlier_run(state, "fit-live", "fit", step_time_ms=20.0, steps=100, max_steps=300,
                 record=job_forecast.LAUNCH_FILE)
    assert user_job_forecast.is_user_job_run(state / "runs" / "fit-live")
    live = user_job_forecast.reforecast_user_run(state, "fit-live", samples=4, seed=1)
    assert live.steps_done == 100 and live.max_steps == 300
    assert "on-demand price" in live.bill_source
    assert live.remaining.steps == 200 and live.remaining.s_per_step == pytest.approx(0.02)
    assert live.bill_so_far_usd < live.p50_usd <= live.p90_usd
    # Without max_steps (its code decides): no forecast, said so with the fix.
    _earlier_run(state, "fit-open", "fit", step_time_ms=20.0, steps=10)
    with pytest.raises(user_job_forecast.CannotSizeError,
                       match="run fit-open of job 'fit': cannot size its steps left"):
        user_job_forecast.reforecast_user_run(state, "fit-open")
    # Only its warm-up step and no earlier run of its job: nothing to size the rest from.
    _earlier_run(state, "new-1", "new", step_time_ms=20.0, steps=1, max_steps=50,
                 record=job_forecast.LAUNCH_FILE)
    with pytest.raises(ValueError, match="49 steps left, none measured yet"):
        user_job_forecast.reforecast_user_run(state, "new-1")
    # A built-in run is not one of a registered job's.
    _earlier_run(state, "train-1", "fit", step_time_ms=20.0, steps=5, record="request.json")
    assert not user_job_forecast.is_user_job_run(state / "runs" / "train-1")
    with pytest.raises(FileNotFoundError, match="names no registered job"):
        user_job_forecast.reforecast_user_run(state, "train-1")


def test_the_cli_reforecasts_a_registered_jobs_run(plain_runs, monkeypatch, capsys):
    home = plain_runs
    monkeypatch.setenv("TRAINWISE_HOME", str(home))
    live = user_job_forecast.reforecast_user_run(home, "blobs-stopped")
    assert cli.main(["forecast", "--run", "blobs-stopped"]) == 0
    out = capsys.readouterr().out
    assert f"run blobs-stopped: step {live.steps_done} of 40; bill so far from the " \
           "provider's bill (final)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()  # the table's rows
            if line.strip().startswith(("so far", "remaining", "whole run"))
            and "sized from" not in line}
    assert rows["so"][2:5] == [str(live.steps_done), f"{live.bill_so_far_usd:.2f}",
                               f"{live.elapsed_h:.2f}"]
    assert rows["remaining"][1] == str(40 - live.steps_done)
    assert rows["whole"][2:7] == ["40", f"{live.p50_usd:.2f}", f"{live.p90_usd:.2f}",
                                  f"{live.p50_h:.2f}", f"{live.p90_h:.2f}"]
    assert f"remaining sized from measured: this run ({live.steps_done} steps)" in out
    assert cli.main(["forecast", "--run", "blobs-finished"]) == 0
    out = capsys.readouterr().out
    assert "step 40 of 40" in out and "whole run" in out and "remaining" not in out
    assert cli.main(["forecast", "--run", "missing"]) == 2
    assert "no run 'missing'" in (err := capsys.readouterr().err)
    assert "blobs-stopped" in err  # the runs known
