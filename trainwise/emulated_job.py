"""The emulated cloud's provider state while a job runs (`trainwise/emulated.py` drives it): the
held set and its bills, the replay clock (when it runs, when it is frozen), each tick's reclaims
and the allocation policy's action. The trainer processes' side is `trainwise/emulated_trainer.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloud import emulated as replay
from cloud.providers.base import LaunchFailedError, NodeHandle
from cloud.providers.emulated import EmulatedProvider
from telemetry.events import DecisionEvent
from telemetry.writer import SegmentWriter
from trainwise.emulated_trainer import (
    PROVIDER_POLICY,
    PROVIDER_RANK,
    _set_label,
    _Trainer,
    _TrainerProcesses,
)


@dataclass
class _Emulation(_TrainerProcesses):
    """The provider's state while a job runs; `run_emulated` drives it."""

    markets: list[replay.ReplayMarket]  # one per zone; the first is the home zone
    rules: Any
    clock: replay.ReplayClock
    provider: EmulatedProvider  # launches, notices, terminations and the bill go through it
    policy: Any
    writer: SegmentWriter
    run_id: str
    run_dir: Path
    shards_dir: Path
    train_config: dict[str, Any]
    max_steps: int
    work_total_s: float  # emulated seconds of training the whole job takes on the full gang
    deadline_s: float
    notice_wall_s: float
    node_count: int = 1  # the gang's size: every held set is exactly this many nodes
    trainer_ignores_notice: bool = False
    fast_policy: str | None = None  # written into each trainer's job JSON (the fast layer)
    freeze_after_last_step: bool = False  # see run_emulated
    last_step_s: float | None = None  # when the last step was seen (freeze_after_last_step)
    # Object store mode: trainers upload each checkpoint; a stopped node's disk is lost and its
    # replacement restores from the store (`restore_from_store`).
    store_dir: Path | None = None
    store_key_prefix: str = ""
    # More keys of each trainer's job file (`trainwise.emulated_worker`: curriculum, region).
    job_extra: dict[str, Any] = field(default_factory=dict)
    # None: the built-in trainer (`trainwise.emulated_worker`). Else a user's job in its place
    # (`trainwise.user_job_supervised.UserJobWorkload`): `child(job, index, result_path)` gives
    # the spawn's command, env and cwd; `collect(job, trainer, exit_code)` writes the exited
    # child's result file in the worker's keys (status, steps, checkpoint_path, ...).
    workload: Any = None
    last_result: dict[str, Any] | None = None  # the newest trainer's result record
    uploaded: list[str] = field(default_factory=list)  # every trainer's uploaded URIs
    upload_failed: list[tuple[str, str]] = field(default_factory=list)
    nodes: list[NodeHandle] = field(default_factory=list)  # the set held (or last held)
    last_zone: str | None = None  # the zone of the last launch (the simulator's last_zone)
    trainer: _Trainer | None = None
    pending_launch: bool = False
    preemption_times: tuple[float, ...] = ()
    launch_failed: bool = False
    launches: int = 0
    resumes: int = 0
    notices_missed: int = 0
    steps: int = 0
    checkpoint_step: int = 0
    checkpoint_path: str | None = None
    checkpoint_time_s: float = 0.0
    finish_s: float | None = None
    final_eval_loss: float | None = None
    pids: list[int] = field(default_factory=list)
    # (spawn wall time, USD/h of the set the trainer ran on) per trainer, in start order.
    spawns: list[tuple[float, float]] = field(default_factory=list)
    meter: Any = None  # telemetry.bill.BillMeter, opened by write_bill

    @property
    def market(self) -> replay.ReplayMarket:
        """The home zone's market (the first zone file)."""
        return self.markets[0]

    def market_of(self, zone: str) -> replay.ReplayMarket:
        return next(m for m in self.markets if m.zone == zone)

    @property
    def work_total_h(self) -> float:
        """The job's work in GPU-hours at the reference throughput: the gang's N nodes work
        `work_total_s` together (the simulator's `work_gpu_h` at rate node_count)."""
        return self.node_count * self.work_total_s / 3600.0

    @property
    def step_s(self) -> float:
        """Emulated seconds one training step stands for (the work model of the module doc)."""
        return self.work_total_s / self.max_steps

    @property
    def holdings(self) -> list[replay.Holding]:
        return self.provider.holdings

    @property
    def gang(self) -> list[NodeHandle]:
        """The nodes the job holds now (bills still open)."""
        return [n for n in self.nodes if self.provider.holding(n).end_s is None]

    @property
    def held(self) -> replay.HeldSet | None:
        """The set held now: zone, spot and on-demand counts, launch time."""
        gang = self.gang
        if not gang:
            return None
        spot = sum(n.market == replay.SPOT for n in gang)
        return replay.HeldSet(gang[0].zone, spot, len(gang) - spot,
                              self.provider.holding(gang[0]).launch_s)

    @property
    def holding(self) -> replay.Holding | None:
        """The first node of the set held now (its bill still open), as the provider bills it."""
        gang = self.gang
        return self.provider.holding(gang[0]) if gang else None

    @property
    def telemetry_dir(self) -> Path:
        return self.run_dir / "telemetry" / self.run_id

    # -- telemetry --------------------------------------------------------------------------
    def record(self, policy: str, action: dict[str, Any], reason: str,
               numbers: dict[str, float], observation: dict[str, Any] | None = None) -> None:
        self.writer.write(DecisionEvent(
            run_id=self.run_id, rank=PROVIDER_RANK, step=self.steps, layer="slow", policy=policy,
            action=action, reason=reason, numbers=numbers, observation=observation or {},
            # The schedule the trainer started on (its config names it; "" for a benchmark).
            schedule_version=str(self.train_config.get("schedule_version") or "")))

    def write_bill(self, final: bool = False) -> None:
        """The provider's bill so far into the telemetry (`telemetry.bill`): what MLflow,
        Prometheus and the plot show as the run's cost; the final one is the result's bill."""
        from telemetry.bill import BillMeter

        if self.meter is None:
            self.meter = BillMeter(self.run_id, self.provider.name, PROVIDER_RANK)
        if not self.meter.due(final):
            return
        event = self.meter.event(
            step=self.steps, bill_usd=replay.bill_usd(self.holdings, self.clock.now_s),
            provider_time_s=self.clock.now_s,
            spot_share=replay.spot_share(self.holdings, self.clock.now_s),
            nodes_held=0 if final else len(self.gang), final=final)
        if event is not None:
            self.writer.write(event)

    def end_holding(self, reason: str) -> None:
        """The job lets its nodes go now (the provider closes their bills, `terminate`)."""
        for node in self.gang:
            self.provider.terminate(node, reason)

    # -- the tick ---------------------------------------------------------------------------
    def on_tick(self, tick: int) -> None:
        zones = tuple(m.zone for m in self.markets)
        available = tuple(m.available_at(tick) for m in self.markets)
        # The provider applies the trace: a spot node over its zone's capacity gets its notice
        # (its bill closes provisionally now, moved to when it is down).
        noticed_now = self.provider.on_tick(tick)
        noticed = [n for n in self.nodes if n in noticed_now]
        if noticed and self.steps >= self.max_steps:
            # Reclaimed while the trainer writes its final eval and checkpoint: the loop has left
            # its step loop and ignores the notice, so this interrupts nothing. The node is
            # billed until that trainer exits (at most the notice).
            for node in noticed:
                self.provider.holding(node).end_reason = "reclaimed after the last step"
            # A gang's other nodes go with it (the policy never sees a partial gang).
            self.end_holding("gang released: a rank was reclaimed after the last step")
            if self.trainer is not None:
                self.note_notice(self.trainer)  # billed until its trainer exits (or the notice)
            self.record(PROVIDER_POLICY, {"event": "reclaimed_after_work"},
                        "spot reclaimed after the last step: not an interruption",
                        {"time_s": self.clock.now_s, "steps_done": float(self.steps)})
        elif noticed:
            zone = noticed[0].zone
            # A synchronous gang cannot run short of a rank: the rest of the set is released
            # with the reclaimed node(s), as the simulator releases the whole gang.
            self.end_holding("gang released: a rank was reclaimed")
            self.preemption_times += (self.clock.now_s,)
            pid = self.trainer.process.pid if self.trainer else None
            self.record(PROVIDER_POLICY, {"event": "preemption", "pid": pid, "signal": "SIGTERM",
                                          "zone": zone, "nodes_reclaimed": len(noticed)},
                        f"spot reclaimed in {zone} ({len(noticed)} of {len(self.nodes)} node(s)) "
                        f"at trace tick {self.market_of(zone).window_start_tick + tick}: "
                        f"SIGTERM to trainer pid {pid}",
                        {"time_s": self.clock.now_s,
                         "spot_available": float(available[zones.index(zone)]),
                         "steps_done": float(self.steps),
                         "notice_wall_s": self.notice_wall_s})
            self.pending_launch = False
            self.stop_trainer("preemption")
        if self.finish_s is not None:
            return
        held = self.held
        observation = replay.build_gang_observation(
            markets=self.markets, node_count=self.node_count, rules=self.rules, clock=self.clock,
            work_done_h=self.steps / self.max_steps * self.work_total_h,
            work_checkpointed_h=self.checkpoint_step / self.max_steps * self.work_total_h,
            work_total_h=self.work_total_h, deadline_s=self.deadline_s, held=held,
            last_zone=self.last_zone,
            since_checkpoint_s=self.clock.now_s - self.checkpoint_time_s,
            preemption_times_s=self.preemption_times, launch_failed=self.launch_failed)
        action = self.policy.act(observation)
        self.launch_failed = False
        applied = self.apply(action, held, tick)
        shown = held.zone if held else (action.zone or self.market.zone)
        self.record(
            getattr(self.policy, "name", type(self.policy).__name__),
            {"zone": action.zone, "spot_nodes": action.spot_nodes,
             "on_demand_nodes": action.on_demand_nodes, "applied": applied, "tick": tick},
            action.reason, {**{k: float(v) for k, v in action.numbers.items()},
                            "time_s": self.clock.now_s,
                            "spot_available": float(available[zones.index(shown)]
                                                    if shown in zones else available[0]),
                            "work_done_h": observation.work_done_h},
            {"time_s": observation.time_s, "deadline_s": observation.deadline_s,
             "work_done_h": observation.work_done_h, "work_total_h": observation.work_total_h,
             "spot_available": available[0], "spot_available_by_zone": list(available),
             "zones": list(zones), "held": _set_label(held),
             "held_zone": held.zone if held else None})

    def apply(self, action: Any, held: replay.HeldSet | None, tick: int) -> str:
        """The simulator's step 4: asking for the set held keeps it; any other set (zone, spot,
        on-demand) is a changeover: launch (spot only if the zone's trace has that many spot
        nodes this tick, else the launch fails and the held set is kept), then the old set is
        released and its trainer checkpoints and stops; a new trainer resumes on the new set."""
        want_spot, want_od = action.spot_nodes, action.on_demand_nodes
        want_total = want_spot + want_od
        name = getattr(self.policy, "name", type(self.policy).__name__)
        if want_spot < 0 or want_od < 0 or (want_total and want_total != self.node_count):
            raise ValueError(
                f"policy {name!r} asked for {want_spot} spot + {want_od} on-demand nodes at "
                f"t={self.clock.now_s:.0f} s; a gang job needs 0 or exactly "
                f"node_count={self.node_count} nodes")
        if want_total == 0:
            if held is None:
                return "keep"
            self.end_holding("released")
            self.stop_trainer("release")
            return "release"
        zones = [m.zone for m in self.markets]
        zone = action.zone if action.zone is not None or len(zones) > 1 else zones[0]
        if zone not in zones:
            raise ValueError(f"policy {name!r} asked for zone {action.zone!r}; this run replays "
                             f"{', '.join(zones)} (pass zone_files to add zones)")
        if held is not None and (held.zone, held.spot_nodes, held.on_demand_nodes) == (
                zone, want_spot, want_od):
            return "keep"
        market = self.market_of(zone)
        if want_spot > market.available_at(tick):  # the simulator's rule (held nodes count)
            self.launch_failed = True
            return "launch_failed"
        old = self.gang
        move = f"{want_spot} spot + {want_od} on_demand in {zone}"
        for node in old:  # released first, so their spot capacity is free for the new set
            self.provider.terminate(node, f"switched to {move}")
        try:
            nodes = []
            if want_spot:
                nodes += self.provider.launch(zone, market.instance_type, replay.SPOT, want_spot)
            if want_od:
                nodes += self.provider.launch(zone, market.instance_type, replay.ON_DEMAND,
                                              want_od)
        except LaunchFailedError:  # cannot happen after the check above; kept for safety
            self.launch_failed = True
            if old:
                self.stop_trainer(f"switch to {move} (launch failed)")
            return "launch_failed"
        if old:
            self.stop_trainer(f"switch to {move}")
        self.nodes, self.last_zone = nodes, zone
        self.launches += 1
        self.pending_launch = True
        return f"launch {move}"

    def advance(self, target_s: float) -> None:
        """Move the clock, handling each tick; stop (freeze) when a process boots or stops."""
        for tick in self.clock.advance_to(self.capped(target_s)):
            self.on_tick(tick)
            if self.frozen or self.finishing_step:
                return

    def boot_jump_s(self, trainer: _Trainer, now_wall_s: float) -> float:
        """Emulated seconds the clock moves when a trainer is seen booted (its first step): the
        changeover, plus the wall time since its `run_start` at replay speed, so that its first
        step(s) are on the clock like every later one (the simulator trains from the end of the
        changeover). Without the second term that step was free: about one step a launch."""
        since_loop_s = (max(0.0, now_wall_s - trainer.loop_start_wall_s)
                        if trainer.loop_start_wall_s is not None else 0.0)
        return self.rules.changeover_s + since_loop_s * self.clock.emulated_per_wall_s

    @property
    def finishing_step(self) -> bool:
        """A booted trainer told to stop still runs its step in flight (it has not written its
        `preemption`/`run_end` event): that is training, so the clock runs (`capped`)."""
        trainer = self.trainer
        return (trainer is not None and trainer.ready and trainer.stop_clock_s is not None
                and not trainer.left_loop and self.last_step_s is None)

    def capped(self, target_s: float) -> float:
        """While a stopping trainer finishes its step in flight, the clock runs at most to the
        next tick boundary and at most `notice_s` past the notice (a trainer that ignores the
        notice trains on until it is killed; that work is lost, not timed)."""
        trainer = self.trainer
        if not self.finishing_step or trainer is None or trainer.stop_clock_s is None:
            return target_s
        limit = min(self.clock.next_tick * self.clock.tick_s,
                    trainer.stop_clock_s + self.rules.notice_s) - 1e-6
        return max(self.clock.now_s, min(target_s, limit))

    @property
    def frozen(self) -> bool:
        """The clock waits while a trainer boots or shuts down, or a launch waits for it (and,
        with `freeze_after_last_step`, from the last step until the trainer exits). It runs
        while a trainer told to stop finishes its step in flight (`finishing_step`): the step
        is work on the clock, as every step (frozen, it was free: measured about half a step
        a notice); its save and exit are this machine's seconds (frozen, billed as a
        shutdown)."""
        if self.finishing_step:
            return False
        trainer = self.trainer
        return self.pending_launch or (trainer is not None and (
            not trainer.ready or trainer.kill_at_monotonic is not None
            or self.last_step_s is not None))
