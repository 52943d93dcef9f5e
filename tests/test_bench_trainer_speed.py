"""benchmarks/trainer_speed: how a step is timed, and (slow) a quick run of both arms."""

from __future__ import annotations

import json

import pytest

from benchmarks import trainer_speed


def test_per_step_times_only_the_steps_after_warm_up():
    # (step, wall s, CPU s) at decisions every 10 steps: warm-up steps are slower.
    marks = [(0, 0.0, 0.0), (10, 5.0, 4.0), (20, 6.0, 4.5), (30, 7.0, 5.0), (40, 8.0, 5.5)]
    wall_ms, cpu_ms, steps = trainer_speed._per_step(marks, warmup=20)
    assert steps == 20
    assert wall_ms == pytest.approx(100.0)
    assert cpu_ms == pytest.approx(50.0)


def test_per_step_refuses_a_window_without_steps():
    with pytest.raises(ValueError, match="too few steps after warm-up 40"):
        trainer_speed._per_step([(0, 0.0, 0.0), (40, 1.0, 1.0)], warmup=40)


def test_the_command_line_refuses_a_warm_up_that_leaves_nothing_to_time(capsys):
    with pytest.raises(SystemExit):
        trainer_speed.main(["--steps", "30", "--warmup", "25"])
    assert "--warmup 25 must leave" in capsys.readouterr().err


@pytest.mark.slow
def test_a_quick_run_times_both_arms_at_each_thread_count(tmp_path):
    result = trainer_speed.main(["--quick", "--threads", "1,2", "--out", str(tmp_path)])
    assert [row["threads"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["trainer_wall_ms"] > 0 and row["bare_wall_ms"] > 0
        assert row["trainer_final_eval_loss"] < 4.0  # from above ln(vocab) (4.2+) at the start
    written = json.loads((tmp_path / "trainer_speed.json").read_text())
    assert written["rows"][0]["threads"] == 1
