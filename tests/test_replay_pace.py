# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""The emulated replay paced by the loop's own steps (trainwise/replay_pace.py): with
`replay_steps_per_tick` the trace meets a run at about the same step on a fast and a slow
machine, the bill per step follows the steps, and the pace is recorded with its reason."""

from __future__ import annotations

import time

import pytest

from telemetry.reader import read_run_events
from tests.test_run_path_faults import (  # noqa: F401 - fixtures used by name
    PARTITION,
    built_state,
    request,
    run,
    state,
)
from tests.test_train_job_provider import market, provider
from training import _loop_run as loop_run
from trainwise import gang, replay_pace

# -- the rule ------------------------------------------------------------------------------------


def test_the_pace_is_steps_times_the_measured_step_within_its_bounds():
    chosen = replay_pace.pace(6.0, 0.075, "steps 10..20")
    assert chosen.seconds_per_tick == pytest.approx(0.45)
    assert "6 steps x the loop's measured 75.0 ms per step (wall, steps 10..20)" in chosen.reason
    fast = replay_pace.pace(6.0, 0.0001)  # a tick between two polls would skip reclaims
    assert fast.seconds_per_tick == replay_pace.MIN_SECONDS_PER_TICK
    assert "held to" in fast.reason
    assert replay_pace.pace(6.0, 10.0).seconds_per_tick == replay_pace.MAX_SECONDS_PER_TICK
    with pytest.raises(ValueError, match="replay_steps_per_tick=0"):
        replay_pace.pace(0.0, 0.1)
    with pytest.raises(ValueError, match="measured step of -1"):
        replay_pace.pace(6.0, -1.0)


def test_the_pacer_leaves_out_the_first_steps_and_starts_again_on_a_new_segment():
    pacer = replay_pace.StepPacer(4.0)
    assert pacer.observe(100.0, 10) is None  # steps 1..10 warm caches up: the origin only
    assert pacer.observe(100.5, 10) is None  # no step since: still the origin
    pacer.restart()  # a replacement before the pace was chosen: its wall is not steps
    assert pacer.observe(300.0, 12) is None
    chosen = pacer.observe(301.0, 22)
    assert chosen.step_s == pytest.approx(0.1) and chosen.seconds_per_tick == pytest.approx(0.4)
    pacer.restart()  # once chosen, it stays for the run
    assert pacer.observe(900.0, 40) is chosen
    with pytest.raises(ValueError, match="replay_steps_per_tick=-2"):
        replay_pace.StepPacer(-2.0)


def test_a_bad_pace_is_refused_before_anything_is_written(state, monkeypatch):
    with pytest.raises(ValueError, match=r"replay_steps_per_tick=-1.*>= 0"):
        run(state, request(replay_steps_per_tick=-1.0))
    with pytest.raises(ValueError, match=r"replay_steps_per_tick=2.*allocation_policy"):
        run(state, request(replay_steps_per_tick=2.0, allocation_policy="uniform_progress"))
    with pytest.raises(ValueError, match=r"replay_steps_per_tick=2.*nodes=2"):
        run(state, request(replay_steps_per_tick=2.0, nodes=2, grad_accum_steps=2))
    assert not (state / "runs").exists()


def test_a_provider_that_replays_nothing_refuses_a_pace_before_any_launch(tmp_path):
    class Launches:
        name = "aws"

        def launch(self, *args):
            raise AssertionError("launched")

    session = gang.GangSession(Launches(), gang.Allocation(zone="us-east-1a"), "p3.2xlarge",
                               tmp_path, "run-x", pacer=replay_pace.StepPacer(6.0))
    with pytest.raises(ValueError, match=r"provider 'aws' replays nothing.*set replay_steps"):
        session.start()


# -- a fast and a slow machine -------------------------------------------------------------------
SPOT_TICKS = 8  # spot in the window for 8 ticks, then none: one reclaim


def run_on_a_machine(state, monkeypatch, step_s: float, *, paced: bool, run_id: str):
    """A run whose every step takes at least `step_s` of wall time (a machine that fast), with
    the replay paced by its loop at 4 steps per tick or at a fixed 0.2 s per tick."""
    real_step = loop_run.train_step

    def machine_step(**kwargs):
        began = time.perf_counter()
        outcome = real_step(**kwargs)
        time.sleep(max(0.0, step_s - (time.perf_counter() - began)))
        return outcome

    monkeypatch.setattr(loop_run, "train_step", machine_step)
    monkeypatch.setattr(gang, "provider_for_run", lambda instance_type, region, **options:
                        provider(market("us-east-1a", [1] * SPOT_TICKS + [0] * 100_000),
                                 seconds_per_tick=options.get("seconds_per_tick", 0.2)))
    summary = run(state, request(market="spot", zone="us-east-1a", max_steps=60, run_id=run_id,
                                 replay_steps_per_tick=4.0 if paced else 0.0))
    record = gang.read_gang(state / "runs" / run_id)
    (notice,) = [e for e in record["history"] if e["event"] == "notice"]
    return summary, record, int(notice["step"])


def test_the_reclaim_meets_a_fast_and_a_slow_machine_at_about_the_same_step(state, monkeypatch):
    fast, fast_record, fast_step = run_on_a_machine(state, monkeypatch, 0.06, paced=True,
                                                    run_id="fast")
    slow, slow_record, slow_step = run_on_a_machine(state, monkeypatch, 0.18, paced=True,
                                                    run_id="slow")
    for summary in (fast, slow):
        assert summary.status == "completed" and summary.steps == 60
        assert summary.reclaims == 1 and summary.replacements == 1
    # 4 steps per tick, spot for 8 ticks (1.8 of them in the changeover): about step 25 on
    # both; at a fixed speed the slow machine would meet it at a third of the fast one's step.
    assert 14 <= fast_step <= 38 and 14 <= slow_step <= 38, (fast_step, slow_step)
    assert abs(fast_step - slow_step) <= 10, (fast_step, slow_step)
    # The loop's steps (at least 60 and 180 ms: padded well above the tiny model's own step,
    # so a loaded machine does not move them much) set the pace.
    assert 0.24 <= fast_record["replay"]["seconds_per_tick"] < 0.6
    assert 0.72 <= slow_record["replay"]["seconds_per_tick"] < 1.2
    # The provider seconds, so the bill, per step are about the same on both machines.
    assert slow.cost_usd == pytest.approx(fast.cost_usd, rel=0.35)
    # The pace is recorded when chosen, at the second fast tick (steps 2..4), with its reason,
    # and reaches the telemetry.
    events = [e["event"] for e in slow_record["history"]]
    assert events[:2] == ["launch", "replay_pace"], events
    paced = slow_record["history"][1]
    assert paced["step"] == 4 and "4 steps x the loop's measured" in paced["reason"]
    assert "(wall, steps 2..4)" in paced["reason"]
    assert paced["seconds_per_tick"] == slow_record["replay"]["seconds_per_tick"]
    assert slow_record["replay_pace"] == paced["reason"]
    decisions = [e for e in read_run_events(state / "runs" / "slow" / "telemetry" / "slow",
                                            rank=gang.PROVIDER_RANK) if e["type"] == "decision"]
    assert [d["action"]["event"] for d in decisions][:2] == ["launch", "replay_pace"]


def test_a_run_too_short_to_be_paced_says_so(state):
    summary = run(state, request(max_steps=3, replay_steps_per_tick=4.0, run_id="short"))
    assert summary.status == "completed"
    record = gang.read_gang(state / "runs" / "short")
    [note] = [e for e in record["history"] if e["event"] == "replay_pace"]
    assert note["reason"].startswith("replay pace not chosen: the run ended before its second")
    assert record["replay_pace"].startswith("not chosen yet")


def test_at_a_fixed_speed_the_slow_machine_meets_the_reclaim_steps_earlier(state, monkeypatch):
    _, _, fast_step = run_on_a_machine(state, monkeypatch, 0.06, paced=False, run_id="fast")
    _, record, slow_step = run_on_a_machine(state, monkeypatch, 0.18, paced=False, run_id="slow")
    assert record["replay_pace"] == ""
    assert "replay_pace" not in [e["event"] for e in record["history"]]
    # 0.2 s per tick: 3.3 steps of the fast machine per tick, 1.1 of the slow one's.
    assert slow_step < fast_step / 2, (fast_step, slow_step)
