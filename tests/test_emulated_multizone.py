"""The emulated cloud over several zones: the policy sees every zone, a move between zones is a
changeover (release, launch, resume) billed at the new zone's price, a reclaim follows the held
zone's trace. Fast tests drive `_Emulation`'s tick directly (no trainer processes); the slow one
runs real trainers over two real zones.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from cloud import emulated as replay
from cloud.providers.emulated import EmulatedProvider
from controllers.allocation_types import AllocationAction
from telemetry.writer import SegmentWriter
from tests.shared_data import needs_spot_data
from trainwise import emulated as emu

TICK_S = 195
INSTANCE = "p3.2xlarge"


def market(zone: str, available: list[int], spot: float, on_demand: float = 3.06
           ) -> replay.ReplayMarket:
    return replay.ReplayMarket(zone, INSTANCE, TICK_S, np.array(available, dtype=np.int64), 0,
                               "test array", spot, on_demand, "test price")


class Scripted:
    """Answers tick i with script[i] (the last one after the script), records what it saw."""

    name = "scripted"

    def __init__(self, script: list[AllocationAction]) -> None:
        self.script, self.seen = script, []

    def act(self, observation):
        self.seen.append(observation)
        return self.script[min(len(self.seen) - 1, len(self.script) - 1)]


def emulation(tmp_path: Path, markets, policy, nodes: int = 1):
    rules = replay.default_rules()
    clock = replay.ReplayClock(float(TICK_S), 0.2)
    writer = SegmentWriter(tmp_path / "telemetry", "t", rank=emu.PROVIDER_RANK)
    job = emu._Emulation(
        markets=list(markets), rules=rules, clock=clock,
        provider=EmulatedProvider(list(markets), clock, rules), policy=policy, writer=writer,
        run_id="t", run_dir=tmp_path, shards_dir=tmp_path, train_config={}, max_steps=100,
        work_total_s=3600.0, deadline_s=20 * TICK_S, notice_wall_s=1.0, node_count=nodes)
    return job, writer


def run_ticks(job, until_tick: int) -> None:
    """Tick boundaries 0..until_tick with no trainer: each launch is taken as booted at once."""
    for tick in job.clock.advance_to(until_tick * TICK_S):
        job.on_tick(tick)
        job.pending_launch = False


def spot(zone: str, n: int = 1) -> AllocationAction:
    return AllocationAction(zone, n, 0, reason=f"spot in {zone}")


def test_policy_sees_every_zone_and_a_move_is_billed_at_the_new_zones_price(tmp_path):
    a = market("us-east-1a", [1, 1, 1, 1, 1, 1], spot=0.9)
    b = market("us-west-2a", [1, 1, 1, 1, 0, 0], spot=1.5)
    policy = Scripted([spot("us-east-1a"), spot("us-east-1a"), spot("us-west-2a")])
    job, writer = emulation(tmp_path, [a, b], policy)
    with writer:
        run_ticks(job, 5)
    first = policy.seen[0]
    assert first.zones == ("us-east-1a", "us-west-2a") and first.home_zone == "us-east-1a"
    assert first.spot_available_by_zone == (1, 1)
    assert first.spot_price_usd_per_hour_by_zone == (0.9, 1.5)
    assert policy.seen[1].zone == "us-east-1a" and policy.seen[1].spot_nodes == 1
    # Tick 2: the move is a changeover: the 1a node is released, a 2a node launched.
    holdings = job.holdings
    assert [h.zone for h in holdings[:2]] == ["us-east-1a", "us-west-2a"]
    assert holdings[0].end_s == 2 * TICK_S and holdings[0].end_reason.startswith("switched")
    assert holdings[1].launch_s == 2 * TICK_S and holdings[1].price_usd_per_hour == 1.5
    assert job.launches == 2 and policy.seen[3].last_zone == "us-west-2a"
    # Tick 4: 2a's trace drops: the reclaim follows the held zone (1a still has spot).
    assert job.preemption_times == (4 * TICK_S,)
    assert holdings[1].end_reason == "preempted"
    # The bill: each node's seconds at its own zone's price (the reclaimed one, with no trainer
    # to exit, until its notice ran out).
    assert len(holdings) == 2
    assert replay.bill_usd(holdings) == pytest.approx(
        (2 * TICK_S * 0.9 + (2 * TICK_S + 120) * 1.5) / 3600)


def test_a_spot_move_to_a_zone_without_spot_fails_and_keeps_the_held_node(tmp_path):
    a = market("us-east-1a", [1, 1, 1], spot=0.9)
    b = market("us-west-2a", [0, 0, 0], spot=1.5)
    job, writer = emulation(tmp_path, [a, b], Scripted([spot("us-east-1a"), spot("us-west-2a")]))
    with writer:
        run_ticks(job, 1)
    assert job.launch_failed and job.held.zone == "us-east-1a" and len(job.holdings) == 1


def test_an_unknown_zone_names_the_zones_replayed(tmp_path):
    a = market("us-east-1a", [1, 1], spot=0.9)
    b = market("us-west-2a", [1, 1], spot=1.5)
    job, writer = emulation(tmp_path, [a, b], Scripted([spot("eu-west-1a")]))
    with writer, pytest.raises(ValueError, match="eu-west-1a.*us-east-1a, us-west-2a"):
        run_ticks(job, 0)


def _spot_job_with_fake_trainers(tmp_path, monkeypatch):
    """A job on one spot zone whose trainer processes are fakes (spawn writes the job file)."""
    import subprocess

    class FakeProcess:
        pid = 4242

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: FakeProcess())
    a = market("us-east-1a", [1, 1], spot=0.9)
    job, writer = emulation(tmp_path, [a], Scripted([spot("us-east-1a")]))
    job.fast_policy = "heuristic"
    return job, writer


def _job_file(tmp_path, index: int) -> dict:
    return json.loads((tmp_path / "emulated" / f"job-{index:03d}.json").read_text())


def test_fast_policy_reaches_the_trainers_job_json(tmp_path, monkeypatch):
    """`fast_policy` is written into the trainer's job file (a fake process stands for it)."""
    job, writer = _spot_job_with_fake_trainers(tmp_path, monkeypatch)
    with writer:
        run_ticks(job, 0)  # the spot node is launched
        job.spawn()
        written = _job_file(tmp_path, 0)
        assert written["fast_policy"] == "heuristic"
        # No reclaim seen yet: the train job's rule counts half a reclaim (spot is not risk-free).
        assert 0.0 < written["preemption_risk"] < 1.0
        job.fast_policy = None
        job.spawn()
    second = _job_file(tmp_path, 1)
    assert second["fast_policy"] is None and "preemption_risk" not in second


def test_each_new_trainer_gets_the_risk_of_the_reclaims_seen_so_far(tmp_path, monkeypatch):
    """The emulated trainer's fast layer sees the train job's risk rule, on its own clock."""
    from trainwise.slow_tick import preemption_risk

    job, writer = _spot_job_with_fake_trainers(tmp_path, monkeypatch)
    with writer:
        run_ticks(job, 0)  # the spot node is launched
        job.spawn()
        job.preemption_times = (100.0, 200.0, 300.0)  # three reclaims seen
        job.spawn()
    before, after = _job_file(tmp_path, 0), _job_file(tmp_path, 1)
    wall_s = job.clock.wall_s(job.clock.now_s)
    assert after["preemption_risk"] == pytest.approx(preemption_risk(3, wall_s, 1))
    assert after["preemption_risk"] > before["preemption_risk"]


# -- real trainer processes over two real zones -----------------------------------------------
FOLDER = "availability-1node-aws-2023-02"
ZONES = ["us-east-1a_v100_1.json", "us-west-2a_v100_1.json"]


class MoveOnDemand:
    """On-demand in the home zone until a quarter of the work is done, then in the second zone
    (on-demand: the move does not depend on the trace's spot availability)."""

    name = "move_on_demand"

    def act(self, obs):
        zone = obs.zones[1] if obs.work_done_h >= 0.25 * obs.work_total_h else obs.zones[0]
        if obs.zone == obs.zones[1]:
            zone = obs.zones[1]
        return AllocationAction(zone, 0, 1, reason=f"on-demand in {zone}")


@needs_spot_data
@pytest.mark.slow  # two trainer processes (about 40 s on a shared 2-core machine)
def test_a_real_run_moves_zones_resumes_and_finishes(tmp_path, monkeypatch):
    monkeypatch.setattr(emu, "make_policy", lambda name, **kw: MoveOnDemand())
    result = emu.run_emulated("pystdlib", max_steps=20, trace_folder=FOLDER, zone_files=ZONES,
                              window_start_tick=300, policy_name="on_demand", out_dir=tmp_path,
                              run_id="mz", max_wall_s=240, fast_policy=None)
    assert result.status == "completed" and result.steps == 20
    assert result.zones == ("us-east-1a", "us-west-2a")
    assert result.zones_held == ("us-east-1a", "us-west-2a")
    assert result.resumes >= 1 and len(result.trainer_pids) >= 2
    west = [h for h in result.holdings if h["zone"] == "us-west-2a"]
    from cloud import prices

    assert west and west[-1]["price_usd_per_hour"] == prices.on_demand_price(INSTANCE,
                                                                               "us-west-2")
    assert result.cost_usd == pytest.approx(sum(
        (h["end_s"] - h["launch_s"]) * h["price_usd_per_hour"] / 3600 for h in result.holdings))
