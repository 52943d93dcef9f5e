"""The `emulated` provider behind the provider interface: real spot traces replayed in
accelerated time over several zones and nodes, notices, reclaims, SIGTERM to the node's process,
billing per node-second, and clear errors."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cloud import emulated as replay
from cloud.providers import (
    LaunchFailedError,
    NodeState,
    UnknownInstanceTypeError,
    UnknownZoneError,
    make_provider,
)
from cloud.providers.emulated import EmulatedProvider
from cloud.simulator import ClusterRules
from trainwise import settings

SPOT_DIR = settings.data_dir() / "spot"
ONE_NODE = "availability-1node-aws-2023-02"
FOUR_NODE = "preemption-4node-aws-2023-08"
needs_traces = pytest.mark.skipif(not (SPOT_DIR / ONE_NODE).is_dir() or
                                  not (SPOT_DIR / FOUR_NODE).is_dir(),
                                  reason="the shared spot traces are missing")


def _two_zones() -> EmulatedProvider:
    """us-east-1a from a window where spot is up 4 ticks then reclaimed; us-east-1c (no spot)."""
    trace = replay.load_replay_market(ONE_NODE, "us-east-1a_v100_1.json", 0, 20_158, SPOT_DIR)
    start = replay.find_drop_window(trace.available, up_ticks=4, max_down_ticks=10, min_start=200)
    return EmulatedProvider.from_traces(
        ONE_NODE, ["us-east-1a_v100_1.json", "us-east-1c_v100_1.json"], window_start_tick=start,
        n_ticks=20, spot_dir=SPOT_DIR, seconds_per_tick=0.2)


@needs_traces
def test_multi_zone_spot_follows_the_trace_with_notice_then_reclaim():
    provider = _two_zones()
    a, c = provider.market("us-east-1a"), provider.market("us-east-1c")
    assert list(a.available[:5]) == [1, 1, 1, 1, 0] and c.available_at(0) == 0
    provider.advance_to(0.0)
    with pytest.raises(LaunchFailedError, match="0 spot node.*us-east-1c|us-east-1c.*0 spot"):
        provider.launch("us-east-1c", "p3.2xlarge", "spot", 1)
    (spot,) = provider.launch("us-east-1a", "p3.2xlarge", "spot", 1)
    (on_demand,) = provider.launch("us-east-1c", "p3.2xlarge", "on_demand", 1)
    assert provider.state(spot) == NodeState.PENDING
    provider.advance_to(360.0)  # the changeover
    assert provider.state(spot) == NodeState.RUNNING
    events = provider.advance_to(4 * 195.0)  # tick 4: the trace drops spot in us-east-1a
    assert [(e.node_id, e.state) for e in events] == [(spot.node_id, NodeState.NOTICE)]
    assert provider.describe(spot).notice_at_s == 4 * 195.0
    events = provider.advance_to(4 * 195.0 + 120.0)  # the notice runs out: reclaimed
    assert [(e.node_id, e.state, e.at_s) for e in events] == [
        (spot.node_id, NodeState.RECLAIMED, 900.0)]
    assert provider.state(on_demand) == NodeState.RUNNING  # on-demand is never reclaimed
    provider.advance_to(1000.0)
    provider.terminate(on_demand)
    # Billing per node-second at each zone's price: spot 0..900 s, on-demand 0..1000 s.
    assert provider.node_cost_usd(spot) == pytest.approx(900 * a.spot_usd_per_hour / 3600)
    assert provider.bill_usd() == pytest.approx(
        900 * a.spot_usd_per_hour / 3600 + 1000 * c.on_demand_usd_per_hour / 3600)
    history = provider.spot_price_history("us-east-1a", "p3.2xlarge", 0.0, 5 * 195.0)
    assert [p.available for p in history] == [1, 1, 1, 1, 0, 0]
    assert {p.usd_per_hour for p in history} == {a.spot_usd_per_hour}


@needs_traces
def test_a_four_node_gang_loses_the_nodes_the_trace_takes():
    # preemption-4node us-east-1f from tick 18: 4, 4, 1, 1, 4, 0 spot nodes up.
    provider = EmulatedProvider.from_traces(FOUR_NODE, ["us-east-1f_v100_1.json"],
                                            window_start_tick=18, n_ticks=8, spot_dir=SPOT_DIR,
                                            seconds_per_tick=0.1)
    assert list(provider.market("us-east-1f").available[:6]) == [4, 4, 1, 1, 4, 0]
    provider.advance_to(0.0)
    gang = provider.launch("us-east-1f", "p3.2xlarge", "spot", 4)
    with pytest.raises(LaunchFailedError, match="0 spot node"):
        provider.launch("us-east-1f", "p3.2xlarge", "spot", 1)
    events = provider.advance_to(2 * 300.0)
    noticed = [e.node_id for e in events if e.state == NodeState.NOTICE]
    assert noticed == [n.node_id for n in gang[1:]]  # the newest three; one node is kept
    assert provider.state(gang[0]) == NodeState.RUNNING
    provider.advance_to(4 * 300.0)  # capacity back to 4: three free spot slots again
    assert len(provider.launch("us-east-1f", "p3.2xlarge", "spot", 3)) == 3
    events = provider.advance_to(5 * 300.0)  # 0 left: every live spot node gets its notice
    assert len([e for e in events if e.state == NodeState.NOTICE]) == 4


def _market(available, zone="us-east-1a") -> replay.ReplayMarket:
    return replay.ReplayMarket(zone, "p3.2xlarge", 195, np.asarray(available, dtype=np.int64), 0,
                               "test array", 0.9, 3.06, "test")


def _provider(available, seconds_per_tick=0.2) -> EmulatedProvider:
    return make_provider("emulated", markets=[_market(available)],
                         clock=replay.ReplayClock(195.0, seconds_per_tick),
                         rules=ClusterRules())


def test_unknown_zone_instance_type_and_market_are_named():
    provider = _provider([1, 1])
    with pytest.raises(UnknownZoneError, match="'eu-west-1a'.*us-east-1a"):
        provider.launch("eu-west-1a", "p3.2xlarge", "spot", 1)
    with pytest.raises(UnknownInstanceTypeError, match="'g5.xlarge'.*p3.2xlarge"):
        provider.launch("us-east-1a", "g5.xlarge", "on_demand", 1)
    with pytest.raises(ValueError, match="market 'preemptible'"):
        provider.launch("us-east-1a", "p3.2xlarge", "preemptible", 1)
    with pytest.raises(ValueError, match="count=0"):
        provider.launch("us-east-1a", "p3.2xlarge", "spot", 0)
    with pytest.raises(ValueError, match="one tick length"):
        EmulatedProvider([_market([1])], replay.ReplayClock(300.0, 0.2))
    assert provider.nodes() == []


_TRAPS_SIGTERM = """
import signal, sys, time, pathlib
ready = pathlib.Path(sys.argv[1])
def stop(*_):
    ready.with_suffix('.term').write_text('SIGTERM')
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
ready.write_text('up')
while True:
    time.sleep(0.01)
"""
# Takes SIGTERM, says so in the `.term` file, and carries on: the notice is ignored.
_IGNORES_SIGTERM = _TRAPS_SIGTERM.replace("    sys.exit(0)\n", "")


def _wait_for(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        time.sleep(0.01)


def _node_process(tmp_path: Path, code: str) -> tuple[subprocess.Popen, Path]:
    ready = tmp_path / "ready"
    process = subprocess.Popen([sys.executable, "-c", code, str(ready)], start_new_session=True)
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert time.monotonic() < deadline and process.poll() is None, "node process did not start"
        time.sleep(0.01)
    return process, ready


def test_a_notice_sigterms_the_node_process_and_bills_until_it_exits(tmp_path):
    provider = _provider([1, 1, 0, 0])
    provider.advance_to(0.0)
    (node,) = provider.launch("us-east-1a", "p3.2xlarge", "spot", 1)
    process, ready = _node_process(tmp_path, _TRAPS_SIGTERM)
    provider.attach_process(node, process)
    provider.advance_to(2 * 195.0)  # tick 2: reclaim notice -> SIGTERM
    assert process.wait(timeout=20) == 0
    assert ready.with_suffix(".term").read_text() == "SIGTERM"
    status = provider.describe(node)
    assert status.state == NodeState.RECLAIMED
    # Down when the process exited: after the notice, before its 120 s ran out.
    assert 390.0 < status.ended_at_s < 390.0 + 120.0
    assert provider.node_cost_usd(node) == pytest.approx(status.ended_at_s * 0.9 / 3600)


def test_a_process_that_ignores_the_notice_is_killed_when_it_runs_out(tmp_path):
    provider = _provider([1, 0, 0, 0])
    provider.advance_to(0.0)
    (node,) = provider.launch("us-east-1a", "p3.2xlarge", "spot", 1)
    process, ready = _node_process(tmp_path, _IGNORES_SIGTERM)
    provider.attach_process(node, process)
    provider.advance_to(195.0)  # notice
    term = ready.with_suffix(".term")
    _wait_for(term.exists, "the node process received the notice's SIGTERM")
    assert term.read_text() == "SIGTERM" and process.poll() is None  # SIGTERM ignored
    events = provider.advance_to(195.0 + 120.0)
    assert process.poll() == -9  # SIGKILL at the end of the notice
    assert [(e.state, e.at_s) for e in events] == [(NodeState.RECLAIMED, 315.0)]
    assert provider.node_cost_usd(node) == pytest.approx(315.0 * 0.9 / 3600)


def test_terminate_stops_billing_and_the_process(tmp_path):
    provider = _provider([1] * 10)
    provider.advance_to(0.0)
    (node,) = provider.launch("us-east-1a", "p3.2xlarge", "on_demand", 1)
    process, _ = _node_process(tmp_path, _TRAPS_SIGTERM)
    provider.attach_process(node, process)
    provider.advance_to(500.0)
    provider.terminate(node, "released")
    assert process.wait(timeout=20) == 0
    assert provider.state(node) == NodeState.TERMINATED
    cost = provider.node_cost_usd(node)
    assert 500 * 3.06 / 3600 <= cost <= 620 * 3.06 / 3600  # until it exited, at most the notice
    provider.advance_to(1500.0)
    assert provider.node_cost_usd(node) == cost  # nothing billed after the node is down


# -- a replacement node restores from the object store -------------------------------------------
def test_a_replacement_node_resumes_from_the_stores_latest_committed_checkpoint(tmp_path):
    import dataclasses
    import shutil

    from telemetry.reader import read_run_events
    from tests.test_training_loop import text_examples, tiny_config
    from training.loop import train
    from trainwise.emulated import restore_from_store
    from trainwise.object_store import CheckpointUploader, LocalObjectStore

    store = LocalObjectStore(tmp_path / "store")
    prefix = "checkpoints/cycle/run-a"
    examples = text_examples()
    config = dataclasses.replace(tiny_config(), max_steps=24, checkpoint_every_steps=8,
                                 run_id="run-a")
    node_dir = tmp_path / "node-1"
    uploader = CheckpointUploader(store, prefix)
    first = train(config, examples, None, node_dir, stop_after_steps=16,
                  on_checkpoint=uploader.submit)
    assert uploader.drain(30).ok and first.steps == 16
    shutil.rmtree(node_dir)  # the node is gone, and its disk with it

    replacement = tmp_path / "node-2"
    point = restore_from_store(store, prefix, replacement / "checkpoints")
    assert point is not None and point.source == "store" and point.step == 16
    resumed = train(config, examples, None, replacement, resume_from=point.path)
    assert resumed.status == "completed" and resumed.steps == 24
    steps = [e["step"] for e in read_run_events(resumed.telemetry_dir) if e["type"] == "step"]
    assert steps[0] == 17 and steps[-1] == 24  # nothing before the checkpoint re-run

    # A fresh node with nothing in the store starts over; a newer local checkpoint wins.
    assert restore_from_store(store, "checkpoints/cycle/other", tmp_path / "n3") is None
    again = restore_from_store(store, prefix, replacement / "checkpoints")
    assert again is not None and again.source == "local" and again.step == 24


@needs_traces
@pytest.mark.slow  # a real emulated job with preemptions (about 40 s on a shared 2-core machine)
def test_emulated_replacements_restore_from_the_store_after_the_disk_is_lost(tmp_path):
    import json

    from trainwise.emulated import run_emulated
    from trainwise.object_store import LocalObjectStore, latest_committed_checkpoint

    trace = replay.load_replay_market(ONE_NODE, "us-east-1a_v100_1.json", 0, 20_158, SPOT_DIR)
    start = replay.find_drop_window(trace.available, up_ticks=4, max_down_ticks=10, min_start=200)
    store_dir = tmp_path / "store"
    result = run_emulated("pystdlib", max_steps=40, window_start_tick=start, seconds_per_tick=0.2,
                          policy_name="trainwise_heuristic", out_dir=tmp_path / "runs",
                          run_id="emu-store", max_wall_s=240, object_store_dir=store_dir)
    assert result.status == "completed" and result.steps == 40
    assert result.preemptions >= 1 and result.resumes >= 1
    outcomes = [json.loads(p.read_text())
                for p in sorted((result.run_dir / "emulated").glob("result-*.json"))]
    for before, after in zip(outcomes, outcomes[1:]):
        # Each replacement started on an empty disk and restored the step its predecessor
        # checkpointed at its notice, from the store.
        assert after["restored_from_store_step"] == before["steps"], (before, after)
        assert after["resumed_from"].startswith(str(result.run_dir / "checkpoints"))
    assert result.replayed_steps == 0  # no step re-run: nothing was lost with the disks
    committed = latest_committed_checkpoint(LocalObjectStore(store_dir),
                                            "checkpoints/pystdlib/emu-store", tmp_path / "dl")
    assert committed is not None and committed.step == 40
