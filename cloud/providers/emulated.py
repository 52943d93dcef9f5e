"""The `emulated` provider: nodes on this machine, spot capacity from real traces replayed fast.

Each zone is a `ReplayMarket` (one trace file's window, `cloud/emulated.py`); all zones share one
`ReplayClock` (emulated seconds since the job started). The provider does not run trainers
itself: a caller attaches the process that stands for a node (`attach_process`), or, like
`trainwise/emulated.py`, drives its own processes and reports when a node went down
(`node_down`). Rules, the same as the simulator's (`cloud.simulator.ClusterRules`):

- launch: a node is `pending` for `changeover_s` (boot + restore), then `running`. A spot launch
  needs free capacity in the zone at the current tick (`available_at(tick)` minus the zone's live
  spot nodes), else `LaunchFailedError`; on-demand always succeeds.
- each tick boundary (`on_tick`): where a zone holds more live spot nodes than the trace has, the
  newest ones get a notice: state `notice`, SIGTERM to an attached process, and the node stops
  being the job's (its bill is closed provisionally at the notice). It is `reclaimed` when its
  process exits or the notice (`notice_s`) runs out, whichever first; an attached process still
  alive then gets SIGKILL.
- billing (`cloud/emulated.py`'s rule, node-seconds x price): from launch until the node is down;
  a node told to stop is billed until its process exits, at most the notice.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloud import emulated as replay
from cloud.providers.base import (
    ON_DEMAND,
    SPOT,
    ComputeProvider,
    LaunchFailedError,
    NodeEvent,
    NodeHandle,
    NodeState,
    NodeStatus,
    SpotPricePoint,
    UnknownInstanceTypeError,
    UnknownZoneError,
    check_count,
    check_market,
)
from cloud.providers.registry import register_provider
from cloud.simulator import ClusterRules

NAME = "emulated"
# A training run's market (`for_run`): every zone of one real trace folder, replayed fast.
DEFAULT_TRACE_FOLDER = "availability-1node-aws-2023-02"
DEFAULT_WINDOW_TICKS = 2000
DEFAULT_SECONDS_PER_TICK = 0.5
# The zone file a bare clone replays (no trace folder): the labelled synthetic stand-in.
STAND_IN_ZONE_FILE = "us-east-1a_v100_1.json"


@dataclass
class _Node:
    handle: NodeHandle
    holding: replay.Holding
    state: NodeState = NodeState.PENDING
    process: subprocess.Popen | None = None
    stop_wall_s: float | None = None  # time.monotonic() when told to stop (notice or terminate)


@register_provider(NAME)
@dataclass
class EmulatedProvider(ComputeProvider):
    """Several zones' replayed markets on one clock; see the module docstring."""

    markets: Sequence[replay.ReplayMarket]
    clock: replay.ReplayClock
    rules: ClusterRules = field(default_factory=ClusterRules)
    name: str = NAME
    _nodes: list[_Node] = field(default_factory=list)
    _events: list[NodeEvent] = field(default_factory=list)
    _serial: int = 0

    def __post_init__(self) -> None:
        zones = [m.zone for m in self.markets]
        if not zones or len(set(zones)) != len(zones):
            raise ValueError(f"markets {zones}: give at least one, one per zone")
        ticks = {m.tick_s for m in self.markets}
        if ticks != {int(self.clock.tick_s)}:
            raise ValueError(f"markets tick every {sorted(ticks)} s, the clock every "
                             f"{self.clock.tick_s} s: replay traces of one tick length together")

    # The trace folder is read under TRAINWISE_DATA_DIR (`for_run`).
    setting_names = ("TRAINWISE_DATA_DIR",)

    @classmethod
    def for_run(cls, instance_type: str, region: str, *,
                trace_folder: str = DEFAULT_TRACE_FOLDER, window_start_tick: int = 0,
                seconds_per_tick: float = DEFAULT_SECONDS_PER_TICK,
                **options: Any) -> EmulatedProvider:
        """A training run's provider: every zone of `trace_folder` under TRAINWISE_DATA_DIR/spot
        (a labelled synthetic stand-in when it is missing) from `window_start_tick`, replayed at
        `seconds_per_tick` wall seconds per trace tick. The trace decides the instance type and
        the zones; `instance_type` and `region` are checked at launch (`GangSession`)."""
        if options:
            raise TypeError(f"the emulated provider takes trace_folder, window_start_tick and "
                            f"seconds_per_tick for a run, not {', '.join(sorted(options))}")
        from trainwise import settings

        markets = _run_markets(trace_folder, int(window_start_tick), str(settings.data_dir()))
        clock = replay.ReplayClock(float(markets[0].tick_s), float(seconds_per_tick))
        return cls(list(markets), clock, replay.default_rules())

    @classmethod
    def from_traces(cls, trace_folder: str, zone_files: Sequence[str], *, window_start_tick: int,
                    n_ticks: int, spot_dir: str | Path, seconds_per_tick: float,
                    rules: ClusterRules | None = None) -> EmulatedProvider:
        """One zone per trace file of `trace_folder`, all from the same window start."""
        markets = [replay.load_replay_market(trace_folder, f, window_start_tick, n_ticks,
                                             spot_dir) for f in zone_files]
        clock = replay.ReplayClock(float(markets[0].tick_s), seconds_per_tick)
        return cls(markets, clock, rules or ClusterRules())

    # -- lookups ------------------------------------------------------------------------------
    def now_s(self) -> float:
        return self.clock.now_s

    @property
    def zones(self) -> tuple[str, ...]:
        return tuple(m.zone for m in self.markets)

    def market(self, zone: str) -> replay.ReplayMarket:
        for market in self.markets:
            if market.zone == zone:
                return market
        raise UnknownZoneError(self.name, zone, self.zones)

    def _node(self, node: NodeHandle) -> _Node:
        for record in self._nodes:
            if record.handle.node_id == node.node_id:
                return record
        raise KeyError(f"node {node.node_id!r} was not launched by this {self.name} provider")

    def holding(self, node: NodeHandle) -> replay.Holding:
        """The node's billing record (launch, end, notice) in `cloud/emulated.py`'s terms."""
        return self._node(node).holding

    @property
    def holdings(self) -> list[replay.Holding]:
        return [n.holding for n in self._nodes]

    def nodes(self) -> list[NodeHandle]:
        return [n.handle for n in self._nodes]

    def live_spot(self, zone: str) -> list[_Node]:
        """Spot nodes of `zone` still the job's (pending or running, not told to stop)."""
        return [n for n in self._nodes if n.handle.zone == zone and n.handle.market == SPOT
                and n.state in (NodeState.PENDING, NodeState.RUNNING)]

    # -- the interface ------------------------------------------------------------------------
    def launch(self, zone: str, instance_type: str, market: str, count: int = 1
               ) -> list[NodeHandle]:
        check_market(market)
        check_count(count)
        replayed = self.market(zone)
        if instance_type != replayed.instance_type:
            raise UnknownInstanceTypeError(self.name, instance_type, (replayed.instance_type,),
                                           f"zone {zone} (its trace {replayed.source})")
        if market == SPOT:
            free = replayed.available_at(self.clock.tick) - len(self.live_spot(zone))
            if free < count:
                raise LaunchFailedError(
                    self.name, zone, instance_type, market, count,
                    f"the trace has {max(free, 0)} spot node(s) free at tick "
                    f"{replayed.window_start_tick + self.clock.tick}; wait, try another zone, or "
                    "launch on-demand")
        price = self.price_usd_per_hour(instance_type, zone, market)
        handles = []
        for _ in range(count):
            self._serial += 1
            handle = NodeHandle(f"emu-{zone}-{self._serial:04d}", self.name, zone, instance_type,
                                market, price)
            holding = replay.Holding(market, self.clock.now_s, price, zone=zone)
            self._nodes.append(_Node(handle, holding))
            handles.append(handle)
        return handles

    def price_usd_per_hour(self, instance_type: str, zone: str, market: str) -> float:
        """The replayed market's price (its trace's collection.toml, else the price table)."""
        check_market(market)
        replayed = self.market(zone)
        if instance_type != replayed.instance_type:
            raise UnknownInstanceTypeError(self.name, instance_type, (replayed.instance_type,),
                                           f"zone {zone} (its trace {replayed.source})")
        return replayed.price_usd_per_hour(market)

    def forget(self, node: NodeHandle) -> None:
        """Withdraw a launch before its node booted (the job finished meanwhile): never billed."""
        record = self._node(node)
        if record.process is not None:
            raise ValueError(f"node {node.node_id} runs pid {record.process.pid}: terminate it")
        self._nodes.remove(record)

    def terminate(self, node: NodeHandle, reason: str = "released") -> None:
        record = self._node(node)
        if record.holding.end_s is None:
            record.holding.end_s, record.holding.end_reason = self.clock.now_s, reason
        if record.state.alive and record.state != NodeState.NOTICE:
            record.state = NodeState.TERMINATED
            self._events.append(NodeEvent(node.node_id, NodeState.TERMINATED, self.clock.now_s,
                                          reason))
            self._stop_process(record)

    def describe(self, node: NodeHandle) -> NodeStatus:
        record = self._node(node)
        self._poll_process(record)
        holding = record.holding
        ended = holding.end_s if not record.state.alive else None
        return NodeStatus(record.handle, record.state, holding.launch_s, holding.notice_at_s,
                          ended, holding.end_reason)

    def spot_price_history(self, zone: str, instance_type: str, start_s: float, end_s: float
                           ) -> list[SpotPricePoint]:
        """One point per replayed tick in [start_s, end_s]: the zone's spot price (the traces
        hold availability, not prices) and how many spot nodes the trace had."""
        replayed = self.market(zone)
        if instance_type != replayed.instance_type:
            raise UnknownInstanceTypeError(self.name, instance_type, (replayed.instance_type,),
                                           f"zone {zone}")
        if end_s < start_s:
            raise ValueError(f"end_s={end_s} is before start_s={start_s}")
        first = max(0, int(start_s // replayed.tick_s))
        last = int(end_s // replayed.tick_s)
        return [SpotPricePoint(zone, instance_type, float(t * replayed.tick_s),
                               replayed.spot_usd_per_hour, replayed.available_at(t))
                for t in range(first, last + 1)]

    def poll_events(self) -> list[NodeEvent]:
        for record in self._nodes:
            self._poll_process(record)
        events, self._events = sorted(self._events, key=lambda e: e.at_s), []
        return events

    # -- time ---------------------------------------------------------------------------------
    def advance_to(self, target_s: float) -> list[NodeEvent]:
        """Moves the clock, applying each tick boundary on the way (`on_tick`); returns the
        events. For callers that do not freeze the clock themselves (trainwise/emulated.py)."""
        for tick in self.clock.advance_to(target_s):
            self.on_tick(tick)
        self._expire_notices()
        self._boot_pending()
        return self.poll_events()

    def on_tick(self, tick: int) -> list[NodeHandle]:
        """The trace at window tick `tick`: notices to spot nodes over each zone's capacity
        (newest first). Returns the nodes noticed now."""
        self._expire_notices()
        self._boot_pending()
        noticed = []
        for market in self.markets:
            live = self.live_spot(market.zone)
            excess = len(live) - market.available_at(tick)
            for record in sorted(live, key=lambda n: n.holding.launch_s)[len(live) - excess:]:
                self._notice(record, market, tick)
                noticed.append(record.handle)
        return noticed

    def _notice(self, record: _Node, market: replay.ReplayMarket, tick: int) -> None:
        now = self.clock.now_s
        record.state = NodeState.NOTICE
        record.holding.notice_at_s = now
        if record.holding.end_s is None:
            record.holding.end_s, record.holding.end_reason = now, "preempted"
        self._events.append(NodeEvent(
            record.handle.node_id, NodeState.NOTICE, now,
            f"spot reclaimed in {market.zone} at trace tick {market.window_start_tick + tick}: "
            f"{self.rules.notice_s:.0f} s notice"))
        self._stop_process(record)

    def _expire_notices(self) -> None:
        now = self.clock.now_s
        for record in self._nodes:
            notice = record.holding.notice_at_s
            # A terminated node with a process is billed until that process exits, at most
            # the notice too (then it is killed, as the provider would).
            stopping = record.state == NodeState.NOTICE or (
                record.state == NodeState.TERMINATED and record.process is not None
                and record.holding.trainer_exit_s is None)
            if stopping and notice is not None and now >= notice + self.rules.notice_s:
                if record.process is not None and record.process.poll() is None:
                    os.kill(record.process.pid, signal.SIGKILL)
                    record.process.wait()
                self._down(record, notice + self.rules.notice_s)

    def _boot_pending(self) -> None:
        for record in self._nodes:
            if (record.state == NodeState.PENDING
                    and self.clock.now_s >= record.holding.launch_s + self.rules.changeover_s):
                record.state = NodeState.RUNNING
                self._events.append(NodeEvent(record.handle.node_id, NodeState.RUNNING,
                                              record.holding.launch_s + self.rules.changeover_s))

    # -- processes standing for nodes ---------------------------------------------------------
    def attach_process(self, node: NodeHandle, process: subprocess.Popen) -> None:
        """`process` is the node's workload: SIGTERM on its notice or termination, SIGKILL when
        the notice runs out; its exit ends the node's bill (at most the notice)."""
        self._node(node).process = process

    def _stop_process(self, record: _Node) -> None:
        if record.process is None:
            return
        if record.stop_wall_s is None:
            record.stop_wall_s = time.monotonic()
            if record.holding.notice_at_s is None:
                record.holding.notice_at_s = self.clock.now_s  # billed until it is down
        if record.process.poll() is None:
            os.kill(record.process.pid, signal.SIGTERM)

    def _poll_process(self, record: _Node) -> None:
        if (record.process is None or record.stop_wall_s is None
                or record.holding.trainer_exit_s is not None or record.process.poll() is None):
            return
        self.node_down(record.handle, time.monotonic() - record.stop_wall_s)

    def node_down(self, node: NodeHandle, shutdown_wall_s: float) -> None:
        """The node's process exited `shutdown_wall_s` wall seconds after it was told to stop:
        the node is down then at replay speed, at most the notice (`replay.node_down_s`)."""
        record = self._node(node)
        holding = record.holding
        if holding.notice_at_s is None:
            return
        self._down(record, replay.node_down_s(holding.notice_at_s, shutdown_wall_s,
                                              self.clock.emulated_per_wall_s,
                                              self.rules.notice_s))

    def _down(self, record: _Node, down_s: float) -> None:
        holding = record.holding
        holding.trainer_exit_s = down_s
        holding.end_s = max(holding.end_s if holding.end_s is not None else down_s, down_s)
        if record.state == NodeState.NOTICE:
            record.state = NodeState.RECLAIMED
            self._events.append(NodeEvent(record.handle.node_id, NodeState.RECLAIMED, down_s))

    def bill_usd(self) -> float:
        return replay.bill_usd(self.holdings, self.clock.now_s)

    def node_cost_usd(self, node: NodeHandle) -> float:
        return replay.bill_usd([self.holding(node)], self.clock.now_s)


@functools.lru_cache(maxsize=8)
def _run_markets(folder: str, start_tick: int, data_dir: str) -> tuple[replay.ReplayMarket, ...]:
    """Every zone of a trace folder as a replayed market (read once per process: immutable)."""
    spot_dir = Path(data_dir) / "spot"
    files = sorted(p.name for p in (spot_dir / folder).glob("*.json")) or [STAND_IN_ZONE_FILE]
    return tuple(replay.load_replay_market(folder, f, start_tick, DEFAULT_WINDOW_TICKS, spot_dir)
                 for f in files)


__all__ = ["DEFAULT_SECONDS_PER_TICK", "DEFAULT_TRACE_FOLDER", "DEFAULT_WINDOW_TICKS",
           "EmulatedProvider", "NAME", "ON_DEMAND", "SPOT"]
