"""benchmarks/ui_launch.py splits a launch's seconds from Dagster's run record (the benchmark
itself starts the UI and runs in `make bench`)."""

import pytest

from benchmarks import ui_launch


def test_a_launch_is_split_into_queue_steps_the_rest_of_the_run_and_the_poll():
    run = {"startTime": 110.0, "endTime": 130.0, "stepStats": [
        {"stepKey": "data_shards", "startTime": 111.0, "endTime": 113.0},
        {"stepKey": "checkpoint", "startTime": 114.0, "endTime": 128.0},
        {"stepKey": "never_started", "startTime": None, "endTime": None}]}
    split = ui_launch.phases("r1", launched_at=100.0, seen_at=130.5, run=run)
    assert split["total_s"] == pytest.approx(30.5)
    assert split["queued_s"] == pytest.approx(10.0)
    assert split["steps_s"] == pytest.approx(16.0)
    assert split["run_outside_steps_s"] == pytest.approx(4.0)
    assert split["after_end_s"] == pytest.approx(0.5)
    assert split["step_s"] == {"data_shards": 2.0, "checkpoint": 14.0}
    parts = ("queued_s", "steps_s", "run_outside_steps_s", "after_end_s")
    assert sum(split[k] for k in parts) == pytest.approx(split["total_s"])


def test_no_launch_is_refused_by_name():
    with pytest.raises(SystemExit, match="--runs 0"):
        ui_launch.main(["--runs", "0"])
