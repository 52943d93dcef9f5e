"""The train job's nodes at a compute provider: launch the allocation, answer reclaims, bill.

A training run (`trainwise/runs.py`) on one node trains in this process, on more than one as a
torchrun gang with one rank per node (item 5); the nodes it holds at the provider
(`cloud.providers`, TRAINWISE_PROVIDER, `emulated` by default) stand for the machines it trains
on, and the provider's bill is the run's cloud bill. `GangSession`, in order:

1. `start()`: launch the allocation (market spot/on-demand, zone, node count) and wait out its
   changeover as real delay (emulated: the changeover at the replay speed; aws: until EC2 says
   running). An unknown zone or instance type, or a provider that cannot be reached, raises the
   provider's own error before a step is trained.
2. While the loop trains, `policy(inner)` wraps its fast policy: at each fast tick (a step
   boundary, on the main thread) the provider's clock moves on (emulated: wall seconds x replay
   speed, so the replayed trace decides reclaims) and its events are polled. A notice for one of
   our nodes, or a new allocation in the run folder's `allocation.json` (the slow layer's
   decision, `write_allocation`), asks the loop in this process to stop
   (`training.loop.request_stop`: the stop a node agent's SIGTERM asks for, but no process
   signals itself): the loop checkpoints at the next step boundary and returns "preempted".
3. `replace()` after such a stop: the old nodes are released (a reclaimed one is already gone,
   billed until the loop stopped, at most the notice), the replacement launched (the allocation
   asked for; when the provider refuses a spot launch, on-demand in the same zone: a recorded
   fallback) and its changeover waited. The caller then restores the checkpoints from the object
   store (the new node's disk is empty) and resumes. A replacement that cannot be launched at all
   ends the run interrupted, never as a success.
4. Everything is recorded: `gang.json` in the run folder (nodes, reclaims, fallbacks, bill), and
   the run's telemetry as slow-layer decision events under `PROVIDER_RANK`, so `trainwise
   explain` shows them next to the trainer's own checkpoints and notices.

5. A torchrun gang (`trainwise.torchrun_gang.TorchrunGang`): one node per
   rank, rank r on node r. A notice for one node SIGTERMs that rank only; the gang stops at one
   step boundary with one checkpoint (rank 0 uploads it to the object store), only the noticed
   node is released and replaced (`replace_noticed`), and the gang restarts at the same world
   size from the store. The train job runs one when its allocation holds more than one node.

Time: the replayed trace runs accelerated (`seconds_per_tick` wall seconds per trace tick, fixed,
or paced by the loop's own steps: `trainwise.replay_pace`); the training does not (its steps
take their real time). Node seconds are on the provider's clock, which runs from the loop's
first step (`resume_clock`: the set-up before it is inside the changeover the boot modelled).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from cloud.providers import (
    ON_DEMAND,
    SPOT,
    ComputeProvider,
    LaunchFailedError,
    NodeHandle,
    NodeState,
    ProviderError,
    provider_class,
    provider_name,
)
from cloud.providers.base import check_market
from cloud.providers.emulated import (  # noqa: F401 - re-exported: EmulatedProvider.for_run's
    DEFAULT_SECONDS_PER_TICK,
    DEFAULT_TRACE_FOLDER,
    DEFAULT_WINDOW_TICKS,
)
from training.safe_files import write_atomic

ALLOCATION_FILE = "allocation.json"
GANG_FILE = "gang.json"
PROVIDER_RANK = 1000  # the provider's telemetry rank (as trainwise/emulated.py)
POLICY_NAME = "provider_gang"
# Replacements one run may launch before it stops as interrupted (a market that flaps forever).
MAX_REPLACEMENTS = 16
# aws: how long a launched instance may stay pending before the launch counts as failed.
AWS_BOOT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Allocation:
    """What the run holds: `nodes` nodes of one market in one zone ("" = the provider's default
    zone for the run's region)."""

    market: str = ON_DEMAND
    zone: str = ""
    nodes: int = 1
    reason: str = "default: one on-demand node"
    source: str = "default"

    def __post_init__(self) -> None:
        check_market(self.market)
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"allocation nodes={self.nodes!r} must be a whole number >= 1")

    def same_nodes(self, other: Allocation) -> bool:
        return (self.market, self.zone, self.nodes) == (other.market, other.zone, other.nodes)


def write_allocation(run_dir: Path, allocation: Allocation) -> Path:
    """The slow layer's allocation for a live run (atomic); the run applies it at its next fast
    tick (checkpoint, release, launch, resume)."""
    path = Path(run_dir) / ALLOCATION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # An unpredictable temp name: a fixed `.allocation.json.tmp-<pid>` in the shared run folder
    # could be a planted link, written through (issue 31, class 2).
    write_atomic(path, json.dumps({**asdict(allocation), "written_at_s": time.time()},
                                  indent=1).encode("utf-8"))
    return path


def read_allocation(run_dir: Path) -> Allocation | None:
    """The allocation file of a run folder, or None (absent, or unreadable: then it is ignored
    with a warning rather than stopping a training)."""
    path = Path(run_dir) / ALLOCATION_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return Allocation(market=raw["market"], zone=raw.get("zone", ""),
                          nodes=int(raw.get("nodes", 1)), reason=raw.get("reason", ""),
                          source=raw.get("source", "allocation.json"))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:
        import warnings

        warnings.warn(f"{path} ignored ({error}); write it with trainwise.gang.write_allocation",
                      stacklevel=2)
        return None


def allocation_from_action(action: Any, current: Allocation | None) -> Allocation | None:
    """An allocation policy's action (`zone`, `spot_nodes`, `on_demand_nodes`, `reason`) as an
    Allocation; None for "release all" (a training run keeps its nodes: pausing is not applied
    to a live run) or for an action without those fields."""
    spot = getattr(action, "spot_nodes", None)
    on_demand = getattr(action, "on_demand_nodes", None)
    if spot is None or on_demand is None or spot + on_demand < 1:
        return None
    zone = getattr(action, "zone", None) or (current.zone if current else "")
    return Allocation(market=SPOT if spot >= on_demand else ON_DEMAND, zone=zone,
                      nodes=int(spot + on_demand), reason=str(getattr(action, "reason", "")),
                      source="slow_policy")


def read_gang(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / GANG_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None


def provider_for_run(instance_type: str, region: str, name: str | None = None,
                     **options: Any) -> ComputeProvider:
    """The selected provider (TRAINWISE_PROVIDER unless `name`; a provider of one's own is
    registered by naming its module in TRAINWISE_PROVIDER_MODULES), built for a training run by
    its class's `for_run`: emulated over every zone of a real trace folder of the shared data (a
    labelled synthetic stand-in when it is missing), aws in `region` at
    TRAINWISE_EC2_ENDPOINT_URL. `options` are the provider's own (see its `for_run`)."""
    return provider_class(provider_name(name)).for_run(instance_type, region, **options)


def replay_record(provider: ComputeProvider) -> dict[str, Any] | None:
    """Which trace window an emulated provider replays and how fast (gang.json's "replay"), so
    that the slow tick reads the same market as the run (`trainwise.market_view`); None for a
    provider that replays nothing (aws)."""
    markets, clock = getattr(provider, "markets", None), getattr(provider, "clock", None)
    if not markets or clock is None:
        return None
    return {"trace_folder": Path(markets[0].source).parent.name,
            "window_start_tick": int(markets[0].window_start_tick),
            "seconds_per_tick": float(clock.seconds_per_tick)}


@dataclass
class GangSession:
    """The nodes of one training run at one provider; see the module docstring."""

    provider: ComputeProvider
    allocation: Allocation
    instance_type: str
    run_dir: Path
    run_id: str
    region: str = ""
    # The published schedule the run started on (trainwise.schedule); a live switch handed
    # later is read from the run folder at each record.
    schedule_version: str = ""
    nodes: list[NodeHandle] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    reclaims: int = 0
    replacements: int = 0
    fallbacks: list[str] = field(default_factory=list)
    stop_reason: str = ""  # why the loop was asked to stop in the current segment
    failure: str = ""  # why the run could not go on (a replacement that could not be launched)
    # Provider seconds the job trained on booted nodes (segments between boot and stop).
    train_provider_s: float = 0.0
    _segment_start_s: float | None = None
    # The allocation file's content last acted on: a refused spot move that fell back to
    # on-demand is not retried at every tick, only when the slow layer writes a new one.
    _acted_on: Allocation | None = None
    _notice_wall_s: float | None = None
    _last_wall_s: float = 0.0
    _writer: Any = None
    # A gang of processes, one per node (`TorchrunGang`): a stop is handed to this callback
    # (the nodes noticed, [] for the whole gang; the reason) instead of SIGTERM to this process.
    # It returns what it did, recorded with the notice.
    on_stop: Callable[[list[NodeHandle], str], dict[str, Any]] | None = None
    noticed: list[NodeHandle] = field(default_factory=list)  # of the current stop
    # The trainer's last step this session saw (its fast ticks); stamped on the bill events.
    last_step: int = 0
    _meter: Any = None  # telemetry.bill.BillMeter: the bill, as it grows, in the telemetry
    # Where the job's processes ran: "" (this process, or a torchrun gang it started) or
    # "node agents" (trainwise.agent_launch: the agents on the session's nodes). The cost
    # summary names its engine by it.
    runs_on: str = ""
    # The emulated replay paced by the loop's steps (trainwise.replay_pace.StepPacer); None:
    # the provider's fixed speed. The pace is recorded when chosen, so `explain` shows it.
    pacer: Any = None

    # -- set up -----------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if not self.allocation.zone:
            self.allocation = replace(self.allocation, zone=self.default_zone())

    def default_zone(self) -> str:
        """The provider's first zone in the run's region, else its first zone."""
        zones = tuple(getattr(self.provider, "zones", ()) or ())
        if not zones:
            raise ValueError(f"provider {self.provider.name!r} lists no zones: give the zone "
                             "in the allocation")
        return next((z for z in zones if self.region and z.startswith(self.region)), zones[0])

    def start(self) -> list[NodeHandle]:
        """Launch the allocation (its errors propagate: nothing trained yet) and boot it."""
        self._last_wall_s = time.monotonic()
        self._acted_on = self._wanted()
        if self.pacer is not None and not hasattr(self.provider, "advance_to"):
            raise ValueError(f"replay_steps_per_tick={self.pacer.steps_per_tick:g} paces a "
                             f"replayed trace; the provider {self.provider.name!r} replays "
                             "nothing: set replay_steps_per_tick to 0")
        self._launch(self.allocation, "start")
        return self.nodes

    def _launch(self, allocation: Allocation, why: str) -> None:
        self.nodes = self.provider.launch(allocation.zone, self.instance_type, allocation.market,
                                          allocation.nodes)
        self.allocation = allocation
        self._record("launch", f"{why}: {allocation.nodes} x {self.instance_type} "
                     f"{allocation.market} in {allocation.zone} ({allocation.reason})",
                     {"nodes": [n.node_id for n in self.nodes], "market": allocation.market,
                      "zone": allocation.zone, "source": allocation.source})
        self._boot()

    def _boot(self) -> None:
        """The changeover, as real delay: the emulated clock runs through it at replay speed;
        aws is polled until its instances run."""
        provider = self.provider
        if hasattr(provider, "advance_to"):
            changeover_s = provider.rules.changeover_s
            target = provider.now_s() + changeover_s
            time.sleep(min(provider.clock.wall_s(changeover_s), 5.0))
            provider.advance_to(target)
            self._last_wall_s = time.monotonic()
            self._segment_start_s = provider.now_s()
            return
        deadline = time.monotonic() + AWS_BOOT_TIMEOUT_S
        while any(provider.state(n) == NodeState.PENDING for n in self.nodes):
            if time.monotonic() > deadline:
                raise LaunchFailedError(provider.name, self.allocation.zone, self.instance_type,
                                        self.allocation.market, len(self.nodes),
                                        f"still pending after {AWS_BOOT_TIMEOUT_S:.0f} s")
            time.sleep(1.0)
        self._segment_start_s = provider.now_s()

    def _end_segment(self) -> None:
        if self._segment_start_s is not None:
            self.train_provider_s += max(0.0, self.provider.now_s() - self._segment_start_s)
            self._segment_start_s = None

    # -- while training ---------------------------------------------------------------------
    def policy(self, inner: Any) -> _GangFastPolicy:
        """`inner` (the run's fast policy) with this session's check at every fast tick."""
        return _GangFastPolicy(inner, self)

    def check(self) -> None:
        """Move the provider's clock, poll its events and the allocation file; a reclaim notice
        or a new allocation asks the loop to stop (once per segment)."""
        if self.stop_reason:
            return
        provider = self.provider
        now_wall = time.monotonic()
        ours = {n.node_id for n in self.nodes}

        def ours_noticed(events: list[Any]) -> list[Any]:
            return [e for e in events if e.node_id in ours
                    and e.state in (NodeState.NOTICE, NodeState.RECLAIMED)]

        paced = None
        if hasattr(provider, "advance_to") and self.pacer is not None and (
                self.pacer.chosen is None):
            # The clock holds until the loop's own steps give the pace; then it catches up on
            # every wall second since the loop started, at that pace.
            paced = self.pacer.observe(now_wall, self.last_step)
            if paced is None:
                return
            provider.clock.seconds_per_tick = paced.seconds_per_tick
        if hasattr(provider, "advance_to"):
            # Tick by tick, and the clock stops at our notice (it waits while the trainer
            # checkpoints, as trainwise/emulated.py freezes it): seconds trained after a notice
            # are never counted on a node that is gone.
            tick_s = provider.clock.tick_s
            target = provider.now_s() + (now_wall - self._last_wall_s) * (
                provider.clock.emulated_per_wall_s)
            events: list[Any] = []
            while True:
                boundary = (math.floor(provider.now_s() / tick_s + 1e-9) + 1) * tick_s
                events += provider.advance_to(min(target, boundary))
                if ours_noticed(events) or boundary >= target:
                    break
        else:
            events = provider.poll_events()
        self._last_wall_s = now_wall
        if paced is not None:  # after the catch-up: its clock and wall time anchor the speed
            self._record("replay_pace", paced.reason, {
                "seconds_per_tick": paced.seconds_per_tick, "step_s": paced.step_s,
                "steps_per_tick": paced.steps_per_tick, "step": self.last_step})
        self._write_bill()
        notices = ours_noticed(events)
        wanted = self._wanted()
        if notices:
            self.reclaims += 1
            ids = {e.node_id for e in notices}
            self.noticed = [n for n in self.nodes if n.node_id in ids]
            self._stop(f"reclaim: {notices[0].detail or notices[0].state.value} "
                       f"(node {notices[0].node_id})")
        elif (wanted is not None and wanted != self._acted_on
              and not wanted.same_nodes(self.allocation)):
            self._stop(f"allocation: {wanted.nodes} x {wanted.market} in {wanted.zone} "
                       f"({wanted.reason})")

    def node_noticed(self, detail: str) -> None:
        """A reclaim the node heard before the provider reported it (a node agent answered its
        metadata service's notice): counted and recorded as `check` does one it sees."""
        if self.stop_reason:
            return
        self.reclaims += 1
        self._stop(f"reclaim: {detail}")

    def _wanted(self) -> Allocation | None:
        """The allocation file's request, its empty zone read as the zone held now."""
        wanted = read_allocation(self.run_dir)
        if wanted is not None and not wanted.zone:
            wanted = replace(wanted, zone=self.allocation.zone)
        return wanted

    def resume_clock(self) -> None:
        """The provider's clock runs from now: a gang's start-up and restore (before its first
        step) are inside the changeover `_boot` already modelled, not billed twice."""
        self._last_wall_s = time.monotonic()
        if self.pacer is not None:
            self.pacer.restart()

    def _stop(self, reason: str) -> None:
        self._end_segment()
        self.stop_reason = reason
        self._notice_wall_s = time.monotonic()
        if self.on_stop is not None:
            done = self.on_stop(list(self.noticed), reason)
            self._record("notice", f"{reason}: {done.get('what', 'the gang was told')}",
                         {"noticed": [n.node_id for n in self.noticed], "step": self.last_step,
                          **done})
            return
        # The loop in this process is told directly (`training.loop.request_stop`), as a node
        # agent's SIGTERM would tell it: no process signals itself.
        self._record("notice", f"{reason}: stop requested of the training loop in pid "
                     f"{os.getpid()}", {"pid": os.getpid(), "step": self.last_step})
        from training.loop import request_stop  # torch-heavy: loaded with the loop it stops

        request_stop(f"provider notice ({reason[:80]})")

    # -- after a segment --------------------------------------------------------------------
    def replace(self) -> bool:
        """After the loop stopped on our SIGTERM: release, launch the replacement, boot it.
        False (and `failure` set) when no replacement could be launched."""
        reason, self.stop_reason = self.stop_reason, ""
        shutdown_wall_s = time.monotonic() - (self._notice_wall_s or time.monotonic())
        wanted = self.allocation
        if reason.startswith("allocation"):
            wanted = self._wanted() or self.allocation
            self._acted_on = wanted
        for node in self.nodes:
            status = self.provider.describe(node)
            if status.state in (NodeState.NOTICE, NodeState.RECLAIMED) and hasattr(
                    self.provider, "node_down"):
                self.provider.node_down(node, shutdown_wall_s)  # billed until the loop stopped
            else:
                self.provider.terminate(node, "released: " + reason[:60])
        if self._replacements_exhausted():
            return False
        try:
            try:
                self._launch(wanted, f"replacement after {reason[:80]}")
            except LaunchFailedError as refused:
                if wanted.market != SPOT:
                    raise
                fallback = replace(wanted, market=ON_DEMAND, reason=f"fallback: {refused.reason}",
                                   source="fallback")
                self.fallbacks.append(f"spot refused in {wanted.zone} ({refused.reason}): "
                                      "on-demand instead")
                self._launch(fallback, "fallback to on-demand")
        except (ProviderError, ValueError) as error:
            self.failure = (f"replacement launch failed after {reason[:80]}: "
                            f"{type(error).__name__}: {error}")
            self._record("launch_failed", self.failure, {})
            return False
        self.replacements += 1
        return True

    def _replacements_exhausted(self) -> bool:
        """True (and `failure` recorded) when the run already launched the most replacements it
        may (`MAX_REPLACEMENTS`: a market that flaps forever ends the run interrupted)."""
        if self.replacements < MAX_REPLACEMENTS:
            return False
        self.failure = (f"{self.replacements} replacements already launched (the most a run "
                        "may); resume the run later")
        self._record("gave_up", self.failure, {})
        return True

    def replace_noticed(self) -> bool:
        """After a reclaim of some of the gang's nodes (`noticed`): only those are replaced,
        each in its own place in `nodes` (node r stands for rank r), in the allocation's zone
        and market (spot refused: on-demand there, a recorded fallback); the other nodes are
        kept, billed while the gang waits for the replacement's changeover. Any other stop
        (a new allocation, no node named) replaces the whole gang (`replace`). False (and
        `failure` set) when no replacement could be launched."""
        noticed, self.noticed = self.noticed, []
        if not self.stop_reason.startswith("reclaim") or not noticed:
            return self.replace()
        reason, self.stop_reason = self.stop_reason, ""
        shutdown_wall_s = time.monotonic() - (self._notice_wall_s or time.monotonic())
        for node in noticed:
            if hasattr(self.provider, "node_down"):
                self.provider.node_down(node, shutdown_wall_s)  # billed until the gang stopped
            else:
                self.provider.terminate(node, "released: " + reason[:60])
        if self._replacements_exhausted():
            return False
        wanted = self.allocation
        for node in noticed:
            rank = self.nodes.index(node)
            why = f"replacement of node {node.node_id} (rank {rank})"
            try:
                try:
                    [new] = self.provider.launch(wanted.zone, self.instance_type, wanted.market, 1)
                    market, source = wanted.market, wanted.source
                except LaunchFailedError as refused:
                    if wanted.market != SPOT:
                        raise
                    self.fallbacks.append(f"spot refused in {wanted.zone} ({refused.reason}): "
                                          f"on-demand instead for rank {rank}")
                    [new] = self.provider.launch(wanted.zone, self.instance_type, ON_DEMAND, 1)
                    market, source = ON_DEMAND, f"fallback: {refused.reason}"
            except (ProviderError, ValueError) as error:
                self.failure = (f"replacement launch for rank {rank} failed after "
                                f"{reason[:80]}: {type(error).__name__}: {error}")
                self._record("launch_failed", self.failure, {"rank": rank})
                return False
            self.nodes[rank] = new
            self._record("launch", f"{why}: 1 x {self.instance_type} {market} in {wanted.zone}",
                         {"nodes": [new.node_id], "replaces": node.node_id, "rank": rank,
                          "market": market, "zone": wanted.zone, "source": source,
                          "why": reason})
        self._boot()
        self.replacements += 1
        return True

    def note(self, event: str, reason: str, **detail: Any) -> None:
        """Record something the caller did for the gang (a restore from the store)."""
        self._record(event, reason, detail)

    def close(self, reason: str) -> dict[str, Any]:
        """Release every node still held; write and return the record (`gang.json`)."""
        if self.pacer is not None and self.pacer.chosen is None:
            # Said where a user looks: the bill holds only the boot, not the steps.
            self._record("replay_pace", "replay pace not chosen: the run ended before its "
                         "second fast tick, so the provider's clock held at the end of the boot "
                         "(fewer steps than two fast_every_steps, or a stop before them)", {})
        self._end_segment()
        for node in self.nodes:
            if self.provider.describe(node).state.alive:
                self.provider.terminate(node, reason)
        record = self.record()
        self._write_record(record)
        self._write_bill(final=True, bill_usd=record["cost_usd"])
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return record

    # -- figures ----------------------------------------------------------------------------
    def spot_share(self) -> float:
        """Share of billed node-seconds on spot."""
        now = self.provider.now_s()
        spot = total = 0.0
        for node in self.provider.nodes():
            status = self.provider.describe(node)
            end = status.ended_at_s if status.ended_at_s is not None else now
            if status.state.alive:
                end = now
            seconds = max(0.0, end - status.launched_at_s)
            total += seconds
            spot += seconds if node.market == SPOT else 0.0
        return spot / total if total else 0.0

    def fixed_schedule(self) -> tuple[float, float]:
        """(USD of the fixed schedule, preemption waste in node-seconds). The fixed schedule:
        the same nodes on demand for one changeover plus the provider seconds this job trained,
        never interrupted. Waste: billed node-seconds beyond that (replacement changeovers,
        shutdowns after notices, nodes stopping)."""
        rules = getattr(self.provider, "rules", None)
        changeover_s = float(getattr(rules, "changeover_s", 0.0))
        nodes = self.allocation.nodes
        needed_s = nodes * (changeover_s + self.train_provider_s)
        try:
            # The provider's own price (a replayed trace's, another cloud's list), the one its
            # bill uses: the saving compares two bills in the same prices.
            on_demand = self.provider.price_usd_per_hour(self.instance_type,
                                                         self.allocation.zone, ON_DEMAND)
        except (ProviderError, ValueError):
            on_demand = math.nan
        now = self.provider.now_s()
        billed_s = 0.0
        for node in self.provider.nodes():
            status = self.provider.describe(node)
            end = now if status.state.alive or status.ended_at_s is None else status.ended_at_s
            billed_s += max(0.0, end - status.launched_at_s)
        return on_demand * needed_s / 3600.0, max(0.0, billed_s - needed_s)

    def record(self) -> dict[str, Any]:
        bill = self.provider.bill_usd()
        fixed_usd, waste_s = self.fixed_schedule()
        return {
            "provider": self.provider.name, "instance_type": self.instance_type,
            "market": self.allocation.market, "zone": self.allocation.zone,
            "nodes": len(self.nodes), "allocation": asdict(self.allocation),
            "cost_usd": bill if math.isfinite(bill) else None, "spot_share": self.spot_share(),
            "reclaims": self.reclaims, "replacements": self.replacements,
            "train_provider_s": self.train_provider_s,
            "fixed_on_demand_usd": fixed_usd if math.isfinite(fixed_usd) else None,
            "preemption_waste_node_s": waste_s, "provider_now_s": self.provider.now_s(),
            "fallbacks": self.fallbacks, "failure": self.failure,
            "launched": [asdict(n) for n in self.provider.nodes()],
            "history": self.history, "replay": replay_record(self.provider),
            "replay_pace": ("" if self.pacer is None else self.pacer.chosen.reason
                            if self.pacer.chosen is not None else "not chosen yet (it is "
                            "chosen at the loop's second fast tick)"),
            "runs_on": self.runs_on or "this process",
            # A torchrun gang (on_stop set by TorchrunGang): rank r runs on node r; else the one
            # process trains for all nodes.
            "world_size": len(self.nodes) if self.on_stop is not None else 1,
            "ranks": ([{"rank": r, "node_id": n.node_id, "market": n.market, "zone": n.zone}
                       for r, n in enumerate(self.nodes)] if self.on_stop is not None else []),
        }

    def _write_record(self, record: dict[str, Any]) -> None:
        path = self.run_dir / GANG_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, indent=1, default=str).encode("utf-8"))

    def _record(self, event: str, reason: str, detail: dict[str, Any]) -> None:
        entry = {"event": event, "reason": reason, "provider_time_s": self.provider.now_s(),
                 "wall_time_s": time.time(), **detail}
        self.history.append(entry)
        self._write_record(self.record())
        from telemetry.events import DecisionEvent
        from trainwise.schedule import run_schedule_version

        self._telemetry().write(DecisionEvent(
            run_id=self.run_id, rank=PROVIDER_RANK, step=0, layer="slow", policy=POLICY_NAME,
            action={k: v for k, v in entry.items() if k not in ("reason", "wall_time_s")},
            reason=reason, numbers={"provider_time_s": float(self.provider.now_s()),
                                    "reclaims": float(self.reclaims)},
            observation={},
            schedule_version=run_schedule_version(self.run_dir) or self.schedule_version))


    def _telemetry(self) -> Any:
        """The provider rank's telemetry writer, opened on first use."""
        from telemetry.writer import SegmentWriter

        if self._writer is None:
            self._writer = SegmentWriter(self.run_dir / "telemetry", self.run_id,
                                         rank=PROVIDER_RANK)
        return self._writer

    def _write_bill(self, *, final: bool = False, bill_usd: float | None = None) -> None:
        """The bill so far into the telemetry (`telemetry.bill`): what MLflow, Prometheus and
        the plot show as the run's cost. At most once a second while it moves; always at close."""
        from telemetry.bill import BillMeter

        if self._meter is None:
            self._meter = BillMeter(self.run_id, self.provider.name, PROVIDER_RANK)
        if not self._meter.due(final):
            return
        if bill_usd is None:
            bill_usd = self.provider.bill_usd()
        event = self._meter.event(
            step=self.last_step, bill_usd=math.nan if bill_usd is None else float(bill_usd),
            provider_time_s=self.provider.now_s(), spot_share=self.spot_share(),
            nodes_held=0 if final else len(self.nodes), final=final)
        if event is not None:
            self._telemetry().write(event)


class _GangFastPolicy:
    """The run's fast policy, unchanged, with the session's provider check at each fast tick."""

    def __init__(self, inner: Any, session: GangSession) -> None:
        self.inner, self.session = inner, session
        self.name = getattr(inner, "name", type(inner).__name__)

    def act(self, observation: Any) -> Any:
        self.session.last_step = int(observation.step)
        if observation.preemption_notice_s is None:
            self.session.check()
        return self.inner.act(observation)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


__all__ = ["ALLOCATION_FILE", "Allocation", "GANG_FILE", "GangSession",
           "allocation_from_action", "provider_for_run", "read_allocation", "read_gang",
           "write_allocation"]
