"""The emulated cloud: a real spot trace replayed fast decides when a real trainer process is
SIGTERMed; the job resumes from its checkpoint in a new process and is billed per emulated second.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cloud import emulated as replay
from cloud import prices
from cloud.traces import FOLDER_MEANING, load_trace
from tests.shared_data import needs_spot_data
from trainwise import settings

pytestmark = needs_spot_data

torch.set_num_threads(1)

FOLDER = "availability-1node-aws-2023-02"
ZONE_FILE = "us-east-1a_v100_1.json"
MAX_STEPS = 40


# -- the pure parts (cloud/emulated.py) -----------------------------------------------------------
def test_clock_yields_each_boundary_and_freezes_when_the_caller_stops():
    clock = replay.ReplayClock(tick_s=195.0, seconds_per_tick=0.2)
    assert clock.emulated_per_wall_s == pytest.approx(975.0)
    assert list(clock.advance_to(0.0)) == [0]
    assert list(clock.advance_to(400.0)) == [1, 2] and clock.now_s == 400.0
    for tick in clock.advance_to(1000.0):
        assert tick == 3
        break  # e.g. a preemption at tick 3: the clock stays on that boundary
    assert clock.now_s == 585.0 and clock.tick == 3


def test_bill_is_emulated_seconds_held_times_price():
    holdings = [replay.Holding("spot", 0.0, 0.612, 780.0), replay.Holding("on_demand", 1000.0, 3.06)]
    assert replay.bill_usd(holdings, now_s=1360.0) == pytest.approx(
        780 * 0.612 / 3600 + 360 * 3.06 / 3600)
    assert replay.spot_share(holdings, now_s=1360.0) == pytest.approx(780 / 1140)
    with pytest.raises(ValueError, match="still open"):
        replay.bill_usd(holdings)


def test_a_stopped_node_is_billed_until_its_trainer_exits_or_the_notice_ends():
    # Notice at 780 s; the trainer takes 0.05 wall s to checkpoint and exit at 975x replay speed:
    # the node is up 48.75 emulated s more. A trainer that never exits is reclaimed after 120 s.
    assert replay.node_down_s(780.0, 0.05, 975.0, 120.0) == pytest.approx(828.75)
    assert replay.node_down_s(780.0, 10.0, 975.0, 120.0) == pytest.approx(900.0)
    holding = replay.Holding("spot", 0.0, 0.612, end_s=780.0, notice_at_s=780.0)
    holding.end_s = replay.node_down_s(780.0, 10.0, 975.0, 120.0)
    assert replay.bill_usd([holding]) == pytest.approx(900.0 * 0.612 / 3600.0)
    with pytest.raises(ValueError, match="shutdown_wall_s"):
        replay.node_down_s(780.0, -1.0, 975.0, 120.0)


def test_replayed_steps_are_waste_not_progress():
    # Trainer 1 recorded steps 1-7 and was killed; trainer 2 resumed from the step-5 checkpoint
    # and re-ran 6 and 7; trainer 3 started over (no checkpoint) and re-ran 1-2 before finishing.
    written = [1, 2, 3, 4, 5, 6, 7, 6, 7, 8]
    assert replay.replayed(written) == [False] * 7 + [True, True, False]
    assert sum(replay.replayed([1, 2, 3, 1, 2, 3, 4])) == 3
    waste = replay.replay_waste(2, step_s=9.75, price_usd_per_hour=3.06)
    assert waste.replayed_steps == 2
    assert waste.waste_s == pytest.approx(2 * 9.75)
    assert waste.waste_usd == pytest.approx(2 * 9.75 * 3.06 / 3600.0)


def test_drop_window_search_and_synthetic_label():
    values = np.array([0, 0, 1, 1, 1, 0, 0, 1, 1])
    assert replay.find_drop_window(values, up_ticks=3, max_down_ticks=2) == 2
    with pytest.raises(ValueError, match="no window"):
        replay.find_drop_window(values, up_ticks=5, max_down_ticks=2)
    market = replay.load_replay_market(FOLDER, ZONE_FILE, 0, 10, Path("/nonexistent"))
    assert market.synthetic and "SYNTHETIC" in market.source
    assert list(market.available[:8]) == [1, 1, 1, 1, 0, 0, 0, 1]
    assert market.available_at(10_000) == 0  # past the window: no market data, no spot


# -- a real emulated run ---------------------------------------------------------------------------
def _window_start() -> int:
    """A real window where spot is up 4 ticks (13 min) from the start, then reclaimed."""
    path = settings.data_dir() / "spot" / FOLDER / ZONE_FILE
    if not path.exists():
        return 0  # synthetic fallback (labelled in the result's trace_source)
    trace = load_trace(path, FOLDER_MEANING[FOLDER])
    return replay.find_drop_window(trace.available, up_ticks=4, max_down_ticks=10, min_start=200)


@pytest.fixture(scope="module")
def emulated_run(tmp_path_factory):
    from trainwise.emulated import run_emulated

    out = tmp_path_factory.mktemp("emulated")
    result = run_emulated("pystdlib", max_steps=MAX_STEPS, trace_folder=FOLDER,
                          zone_file=ZONE_FILE, window_start_tick=_window_start(),
                          seconds_per_tick=0.2, policy_name="trainwise_heuristic",
                          deadline_factor=2.0, out_dir=out, run_id="emu-test", max_wall_s=240)
    return out, result


def _records(result, rank=None):
    from telemetry.reader import read_run_events

    return read_run_events(result.run_dir / "telemetry" / result.run_id, rank=rank)


def test_run_is_preempted_by_sigterm_checkpoints_and_completes(emulated_run):
    _, result = emulated_run
    assert result.status == "completed" and result.steps == MAX_STEPS
    assert result.preemptions >= 1 and result.resumes >= 1 and result.notices_missed == 0
    trainer = _records(result, rank=0)
    notices = [r for r in trainer if r["type"] == "preemption"]
    assert notices and all(r["signal_name"] == "SIGTERM" for r in notices)
    # Each notice is answered with a checkpoint at that very step: written for the preemption,
    # or already there when the notice landed on a step the interval checkpoint had just saved
    # (the trainer does not save the same boundary twice).
    saved_steps = {r["step"] for r in trainer if r["type"] == "checkpoint"}
    assert all(r["step"] in saved_steps for r in notices)
    # The first process really was a separate trainer that got the signal and said so.
    first = json.loads((result.run_dir / "emulated" / "result-000.json").read_text())
    assert first["status"] == "preempted" and first["pid"] == result.trainer_pids[0]
    assert len(set(result.trainer_pids)) == len(result.trainer_pids) >= 2
    assert result.final_eval_loss is not None and np.isfinite(result.final_eval_loss)


def test_resume_continues_from_the_checkpoint(emulated_run):
    from training import loop, shards

    out, result = emulated_run
    trainer = _records(result, rank=0)
    steps = [r["step"] for r in trainer if r["type"] == "step"]
    assert steps == list(range(1, MAX_STEPS + 1))  # contiguous: no step lost, none repeated
    starts = [r for r in trainer if r["type"] == "run_start"]
    resumed = [r for r in starts if r["resumed_from"]]
    assert len(resumed) == result.resumes
    for start in resumed:  # each process starts where its checkpoint left off
        assert start["step"] == int(Path(start["resumed_from"]).stem.split("-")[1])
    # Losses after the resumes equal an uninterrupted run's with the same config, bit for bit.
    job = json.loads((result.run_dir / "emulated" / "job-000.json").read_text())
    config = loop.TrainConfig(**{**job["train_config"], "run_id": "uninterrupted"})
    reference = loop.train(config, shards.load_shards(out / "shards" / "pystdlib"), None,
                           out / "uninterrupted")
    from telemetry.reader import read_run_events

    expected = [r["train_loss"] for r in read_run_events(reference.telemetry_dir)
                if r["type"] == "step"]
    assert [r["train_loss"] for r in trainer if r["type"] == "step"] == expected
    assert result.final_eval_loss == reference.final_eval_loss


def test_cost_follows_the_billing_rule_at_real_prices(emulated_run):
    _, result = emulated_run
    spot = prices.spot_price_from_advisor("p3.2xlarge", "us-east-1")
    on_demand = prices.on_demand_price("p3.2xlarge", "us-east-1")
    assert (result.spot_usd_per_hour, result.on_demand_usd_per_hour) == (spot, on_demand)
    expected = sum((h["end_s"] - h["launch_s"]) * (spot if h["kind"] == "spot" else on_demand)
                   / 3600.0 for h in result.holdings)
    assert result.cost_usd > 0 and result.cost_usd == pytest.approx(expected)
    # Every launch pays at least its changeover (360 s) unless cut short by a preemption.
    assert result.holdings[0]["launch_s"] == 0.0
    assert result.spot_node_s + result.on_demand_node_s == pytest.approx(
        sum(h["end_s"] - h["launch_s"] for h in result.holdings))


def test_decisions_are_slow_layer_events_that_explain_shows(emulated_run):
    from trainwise.emulated import PROVIDER_RANK
    from trainwise.explain import timeline

    out, result = emulated_run
    decisions = [r for r in _records(result, rank=PROVIDER_RANK) if r["type"] == "decision"]
    assert decisions and all(r["layer"] == "slow" for r in decisions)
    policy = [r for r in decisions if r["policy"] == "trainwise_heuristic"]
    assert policy and all(r["reason"] and "time_s" in r["numbers"] for r in policy)
    events = [r["action"].get("event") for r in decisions]
    assert events.count("preemption") == result.preemptions
    assert events.count("resume") == result.resumes
    text = timeline(result.run_id, out)
    assert "spot reclaimed" in text and "resuming from step" in text


def test_every_second_a_node_was_up_is_billed(emulated_run):
    _, result = emulated_run
    uptimes_s = []
    for holding in result.holdings:
        assert holding["end_s"] is not None
        down_s = holding["end_s"]
        if holding["notice_at_s"] is not None:
            # Told to stop: billed past the notice until its trainer exited, at most the notice.
            assert holding["trainer_exit_s"] is not None
            assert holding["notice_at_s"] < holding["trainer_exit_s"] <= holding["end_s"]
            assert holding["end_s"] - holding["notice_at_s"] <= 120.0 + 1e-9
            down_s = holding["trainer_exit_s"]
        uptimes_s.append(down_s - holding["launch_s"])
    billed_s = result.spot_node_s + result.on_demand_node_s
    assert billed_s >= sum(uptimes_s) - 1e-9
    assert result.stopping_node_s > 0  # the preempted node's shutdown is on the bill
    # Every notice was answered with a checkpoint: nothing re-run, all steps useful.
    assert result.replayed_steps == 0 and result.preemption_waste_usd == 0.0
    step_s = result.useful_train_s / MAX_STEPS
    assert step_s > 0


@pytest.fixture(scope="module")
def ignored_notice_run(tmp_path_factory):
    """Trainers that never answer the notice (SIGTERM blocked): each preemption is a SIGKILL, and
    with no interval checkpoints the next trainer starts over."""
    from trainwise.emulated import run_emulated

    out = tmp_path_factory.mktemp("emulated_killed")
    return run_emulated("pystdlib", max_steps=IGNORED_MAX_STEPS, trace_folder=FOLDER,
                        zone_file=ZONE_FILE, window_start_tick=_window_start(),
                        seconds_per_tick=0.2, policy_name="trainwise_heuristic",
                        deadline_factor=2.0, out_dir=out, run_id="emu-killed", max_wall_s=240,
                        min_notice_wall_s=1.0, trainer_ignores_notice=True,
                        train_overrides={"checkpoint_every_steps": 0})


IGNORED_MAX_STEPS = 30


@pytest.mark.slow  # a second emulated job (about 90 s on a shared 2-core machine)
def test_killed_work_is_billed_and_replayed_steps_are_waste(ignored_notice_run):
    result = ignored_notice_run
    assert result.status == "completed" and result.steps == IGNORED_MAX_STEPS
    assert result.notices_missed >= 1
    preempted = [h for h in result.holdings if h["end_reason"] == "preempted"]
    stopping_s = [h["end_s"] - h["notice_at_s"] for h in preempted]
    # Billed past the notice until the trainer was down; a SIGKILLed one for the whole notice.
    assert stopping_s and all(0 < s <= 120.0 + 1e-9 for s in stopping_s)
    assert max(stopping_s) == pytest.approx(120.0)
    # The steps each killed trainer recorded (none of them checkpointed) are run again. (A
    # trainer may also finish inside the notice, SIGTERM blocked: it is then not replayed.)
    steps = [r for r in _records(result, rank=0) if r["type"] == "step"]
    starts = [r["wall_time_s"] for r in _records(result, rank=0) if r["type"] == "run_start"]
    assert len(starts) == len(result.trainer_pids)
    # Each trainer starts over at step 1 (nothing checkpointed), so every step event beyond the
    # job's own steps is a replay.
    assert [r["step"] for r in steps].count(1) == len(starts)
    assert result.replayed_steps == len(steps) - IGNORED_MAX_STEPS > 0
    step_s = result.useful_train_s / IGNORED_MAX_STEPS
    assert result.preemption_waste_s == pytest.approx(result.replayed_steps * step_s)
    assert 0 < result.preemption_waste_usd < result.cost_usd
    # Useful training counts the job's steps once; the replays are waste, not training.
    assert result.useful_train_s == pytest.approx(IGNORED_MAX_STEPS * step_s)
