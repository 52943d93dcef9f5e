"""An N-node gang on the emulated cloud, by the simulator's gang rules: every set is exactly N
nodes in one zone, each billed per node-second; a reclaim of one node releases the whole set and
stops the (one) trainer process, which checkpoints; the policy picks the next set and a new
trainer resumes. Fast tests drive `_Emulation`'s tick directly; the slow one runs real trainers on
the 4-node trace.
"""

import numpy as np
import pytest

from cloud import emulated as replay
from controllers.allocation_types import AllocationAction
from tests.shared_data import needs_spot_data
from tests.test_emulated_multizone import TICK_S, Scripted, emulation, market, run_ticks
from trainwise import emulated as emu

ZONE = "us-east-1f"


def gang(spot_nodes: int, on_demand_nodes: int = 0) -> AllocationAction:
    return AllocationAction(ZONE, spot_nodes, on_demand_nodes, reason="gang")


def test_a_one_node_reclaim_releases_the_gang_and_each_node_is_billed(tmp_path):
    zone = market(ZONE, [4, 4, 3, 4, 4, 4], spot=0.9, on_demand=3.06)
    policy = Scripted([gang(4), gang(4), gang(4), gang(0, 4)])
    job, writer = emulation(tmp_path, [zone], policy, nodes=4)
    with writer:
        run_ticks(job, 4)
    seen = policy.seen[1]
    assert seen.node_count == 4 and seen.work_rate_gpu_h_per_h == 4.0
    assert seen.spot_nodes == 4 and seen.on_demand_nodes == 0
    assert seen.work_total_h == pytest.approx(4 * 3600.0 / 3600)  # GPU-hours at 4 nodes
    spot, rest = job.holdings[:4], job.holdings[4:]
    assert [h.kind for h in spot] == ["spot"] * 4 and all(h.launch_s == 0 for h in spot)
    # Tick 2: the trace has 3 of 4: one node is reclaimed, the other three released with it.
    assert job.preemption_times == (2 * TICK_S,)
    assert sorted(h.end_reason for h in spot) == ["gang released: a rank was reclaimed"] * 3 + [
        "preempted"]
    # Tick 2's policy wanted 4 spot again: 3 available, so the launch failed (simulator rule).
    assert policy.seen[2].spot_nodes == 0 and policy.seen[3].launch_failed
    # Tick 3: four on-demand nodes, one changeover.
    assert [h.kind for h in rest] == ["on_demand"] * 4 and job.launches == 2
    assert job.held == replay.HeldSet(ZONE, 0, 4, 3 * TICK_S)
    # Billing: node-seconds x price, per node (4 of them).
    now = job.clock.now_s
    assert replay.bill_usd(rest, now) == pytest.approx(4 * (now - 3 * TICK_S) * 3.06 / 3600)


def test_a_reclaim_after_the_last_step_releases_the_whole_gang(tmp_path):
    """The trainer is writing its final eval when the trace takes 3 of 4 nodes: the policy must
    not see a one-node 'gang' (it would keep it, an action of the wrong size)."""
    zone = market(ZONE, [4, 4, 1, 1], spot=0.9)
    policy = Scripted([gang(4), gang(4), AllocationAction(None, 0, 0)])
    job, writer = emulation(tmp_path, [zone], policy, nodes=4)
    with writer:
        run_ticks(job, 1)
        job.steps = job.max_steps
        run_ticks(job, 3)
    assert job.held is None and job.preemption_times == ()
    assert policy.seen[2].spot_nodes == 0 and policy.seen[2].zone is None
    assert len(job.holdings) == 4 and all(h.end_s >= 2 * TICK_S for h in job.holdings)


def test_a_gang_action_of_the_wrong_size_is_refused(tmp_path):
    zone = market(ZONE, [4, 4], spot=0.9)
    job, writer = emulation(tmp_path, [zone], Scripted([gang(2, 1)]), nodes=4)
    with writer, pytest.raises(ValueError, match="node_count=4"):
        run_ticks(job, 0)


def test_mixed_spot_and_on_demand_sets_launch_both_kinds(tmp_path):
    zone = market(ZONE, [2, 2], spot=0.9)
    job, writer = emulation(tmp_path, [zone], Scripted([gang(2, 2)]), nodes=4)
    with writer:
        run_ticks(job, 1)
    assert sorted(h.kind for h in job.holdings) == ["on_demand"] * 2 + ["spot"] * 2
    assert job.held == replay.HeldSet(ZONE, 2, 2, 0.0) and job.launches == 1


# -- real trainer processes on the 4-node trace ------------------------------------------------
FOLDER = "preemption-4node-aws-2023-08"
ZONE_FILE = "us-east-1f_v100_1.json"
# The trace there: 4 4 4 4 3 1 1 1 2 3 4 ...: the gang's spot holds 4 ticks, then loses one node.
WINDOW_START = 199


class GangSpotElseOnDemand:
    name = "gang_spot_else_on_demand"

    def act(self, obs):
        free = obs.spot_available_by_zone[0]
        if free >= obs.node_count and not obs.on_demand_nodes:
            return AllocationAction(obs.zones[0], obs.node_count, 0, reason="spot for all")
        return AllocationAction(obs.zones[0], 0, obs.node_count, reason="on-demand")


@needs_spot_data
@pytest.mark.slow  # two trainer processes (about 20 s on a shared 2-core machine)
def test_a_real_four_node_gang_is_reclaimed_by_one_node_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(emu, "make_policy", lambda name, **kw: GangSpotElseOnDemand())
    result = emu.run_emulated("pystdlib", max_steps=20, trace_folder=FOLDER, zone_file=ZONE_FILE,
                              window_start_tick=WINDOW_START, nodes=4, policy_name="on_demand",
                              out_dir=tmp_path, run_id="gang", max_wall_s=240)
    assert result.status == "completed" and result.steps == 20 and result.node_count == 4
    first_set = result.holdings[:4]
    assert result.node_launches == 8 and all(h["kind"] == "spot" for h in first_set)
    assert sum(h["end_reason"] == "preempted" for h in first_set) == 1
    assert result.preemptions == 1 and result.resumes == 1 and len(result.trainer_pids) == 2
    # The first trainer got SIGTERM and checkpointed; the second resumed from it.
    from telemetry.reader import read_run_events

    events = read_run_events(result.run_dir / "telemetry" / result.run_id, rank=0)
    assert any(e["type"] == "preemption" and e["signal_name"] == "SIGTERM" for e in events)
    # The bill is node-seconds x price summed over the 8 nodes: 4x a one-node bill.
    node_s = sum(h["end_s"] - h["launch_s"] for h in result.holdings)
    assert result.spot_node_s + result.on_demand_node_s == pytest.approx(node_s)
    on_demand = result.holdings[4:]
    assert len({(h["launch_s"], h["end_s"]) for h in on_demand}) == 1  # held as one set
    assert result.cost_usd == pytest.approx(sum(
        (h["end_s"] - h["launch_s"]) * h["price_usd_per_hour"] / 3600 for h in result.holdings))
    assert np.isfinite(result.final_eval_loss)
