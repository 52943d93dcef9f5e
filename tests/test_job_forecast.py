# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""A forecast of the user's own job (issue 28, item 4).

P50/P90 cost and completion time of a `train` partition from its measured throughput (its runs'
telemetry, else a probe of its first steps), shown before launch (CLI; the asset's metadata is
tested in test_cost_forecast.py); the published schedule's budget refuses a launch whose P90
exceeds it (the train job too) unless an override reason is given, which is recorded; a live run
re-forecasts from its bill so far and the steps left, narrowing as it goes.

The synthetic run folders below are unit-test data (a step time we choose, to compare two jobs);
the probe, the real run and the train job use pystdlib's shards (`built_state`)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import dagster as dg
import pytest

from telemetry.events import EvalEvent, RunStartEvent, StepEvent, to_record
from telemetry.writer import SegmentWriter
from tests.test_run_path_faults import PARTITION, built_state, request, run  # noqa: F401
from trainwise import cli, job_forecast, settings
from trainwise import schedule as schedule_lib


@pytest.fixture(autouse=True)
def _small(monkeypatch, tmp_path):
    # The embedded market and a few samples keep each Monte Carlo to about a second.
    monkeypatch.setenv("TRAINWISE_DATA_DIR", str(tmp_path / "no-shared-data"))
    monkeypatch.setenv("TRAINWISE_FORECAST_DEADLINE_H", "24")
    monkeypatch.setenv("TRAINWISE_FORECAST_SAMPLES", "6")


@pytest.fixture
def home(built_state):
    target = settings.home_dir()
    shutil.copytree(built_state, target, dirs_exist_ok=True)
    return target


def _start(run_id):
    return RunStartEvent(run_id=run_id, step=0, wall_time_s=0.0, model_kind="gpt",
                         model_config={}, model_fingerprint="", train_config={},
                         data_fingerprint="", curriculum_version=None, instance_type="p3.2xlarge",
                         price_usd_per_hour=3.06)


def _step(run_id, step, step_time_ms, batch=4, wall=None):
    return StepEvent(run_id=run_id, step=step, wall_time_s=step * step_time_ms / 1000.0
                     if wall is None else wall, train_loss=1.0, learning_rate=1e-3,
                     grad_norm=1.0, grad_noise_scale=0.0, micro_batch_size=batch,
                     grad_accum_steps=1, step_time_ms=step_time_ms, samples_seen=step * batch,
                     tokens_seen=0, elapsed_s=step * step_time_ms / 1000.0, cost_usd=0.0)


def _synthetic_run(state, run_id, *, step_time_ms, steps, max_steps=300, gang=None,
                   partition=PARTITION):
    """A run folder as run_training leaves it: request.json, rank-0 telemetry, gang.json."""
    folder = state / "runs" / run_id
    folder.mkdir(parents=True)
    (folder / "request.json").write_text(json.dumps(dataclasses.asdict(
        request(run_id=run_id, partition=partition, max_steps=max_steps))))
    with SegmentWriter(folder / "telemetry", run_id) as writer:
        writer.write(_start(run_id))
        writer.write(_step(run_id, 1, step_time_ms * 5))  # warm-up: left out
        for step in range(2, steps + 1):
            writer.write(_step(run_id, step, step_time_ms))
        writer.write(EvalEvent(run_id=run_id, step=steps, wall_time_s=steps * step_time_ms /
                               1000.0, eval_loss=1.0, eval_accuracy=None, eval_examples=64,
                               eval_ms=50.0))
    if gang is not None:
        (folder / "gang.json").write_text(json.dumps(gang))
    return folder


def test_throughput_leaves_out_the_warm_up_and_counts_samples():
    records = [to_record(e) for e in (
        _start("a"), _step("a", 1, 900.0, batch=8), _step("a", 2, 100.0, batch=8),
        _step("a", 3, 300.0, batch=8))]
    measured = job_forecast.measure(records, "x")
    assert measured.steps == 2 and measured.s_per_sample == pytest.approx(0.4 / 16)
    assert job_forecast.measure(records[:2], "x") is None  # only a warm-up step


def test_a_job_is_sized_from_its_runs_and_a_slower_one_forecasts_more(tmp_path):
    published = schedule_lib.published(tmp_path / "fast")
    jobs = {}
    for name, step_ms in (("fast", 100.0), ("slow", 300.0)):
        state = tmp_path / name
        _synthetic_run(state, f"{name}-run", step_time_ms=step_ms, steps=20)
        job = job_forecast.forecast_job(state, job_forecast.request_for(
            PARTITION, published, micro_batch_size=4, max_steps=300), published, probe=False)
        assert job.throughput_source.startswith(f"measured: runs {name}-run (19 steps)")
        assert job.s_per_sample == pytest.approx(step_ms / 1000.0 / 4)
        jobs[name] = job
    fast, slow = jobs["fast"], jobs["slow"]
    assert slow.work_node_h > 2.5 * fast.work_node_h  # 3x the step time, the same evals
    assert slow.p50_usd > fast.p50_usd and slow.p90_usd > fast.p90_usd
    assert fast.p50_usd <= fast.p90_usd and fast.p50_h <= fast.p90_h
    # Another partition's run is not this job's throughput.
    assert job_forecast.measured_throughput(tmp_path / "fast", "mnist") is None


def test_a_job_without_runs_is_probed_and_its_run_then_sizes_it(home):
    published = schedule_lib.published(home)
    asked = job_forecast.request_for(PARTITION, published, micro_batch_size=4, max_steps=40)
    assert job_forecast.forecast_job(home, asked, published, probe=False) is None
    probed = job_forecast.forecast_job(home, asked, published)
    assert probed.throughput_source == "probe of 3 steps" and probed.s_per_sample > 0
    assert probed.clock_factor > 1 and "emulated provider" in probed.clock_source
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())  # a scratch probe
    # A real run of the job: its telemetry sizes the next forecast, its bill is the re-forecast.
    run(home, request(max_steps=6, micro_batch_size=4))
    measured = job_forecast.forecast_job(home, asked, published)
    assert measured.throughput_source.startswith("measured: runs run-a (5 steps)")
    live = job_forecast.reforecast_run(home, "run-a")
    bill = json.loads((home / "runs" / "run-a" / "gang.json").read_text())["cost_usd"]
    assert live.steps_done == 6 and live.remaining is None
    assert live.p50_usd == live.p90_usd == pytest.approx(bill)
    # Read from the bill the provider's holder wrote into the telemetry, not extrapolated.
    assert live.bill_so_far_usd == pytest.approx(bill)
    assert live.bill_source == "the provider's bill (final)"


def _live(state, run_id, done, max_steps=1000, step_ms=36_000.0):
    """A live run `done` steps in: its provider clock runs with the wall clock (factor 1)."""
    wall = done * step_ms / 1000.0
    gang = {"provider": "emulated", "instance_type": "p3.2xlarge", "zone": "embedded-a",
            "market": "on_demand", "nodes": 1, "cost_usd": 3.06 * wall / 3600,
            "provider_now_s": wall, "history": [{"wall_time_s": 0.0, "provider_time_s": 0.0},
                                                {"wall_time_s": wall, "provider_time_s": wall}]}
    return _synthetic_run(state, run_id, step_time_ms=step_ms, steps=done, max_steps=max_steps,
                          gang=gang)


def test_a_live_run_re_forecasts_and_narrows_as_it_goes(tmp_path):
    early, late = tmp_path / "early", tmp_path / "late"
    _live(early, "live", 100)
    _live(late, "live", 900)
    first = job_forecast.reforecast_run(early, "live", samples=12)
    last = job_forecast.reforecast_run(late, "live", samples=12)
    assert (first.steps_done, last.steps_done) == (100, 900)
    assert first.remaining.steps == 900 and last.remaining.steps == 100
    assert first.remaining.clock_factor == pytest.approx(1.0)
    # The bill so far is gang.json's; the whole run is it plus the rest.
    assert last.bill_so_far_usd == pytest.approx(3.06 * 9 * 3600 / 3600)
    assert last.p50_usd == pytest.approx(last.bill_so_far_usd + last.remaining.p50_usd)
    assert first.p50_h >= first.elapsed_h == pytest.approx(1.0)
    assert (last.p90_usd - last.p50_usd) < (first.p90_usd - first.p50_usd)
    # Completion: the policy may spend the slack waiting for spot, never past the deadline.
    assert first.remaining.deadline_risk == last.remaining.deadline_risk == 0.0
    assert first.p90_h <= 24.0 and last.p90_h <= 24.0


def test_the_launch_is_refused_over_budget_with_the_figures_and_an_override_passes(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "0.5")
    state = tmp_path / "state"
    _synthetic_run(state, "earlier", step_time_ms=100.0, steps=20)
    published = schedule_lib.published(state)
    asked = job_forecast.request_for(PARTITION, published, max_steps=100, run_id="next")
    with pytest.raises(job_forecast.BudgetExceededError) as refused:
        job_forecast.launch_gate(asked, published, state)
    message, record = str(refused.value), refused.value.record
    assert record["p90_usd"] > 0.5 and record["over_budget"]
    assert f"P90 {record['p90_usd']:.2f} USD" in message and "budget of 0.5 USD" in message
    assert published.version in message and "schedule_override_reason" in message
    assert not (state / "runs" / "next").exists()  # nothing written for a refused launch
    # Within budget it passes with no override; over it with a reason, recorded with the run.
    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "100000")
    within = job_forecast.launch_gate(asked, schedule_lib.published(state), state)
    assert not within["over_budget"] and within["override_reason"] == ""
    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "0.5")
    forced = job_forecast.launch_gate(
        job_forecast.request_for(PARTITION, published, max_steps=100, run_id="next",
                                 schedule_override_reason="deadline demo, approved by ops"),
        published, state)
    saved = json.loads((state / "runs" / "next" / job_forecast.LAUNCH_FILE).read_text())
    assert forced["over_budget"] and saved["override_reason"] == "deadline demo, approved by ops"
    assert saved["p90_usd"] == pytest.approx(record["p90_usd"])


def test_the_train_job_refuses_over_budget_and_records_an_override(home, monkeypatch):
    from pipelines.definitions import defs

    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "0.0001")
    config = {"max_steps": 2, "micro_batch_size": 4}
    with dg.instance_for_test() as instance:
        refused = defs.resolve_job_def("train").execute_in_process(
            partition_key=PARTITION, instance=instance, raise_on_error=False,
            run_config={"ops": {"checkpoint": {"config": config}}})
        assert not refused.success
        failure = refused.get_step_failure_events()[0].step_failure_data.error.message
        assert "launch refused" in failure and "budget of 0.0001 USD" in failure
        assert "P90" in failure and "schedule_override_reason" in failure
        assert not (home / "runs" / refused.run_id / "request.json").exists()  # never started
        forced = defs.resolve_job_def("train").execute_in_process(
            partition_key=PARTITION, instance=instance, run_config={"ops": {"checkpoint": {
                "config": {**config, "schedule_override_reason": "budget test"}}}})
        assert forced.success
        assert forced.dagster_run.tags["trainwise/budget_override"] == "budget test"
        saved = json.loads((home / "runs" / forced.run_id / job_forecast.LAUNCH_FILE).read_text())
        assert saved["over_budget"] and saved["p90_usd"] > 0.0001


def test_the_cli_prints_the_forecast_and_the_live_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINWISE_HOME", str(tmp_path / "state"))
    _synthetic_run(tmp_path / "state", "earlier", step_time_ms=100.0, steps=20)
    assert cli.main(["forecast", PARTITION, "--steps", "40", "--deadline-h", "12"]) == 0
    out = capsys.readouterr().out
    [row] = [line.split() for line in out.splitlines() if line.startswith(PARTITION)]
    assert "P50 USD" in out and "P90 h" in out and row[1] == "40"
    assert float(row[2]) <= float(row[3])  # P50 <= P90
    assert "measured: runs earlier" in out and "within the budget" in out
    _live(tmp_path / "state", "live", 100)
    assert cli.main(["forecast", "--run", "live"]) == 0
    out = capsys.readouterr().out
    assert "step 100 of 1000" in out and "remaining" in out and "whole run" in out
    assert cli.main(["forecast", "nope"]) == 2 and "nope" in capsys.readouterr().err
    assert cli.main(["forecast", "--run", "missing"]) == 2
    assert "no run 'missing'" in capsys.readouterr().err
