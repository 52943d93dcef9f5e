"""benchmarks.fidelity: the simulator's figures against the emulated run's, with honest errors."""

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest

from benchmarks import fidelity
from benchmarks.fidelity_calibrate import Calibration
from controllers.allocation_types import AllocationAction, AllocationObservation
from tests.shared_data import needs_spot_data


def test_rel_err_is_predicted_minus_measured_over_measured():
    assert fidelity.rel_err(110.0, 100.0) == pytest.approx(0.10)
    assert fidelity.rel_err(95.0, 100.0) == pytest.approx(-0.05)
    assert fidelity.rel_err(0.0, 0.0) == 0.0
    assert math.isinf(fidelity.rel_err(1.0, 0.0))


def _row(cost_err, completion_err, preempt_diff=0):
    return {"rel_err": {"cost": cost_err, "completion": completion_err},
            "preemptions_diff": preempt_diff}


def test_summary_reports_median_and_worst_absolute_errors_and_the_goal():
    rows = [_row(0.01, -0.02), _row(-0.04, 0.03), _row(0.20, -0.10, 1)]
    s = fidelity.summarise(rows)
    assert s["cost"]["median_abs_rel_err"] == pytest.approx(0.04)
    assert s["cost"]["worst_abs_rel_err"] == pytest.approx(0.20)
    assert s["completion"]["worst_abs_rel_err"] == pytest.approx(0.10)
    assert s["cost"]["windows_within_goal"] == 2
    assert s["preemptions_exact"] == 2
    assert s["goal_met"] is False
    assert fidelity.summarise(rows[:2])["goal_met"] is True
    # The goal is 5% (README), both figures, either sign; exactly 5% still meets it.
    assert fidelity.summarise([_row(0.05, -0.05)])["goal_met"] is True
    edge = fidelity.summarise([_row(0.049, -0.02), _row(-0.051, 0.01), _row(0.01, 0.051)])
    assert edge["goal_met"] is False
    assert edge["cost"]["windows_within_goal"] == 2 and edge["completion"][
        "windows_within_goal"] == 2


def test_same_view_shows_the_emulated_work_and_drops_interval_requests():
    seen = {}

    class Inner:
        name = "inner"

        def act(self, observation):
            seen["obs"] = observation
            return AllocationAction("z", 1, 0, checkpoint_interval_s=123.0)

    fields = {f.name: 0 for f in dataclasses.fields(AllocationObservation)}
    fields.update(work_done_h=0.5, work_checkpointed_h=0.25, work_total_h=1.0,
                  checkpoint_save_s=60.0, checkpoint_interval_s=3600.0,
                  zones=("z",), spot_available_by_zone=(1,),
                  spot_price_usd_per_hour_by_zone=(1.0,), on_demand_price_usd_per_hour_by_zone=(
                      3.0,), preemption_times_s=(), zone=None, last_zone=None, home_zone="z",
                  in_changeover=False, launch_failed=False)
    view = fidelity.SameView(Inner(), save_s=60.0, interval_s=3600.0, work_total_h=2.0)
    action = view.act(AllocationObservation(**fields))
    assert action.checkpoint_interval_s is None
    assert seen["obs"].work_total_h == 2.0
    assert seen["obs"].work_done_h == pytest.approx(1.0)
    assert seen["obs"].work_checkpointed_h == pytest.approx(0.5)


def _calibration():
    return Calibration(method="test", steps=20, checkpoint_every_steps=5,
                       emulated_per_wall_s=975.0, step_s=100.0, save_s=10.0,
                       changeover_s=360.0, tail_s=500.0, emulated_changeover_s=360.0,
                       emulated_save_s=60.0, emulated_interval_s=3600.0)


@needs_spot_data
def test_prediction_comes_from_the_simulator_not_the_measurement():
    """The predicted figures are the simulator's on the window; the measured ones are only
    compared, so a wildly wrong measurement gives a wildly wrong error, not a changed
    prediction."""
    cal = _calibration()
    window = fidelity.pick_windows(1)[0]
    emulated = SimpleNamespace(deadline_s=2 * (cal.pure_step_s * 20 + 360.0))
    first = fidelity.prediction(emulated, window, cal, "greedy_spot",
                                {"cost_usd": 1.0, "completion_s": 5000.0, "preemptions": 1})
    second = fidelity.prediction(emulated, window, cal, "greedy_spot",
                                 {"cost_usd": 100.0, "completion_s": 1.0, "preemptions": 9})
    assert first["predicted"] == second["predicted"]
    p = first["predicted"]
    assert p["cost_usd"] > 0 and p["completion_s"] > 0
    assert first["rel_err"]["cost"] == pytest.approx((p["cost_usd"] - 1.0) / 1.0)
    assert second["rel_err"]["completion"] == pytest.approx(p["completion_s"] - 1.0)
    # The tail is added once to the simulator's completion; notices billed per preemption.
    raw = first["simulator_raw"]["completion_s"]
    assert p["completion_s"] == pytest.approx(raw + cal.tail_s)


@needs_spot_data
def test_windows_are_distinct_real_trace_windows():
    windows = fidelity.pick_windows(12)
    assert len(windows) == 12
    assert len({(w.folder, w.zone_file, w.start_tick) for w in windows}) == 12
    calibration_files = {(f, z) for f, z, _ in fidelity.CALIBRATION_WINDOWS}
    assert not calibration_files & {(w.folder, w.zone_file) for w in windows}


@pytest.mark.slow
@needs_spot_data
def test_quick_run_writes_per_window_predicted_and_measured(tmp_path):
    """--quick on one window: real trainer processes (about a minute on a loaded machine)."""
    assert fidelity.main(["--quick", "--windows", "1", "--multi-zone-windows", "0",
                           "--gang-windows", "0", "--out-dir", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "fidelity.json").read_text())
    assert (tmp_path / "fidelity.md").is_file() and (tmp_path / "fidelity.png").is_file()
    (row,) = payload["windows"]
    assert row["measured_source"] != row["predicted_source"]
    for key in ("cost_usd", "completion_s", "preemptions"):
        assert key in row["measured"] and key in row["predicted"]
    # The row's errors are its own predicted figures against its own measured ones (the error
    # itself: test_rel_err_is_predicted_minus_measured_over_measured).
    m, p = row["measured"], row["predicted"]
    assert row["rel_err"]["cost"] == fidelity.rel_err(p["cost_usd"], m["cost_usd"])
    assert row["rel_err"]["completion"] == fidelity.rel_err(p["completion_s"], m["completion_s"])
    assert payload["goal_rel_err"] == 0.05  # README: 5%
    assert payload["calibration"]["runs"][0]["policy"] == "on_demand"
    assert payload["summary"]["cost"]["windows"] == 1


def test_calibration_moves_to_another_trace_tick_length():
    """Step, save and tail were measured in wall seconds: a trace ticking at another length
    replays at another speed, and they scale with it (the changeover does not)."""
    slow = _calibration().at_rate(975.0 / 3)
    assert slow.step_s == pytest.approx(100.0 / 3)
    assert slow.tail_s == pytest.approx(500.0 / 3)
    assert slow.changeover_s == 360.0


def test_a_launchs_first_step_warm_up_is_measured_into_the_changeover(tmp_path):
    """Every step is on the emulated clock, the first after a boot too, whose excess over a
    steady step (warm-up) is a per-launch cost: the calibration measures it from the trainers'
    telemetry and the simulator's changeover is the configured one plus it, scaled with the
    replay speed (it was measured in wall seconds)."""
    from benchmarks import fidelity_calibrate as fc
    from telemetry.events import RunStartEvent, StepEvent
    from telemetry.writer import SegmentWriter

    def step(n: int, wall: float) -> StepEvent:
        return StepEvent(run_id="r", rank=0, step=n, wall_time_s=wall, train_loss=1.0,
                         learning_rate=0.1, grad_norm=1.0, grad_noise_scale=0.0,
                         micro_batch_size=16, grad_accum_steps=1, step_time_ms=50.0,
                         samples_seen=16, tokens_seen=0, elapsed_s=0.1, cost_usd=0.0)

    with SegmentWriter(tmp_path / "telemetry", "r", rank=0) as writer:
        for start in (100.0, 200.0):  # two trainer processes (a launch and a resume)
            writer.write(RunStartEvent(run_id="r", rank=0, step=0, wall_time_s=start,
                                       model_kind="m", model_config={}, model_fingerprint="f",
                                       train_config={}, data_fingerprint="d",
                                       curriculum_version=None, instance_type="p3.2xlarge",
                                       price_usd_per_hour=3.06))
            # First step 0.15 s after run_start, then steady 0.05 s steps.
            for i, wall in enumerate((0.15, 0.20, 0.25, 0.30), start=1):
                writer.write(step(i, start + wall))
    result = SimpleNamespace(run_dir=tmp_path, run_id="r", finish_s=None)
    assert fc.first_step_gaps_s(result, 1000.0) == pytest.approx([150.0, 150.0])
    assert fc.warmup_s([result], 1000.0) == pytest.approx(100.0)  # 150 less the 50 s step
    cal = dataclasses.replace(_calibration(), warmup_s=100.0, changeover_s=460.0)
    same = fc.same_run(cal, result)
    # The scored run's own warm-up at its replay speed (975 emulated s a wall s): 0.1 s.
    assert same.warmup_s == pytest.approx(97.5) and same.changeover_s == pytest.approx(457.5)
    half = cal.at_rate(cal.emulated_per_wall_s / 2)
    assert half.warmup_s == pytest.approx(50.0) and half.changeover_s == pytest.approx(410.0)
