"""The live slow tick sees the provider's market (issue 10 item 2): the emulated provider's
replayed real trace at the run's trace clock, the nodes it holds, the run's progress; with that
view the allocation policy moves the run through `allocation.json`, and without one (an EC2
endpoint that cannot be read, no trace) the nodes are kept with the reason recorded. The aws
provider's view from EC2 itself is tested against moto_server in tests/test_market_view_aws.py."""

import json
from pathlib import Path

import numpy as np
import pytest

from cloud import emulated as replay
from telemetry import events
from telemetry.writer import SegmentWriter
from tests.shared_data import needs_spot_data
from training import scoring
from training.curriculum import Curriculum, curriculum_version, write_curriculum
from trainwise import gang, market_view, settings, slow_tick

PARTITION = "pystdlib"
TICK_S = 195  # the 2023-02 availability traces' tick
WALL_AT = 1_000_000.0  # wall time of gang.json's last record (time.time() scale)


@pytest.fixture(autouse=True)
def _pinned_wall_clock(monkeypatch):
    """The tick reads the provider clock as gang.json's last record + wall seconds since x 390:
    pinned, so a slow test machine does not move the trace on by ticks."""
    monkeypatch.setattr(market_view, "wall_now_s", lambda: WALL_AT)


def _state(run_id: str, *, region: str = "us-west-2", max_steps: int = 1000,
           steps: int = 200) -> Path:
    """A live run (request, telemetry from the real writer: 0.1 s steps, a checkpoint every 50
    steps) plus the partition's scores and published curriculum the tick reads."""
    home = settings.home_dir()
    ids = np.arange(40, dtype=np.int64)
    scoring.write_scores(scoring.ScoreTable(
        partition=PARTITION, data_fingerprint="fp", example_ids=ids,
        shard_index=np.zeros(40, np.int32), loss=np.linspace(1.0, 3.0, 40), el2n=None,
        step=None, scorer="test"), home / "scores" / PARTITION)
    weights = np.ones(40)
    write_curriculum(Curriculum(
        partition=PARTITION, version=curriculum_version(PARTITION, ids, weights, 0.0, "fp",
                                                        None, 0.25),
        example_ids=ids, weights=weights, pruning_rate=0.0, data_fingerprint="fp",
        scores_step=None, anneal_fraction=0.25), home / "curricula" / PARTITION)
    run_dir = home / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "request.json").write_text(json.dumps({
        "partition": PARTITION, "max_steps": max_steps, "region": region,
        "instance_type": "p3.2xlarge", "data_selection": "static"}))
    with SegmentWriter(run_dir / "telemetry", run_id) as writer:
        for step in range(1, steps + 1):
            writer.write(events.StepEvent(
                run_id=run_id, step=step, train_loss=3.0, learning_rate=1e-3, grad_norm=1.0,
                grad_noise_scale=float("nan"), micro_batch_size=32, grad_accum_steps=1,
                step_time_ms=100.0, samples_seen=32 * step, tokens_seen=2048 * step,
                elapsed_s=0.1 * step, cost_usd=0.0001 * step))
            if step % 50 == 0:
                writer.write(events.CheckpointEvent(
                    run_id=run_id, step=step, path=f"ckpt-{step}", sha256="0" * 64,
                    size_bytes=10, save_ms=50.0, reason="interval"))
    return run_dir


def _gang_json(run_dir: Path, *, provider: str = "emulated", market: str = "spot",
               zone: str = "us-west-2a", provider_s: float, launch_s: float = 0.0) -> None:
    """What `GangSession.record()` writes (the fields the view reads): held nodes, the launch
    and the provider clock at the last record."""
    (run_dir / "gang.json").write_text(json.dumps({
        "provider": provider, "instance_type": "p3.2xlarge", "market": market, "zone": zone,
        "nodes": 1, "reclaims": 0, "provider_now_s": provider_s,
        "allocation": {"market": market, "zone": zone, "nodes": 1, "reason": "the train request",
                       "source": "request"},
        "history": [
            {"event": "launch", "reason": "start", "provider_time_s": launch_s,
             "wall_time_s": WALL_AT - 1.0, "market": market, "zone": zone},
            {"event": "restore", "reason": "step 150", "provider_time_s": provider_s,
             "wall_time_s": WALL_AT}]}))


def _view(run_dir: Path, now_wall_s: float = WALL_AT) -> market_view.MarketView:
    from telemetry.reader import read_run_events

    request = json.loads((run_dir / "request.json").read_text())
    run_events = read_run_events(run_dir / "telemetry" / run_dir.name)
    return market_view.market_view(run_events, request, gang.read_gang(run_dir),
                                   now_wall_s=now_wall_s)


@needs_spot_data
def test_the_view_is_the_replayed_trace_at_the_runs_clock():
    # us-west-2 in availability-1node-aws-2023-02: all three zones up at tick 10; at tick 53
    # us-west-2a and -2c are down, -2b up.
    run_dir = _state("r-view")
    _gang_json(run_dir, provider_s=10 * TICK_S + 5)
    up = _view(run_dir)
    obs = up.observation
    assert obs is not None, up.reason
    assert obs.zones == ("us-west-2a", "us-west-2b", "us-west-2c")
    assert obs.spot_available_by_zone == (1, 1, 1)
    assert (obs.zone, obs.spot_nodes, obs.on_demand_nodes, obs.node_count) == (
        "us-west-2a", 1, 0, 1)
    assert all(0 < s < d for s, d in zip(obs.spot_price_usd_per_hour_by_zone,
                                         obs.on_demand_price_usd_per_hour_by_zone, strict=True))
    # Progress on the provider's clock: 0.1 wall-s steps x 390 (195 s ticks, 0.5 wall-s each).
    assert obs.work_done_h / obs.work_total_h == pytest.approx(200 / 1000)
    assert obs.work_checkpointed_h == pytest.approx(obs.work_done_h)  # checkpoint at step 200
    assert obs.checkpoint_interval_s == pytest.approx(50 * 0.1 * 390.0)
    assert obs.checkpoint_save_s == pytest.approx(0.05 * 390.0)
    on_demand_s = obs.changeover_s + 1000 * 0.1 * 390.0
    assert obs.deadline_s == pytest.approx(1.5 * on_demand_s)
    assert "default 1.5x the on-demand time" in up.reason

    # The clock moves on with the wall seconds since gang.json's last record, at replay speed:
    # 43 ticks later (16.77 wall-s) spot is down in the held zone.
    down = _view(run_dir, now_wall_s=WALL_AT + 43 * 0.5).observation
    assert down.spot_available_by_zone == (0, 1, 0)
    assert down.time_s == pytest.approx(53 * TICK_S + 5)
    # A deadline the request sets is used as given.
    request = json.loads((run_dir / "request.json").read_text())
    (run_dir / "request.json").write_text(json.dumps({**request, "deadline_s": 90_000.0}))
    assert _view(run_dir).observation.deadline_s == 90_000.0


@needs_spot_data
def test_spot_down_in_the_held_zone_moves_the_run_through_allocation_json():
    run_dir = _state("r-move")
    # Spot up in the held zone (tick 10): the policy keeps the node, nothing is written.
    _gang_json(run_dir, provider_s=10 * TICK_S + 5)
    tick = slow_tick.decide(settings.home_dir(), PARTITION)
    assert tick.action.allocation is not None, tick.action.reason
    assert "market view: emulated trace availability-1node-aws-2023-02 tick 10" in (
        tick.action.reason)
    assert "allocation" not in slow_tick.apply_run_decisions(settings.home_dir(), tick)
    assert gang.read_allocation(run_dir) is None

    # Tick 53: spot gone in us-west-2a (held), up only in us-west-2b.
    _gang_json(run_dir, provider_s=53 * TICK_S + 5, launch_s=40 * TICK_S)
    tick = slow_tick.decide(settings.home_dir(), PARTITION)
    allocation = tick.action.allocation
    assert allocation is not None, tick.action.reason
    assert "us-west-2a 0, us-west-2b 1, us-west-2c 0" in tick.action.reason
    assert (allocation.zone, allocation.spot_nodes) != ("us-west-2a", 1), (
        "spot is down in us-west-2a: the policy may not keep spot there")
    if allocation.spot_nodes:
        assert allocation.zone == "us-west-2b", "the only zone with spot up"
    record = slow_tick.apply_run_decisions(settings.home_dir(), tick)
    wanted = gang.read_allocation(run_dir)
    assert wanted is not None and wanted.source == "slow_policy"
    assert (wanted.market, wanted.zone) != ("spot", "us-west-2a")
    assert record["allocation"] == {"market": wanted.market, "zone": wanted.zone, "nodes": 1}


def test_unreadable_aws_or_no_trace_keeps_the_nodes_with_the_reason(monkeypatch):
    # aws with an EC2 endpoint that answers nothing: no market, the nodes are kept, and why.
    from tests.servers import free_port

    monkeypatch.setenv("TRAINWISE_EC2_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    run_dir = _state("r-aws")
    _gang_json(run_dir, provider="aws", provider_s=53 * TICK_S)
    view = _view(run_dir)
    assert view.observation is None
    assert view.reason.startswith("EC2's spot prices in us-west-2 could not be read "
                                  "(ProviderUnreachableError"), view.reason
    tick = slow_tick.decide(settings.home_dir(), PARTITION)
    assert tick.action.allocation is None
    assert "no market view this tick: nodes kept; EC2's spot prices" in tick.action.reason
    record = slow_tick.apply_run_decisions(settings.home_dir(), tick)
    assert "allocation" not in record and gang.read_allocation(run_dir) is None

    # The emulated provider without the shared traces replays a synthetic stand-in: no view.
    synthetic = replay.ReplayMarket("us-west-2a", "p3.2xlarge", TICK_S,
                                    replay.synthetic_availability(100), 0,
                                    replay.SYNTHETIC_SOURCE, 0.9, 3.06, "test")
    monkeypatch.setattr(market_view, "emulated_markets", lambda *_: ((synthetic,), 390.0))
    _gang_json(run_dir, provider_s=53 * TICK_S)
    view = _view(run_dir)
    assert view.observation is None and view.reason.startswith("no trace")
    tick = slow_tick.decide(settings.home_dir(), PARTITION)
    assert tick.action.allocation is None and "no trace" in tick.action.reason
    # No gang.json at all: nothing held on record.
    (run_dir / "gang.json").unlink()
    assert "no gang.json" in _view(run_dir).reason


def test_the_view_without_shared_data_uses_the_given_markets(monkeypatch):
    """The same view over markets handed in (a bare clone can run this): spot is down in the
    held zone at the clock's tick, up in the other."""
    def market(zone, available):
        return replay.ReplayMarket(zone, "p3.2xlarge", TICK_S, np.asarray(available), 0,
                                   f"/traces/folder/{zone}_v100_1.json", 0.9, 3.06, "test")

    markets = (market("us-west-2a", [1, 1, 0, 0]), market("us-west-2b", [1, 1, 1, 1]),
               market("us-east-1a", [1, 1, 1, 1]))
    monkeypatch.setattr(market_view, "emulated_markets", lambda *_: (markets, 390.0))
    run_dir = _state("r-given")
    _gang_json(run_dir, provider_s=2 * TICK_S + 1)
    obs = _view(run_dir).observation
    assert obs.zones == ("us-west-2a", "us-west-2b")  # the run's region only
    assert obs.spot_available_by_zone == (0, 1)
    assert obs.spot_price_usd_per_hour_by_zone == (0.9, 0.9)
    # A clock past the replayed window (a stale gang.json, the trainer gone without a run_end):
    # no market data, rather than "spot down everywhere".
    stale = _view(run_dir, now_wall_s=WALL_AT + 10 * 0.5)
    assert stale.observation is None and "past the replayed window (4 ticks)" in stale.reason


@needs_spot_data
def test_the_view_reads_the_gang_json_a_real_provider_session_writes():
    """The contract with `trainwise.gang.GangSession.record()`: its gang.json (provider, zone,
    market, nodes, the launch in its history) is what the view reads."""
    run_dir = _state("r-session")
    session = gang.GangSession(
        gang.provider_for_run("p3.2xlarge", "us-west-2", name="emulated"),
        gang.Allocation(market="spot", zone="us-west-2a", nodes=1, reason="test",
                        source="request"), "p3.2xlarge", run_dir, "r-session", region="us-west-2")
    session.start()
    try:
        record = gang.read_gang(run_dir)
        launch = next(h for h in record["history"] if h["event"] == "launch")
        view = _view(run_dir, now_wall_s=record["history"][-1]["wall_time_s"])
    finally:
        session.close("test over")
    obs = view.observation
    assert obs is not None, view.reason
    assert (obs.zone, obs.spot_nodes, obs.node_count) == ("us-west-2a", 1, 1)
    assert obs.time_s == pytest.approx(record["history"][-1]["provider_time_s"])
    assert obs.since_launch_s == pytest.approx(obs.time_s - launch["provider_time_s"])
    assert record["replay"] == {"trace_folder": gang.DEFAULT_TRACE_FOLDER, "window_start_tick": 0,
                                "seconds_per_tick": gang.DEFAULT_SECONDS_PER_TICK}


@needs_spot_data
def test_the_view_replays_the_window_the_run_recorded():
    """A run whose provider replays a later window of the trace (gang.json "replay") is seen at
    that window, not at the provider's default one."""
    run_dir = _state("r-window")
    _gang_json(run_dir, provider_s=10 * TICK_S)
    record = json.loads((run_dir / "gang.json").read_text())
    default = _view(run_dir).observation
    record["replay"] = {"trace_folder": gang.DEFAULT_TRACE_FOLDER, "window_start_tick": 43,
                        "seconds_per_tick": gang.DEFAULT_SECONDS_PER_TICK}
    (run_dir / "gang.json").write_text(json.dumps(record))
    shifted = _view(run_dir).observation
    assert default is not None and shifted is not None
    # Tick 10 of the default window (all three zones up) against tick 53 of the trace.
    assert default.spot_available_by_zone == (1, 1, 1)
    assert shifted.spot_available_by_zone == (0, 1, 0)
    assert shifted.trace_time_s == pytest.approx(default.trace_time_s + 43 * TICK_S)
