"""The end-to-end figure (issue 10, item 5): four strategies, the same steps, one bill each."""

import json
from pathlib import Path

import pytest

from benchmarks import end_to_end as e2e
from tests.shared_data import needs_spot_data
from trainwise.emulated import EmulatedResult


def fake_result(policy: str, *, cost_usd: float, spot_node_s: float, on_demand_node_s: float,
                loss: float | None, preemptions: int = 0, replayed_s: float = 0.0,
                notice_s: float = 0.0, finish_s: float = 1000.0) -> EmulatedResult:
    """A finished run's figures without running processes (the aggregation is pure)."""
    return EmulatedResult(
        status="completed", run_id=f"fake-{policy}", run_dir=Path("/nonexistent"), steps=30,
        max_steps=30, preemptions=preemptions, resumes=preemptions, launches=1 + preemptions,
        notices_missed=0,
        spot_share=spot_node_s / (spot_node_s + on_demand_node_s),
        cost_usd=cost_usd, spot_node_s=spot_node_s, on_demand_node_s=on_demand_node_s,
        deadline_s=5000.0, finish_s=finish_s, final_eval_loss=loss, wall_s=10.0, policy=policy,
        trace_source="trace.json", zone="us-east-1a", instance_type="p3.2xlarge",
        window_start_tick=0, seconds_per_tick=0.2, spot_usd_per_hour=0.612,
        on_demand_usd_per_hour=3.06, holdings=(), trainer_pids=(),
        preemption_waste_s=replayed_s, stopping_node_s=notice_s, useful_train_s=900.0)


def rows(trainwise_loss: float) -> list[dict]:
    fixed = fake_result("on_demand", cost_usd=1.0, spot_node_s=0.0, on_demand_node_s=1200.0,
                        loss=2.5, finish_s=1200.0)
    tw = fake_result("trainwise_heuristic", cost_usd=0.5, spot_node_s=900.0,
                     on_demand_node_s=300.0, loss=trainwise_loss, preemptions=2,
                     replayed_s=100.0, notice_s=20.0, finish_s=1500.0)
    return [e2e.strategy_record("fixed", fixed, 975.0, 360.0, 0.1),
            e2e.strategy_record("trainwise", tw, 975.0, 360.0, 0.0)]


def test_ratios_are_against_the_fixed_schedule_and_quality_is_judged_on_its_loss():
    records = rows(trainwise_loss=2.5 * (1 + e2e.LOSS_TOLERANCE / 2))
    verdict = e2e.compare(records)
    fixed, tw = records
    assert fixed["cost_ratio_vs_fixed"] == 1.0 and tw["cost_ratio_vs_fixed"] == 0.5
    assert tw["trace_time_ratio_vs_fixed"] == pytest.approx(1500 / 1200)
    assert verdict["target_eval_loss"] == 2.5 and verdict["equal_quality"]
    # A strategy that ends worse than the tolerance is not "the same quality".
    worse = rows(trainwise_loss=2.5 * (1 + 2 * e2e.LOSS_TOLERANCE))
    assert not e2e.compare(worse)["equal_quality"]
    assert not worse[1]["target_met"] and worse[0]["target_met"]


def test_cost_drivers_say_which_are_zero_by_construction_and_price_the_others():
    fixed, tw = rows(trainwise_loss=2.5)
    drivers = tw["cost_drivers"]
    for name in ("straggler_idle", "redundant_data"):
        assert drivers[name]["s"] == 0.0 and drivers[name]["by_construction"]
    loss = drivers["preemption_loss"]
    # replayed steps + billed notice + one changeover per preemption
    assert loss["s"] == pytest.approx(100.0 + 20.0 + 2 * 360.0)
    assert loss["usd"] == pytest.approx(loss["s"] * 0.5 / 1200.0)
    assert tw["preemption_waste_share"] == pytest.approx(loss["s"] / 1200.0)
    # Periodic saves: blocked wall seconds at the replay speed.
    assert fixed["cost_drivers"]["checkpoint_overhead"]["s"] == pytest.approx(0.1 * 975.0)
    assert fixed["spot_share"] == 0.0 and tw["spot_share"] == 0.75


def test_the_baseline_deadline_follows_the_measured_step_speed():
    fixed = fake_result("on_demand", cost_usd=1.0, spot_node_s=0.0, on_demand_node_s=1.0,
                        loss=2.5)
    rescaled = e2e.rescaled_deadline(fixed, step_wall_s=0.5, emulated_per_wall_s=975.0,
                                     changeover_s=360.0)
    assert rescaled.deadline_s == pytest.approx(2.0 * (30 * 0.5 * 975.0 + 360.0))


@pytest.mark.slow
@needs_spot_data
def test_quick_mode_runs_four_strategies_to_the_same_eval_loss(tmp_path):
    assert e2e.main(["--quick", "--results-dir", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "end_to_end.json").read_text())
    assert (tmp_path / "end_to_end.md").exists()
    by_name = {r["strategy"]: r for r in payload["strategies"]}
    assert set(by_name) == {"fixed", "managed_spot", "uniform_progress", "trainwise"}
    for row in by_name.values():
        for key in ("cost_usd", "wall_s", "trace_time_s", "deadline_met", "final_eval_loss",
                    "spot_share", "preemption_waste_s", "cost_drivers", "cost_ratio_vs_fixed"):
            assert key in row, f"{row['strategy']} lacks {key}"
        assert row["steps"] == row["max_steps"] == 30 and row["status"] == "completed"
        assert row["final_eval_loss"] == pytest.approx(
            by_name["fixed"]["final_eval_loss"], rel=e2e.LOSS_TOLERANCE)
    assert by_name["fixed"]["spot_share"] == 0.0 and by_name["fixed"]["preemptions"] == 0
    assert payload["equal_quality"]
    # The window is chosen so spot is reclaimed: a spot strategy meets a preemption.
    assert by_name["managed_spot"]["preemptions"] >= 1


def test_a_run_that_never_finished_is_named_in_the_figure():
    records = rows(trainwise_loss=2.5)
    records[1]["status"] = "deadline_exceeded_wall"
    assert "trainwise" in e2e.stuck_note(records)
    records[1]["status"] = "completed"
    assert e2e.stuck_note(records) == ""
