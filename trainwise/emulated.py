"""The `emulated` way to run the cloud: real trainer processes, a real spot trace replayed fast.

`run_emulated` trains one job on this machine as if on one cloud node (or an N-node gang, in one
of several zones) of the trace's instance type (p3.2xlarge for the V100 traces). The pure parts
(replay clock, market window, billing rule, observations) are in `cloud/emulated.py`; launches,
notices, terminations and the bill go through the `emulated` provider
(`cloud/providers/emulated.py`, the `ComputeProvider` interface); this module runs the trainer
processes, freezes the clock while they boot or stop, and writes telemetry. `restore_from_store`
(end of the file) is how a replacement node, whose disk is new, gets the run's newest committed
checkpoint from the object store.

When the clock runs (the same rule as the simulator's, "a step of training is time"): every
training step is on the clock, the others are this machine's seconds and frozen.
- Boot: frozen from the launch until the trainer's first step (by then its SIGTERM handler is in
  place), then the clock jumps the changeover plus the wall time since its `run_start` (restored,
  entering its step loop) at replay speed (`boot_jump_s`): its first step is on the clock, with
  the process's first-step warm-up, a per-launch cost that `benchmarks/fidelity_calibrate.py`
  measures and adds to the simulator's changeover. (Until wave 5 the clock waited for the first
  step and jumped the changeover only: that step was free. With the scored runs' own step
  speeds the simulator then predicted 0.8-1.3 steps more than measured for 1 launch, 1.7-3.1
  for 2, 2.8-5.2 for 3: one step a launch plus about half a step a notice, below.)
- Stop (reclaim notice, release, move): the trainer finishes its step in flight on the clock
  (`finishing_step`; at most to the next tick boundary and `notice_s` past the notice), then the
  clock is frozen from its `preemption`/`run_end` event through its save and exit, billed as a
  shutdown (below). (Frozen at the notice, the step in flight was free: about half a step a
  notice.)
- The allocation policy's `act` runs on the wall clock between polls, but takes under a
  millisecond a tick (0.5 ms mean, 3.7 ms worst, 18 calls in a 60-step multi-zone run over 9
  zones, measured), so it neither delays nor slows training here.

Event sequence (a typical run, the 2023-02 us-east-1a trace):
tick 0: policy -> spot (launch; trainer process boots, clock frozen; changeover 360 s billed)
-> tick 4: spot gone -> SIGTERM to the trainer's pid -> it checkpoints ("preemption") and exits
-> policy: wait, or on-demand -> launch -> a new process resumes from that checkpoint -> ... ->
max_steps done: the node is released, the bill closed.

1. Each tick boundary: a preemption first (the node held is spot and the trace says none is
   available): SIGTERM, then SIGKILL if the process is still alive after the notice
   (`notice_s` at the replay speed, but at least `min_notice_wall_s` of wall time because process
   scheduling on a shared machine is not that fast). Then the allocation policy (by name,
   `cloud.policy_registry.make_policy`) sees an `AllocationObservation` and its action is
   applied: keep, release, or launch (spot only if the trace has it this tick).
2. Work is training steps: `work_done_h = steps / max_steps * work_total_h`, where
   `work_total_h` is the emulated time `max_steps` steps take at `step_wall_s_estimate` wall
   seconds a step; the deadline is `deadline_factor * (work + one changeover)`.
3. Billing (`cloud/emulated.py`): a node is billed from its launch until it is down: the end of
   training, or after a notice/release, its trainer's exit or the end of the notice, whichever
   first. Steps a resumed trainer re-runs (the killed one had recorded them after its last
   checkpoint) are reported as preemption waste (`replayed_steps`, `preemption_waste_s`,
   `preemption_waste_usd`), apart from the useful training seconds (`useful_train_s`).
   With `freeze_after_last_step` the clock stops at the last step (the completion, as the
   simulator's finish) while the trainer writes its final eval and checkpoint and exits (this
   machine's seconds, as a boot), and the set is billed for that as for a shutdown: wall seconds
   at replay speed, at most the notice. `benchmarks/fidelity.py` uses it.
4. Zones (`zone_files`): one `ReplayMarket` per zone file of the trace folder, same window, same
   instance type, the first the home zone. The policy sees every zone's availability and prices
   (`cloud.emulated.build_gang_observation`, built as `cloud.simulator.simulate` builds it);
   the action's zone is applied: a set in another zone is a changeover like a spot/on-demand
   switch (the old set released, its trainer checkpoints and stops, a new trainer resumes on the
   new set after the changeover); a reclaim follows the held zone's availability; each node is
   billed at its own zone's price. The result names the zones held (`zones_held`).
5. Gang (`nodes=N`), the simulator's gang rules: every held set is exactly N nodes in one zone
   (spot and on-demand may mix), launched through the provider as N nodes each billed per
   node-second at its price; a spot launch needs that many spot nodes in the zone's trace this
   tick; a reclaim of any one node releases the whole set (a synchronous gang cannot run short
   of a rank) and the policy chooses the next set. Work is in GPU-hours at N reference GPUs.
   HONEST LIMIT: the gang's ranks are ONE trainer process here, standing for the gang's work at
   the full gang's rate (progress needs all N nodes; a reclaim SIGTERMs that process, which
   checkpoints). Real multi-rank training is `trainwise/gang.py`'s `TorchrunGang`, which is not
   policy-driven (it replaces a lost node in place).
6. Every decision, preemption, launch/resume and the end go to the run's telemetry as decision
   events (layer "slow", policy = the allocation policy's name or "emulated_cloud"), written by
   the provider under rank `PROVIDER_RANK` (the trainer writes rank 0), so `trainwise explain`
   shows them in time order with the trainer's own checkpoints and preemption notices.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cloud import emulated as replay
from cloud.policy_registry import make_policy
from cloud.providers.base import LaunchFailedError, NodeHandle
from cloud.providers.emulated import EmulatedProvider
from cloud.traces import FOLDER_MEANING
from telemetry.events import DecisionEvent
from telemetry.reader import read_run_events
from telemetry.writer import SegmentWriter
from trainwise import settings

# The provider's telemetry rank: not a training rank (those count from 0), one writer per rank.
PROVIDER_RANK = 1000
PROVIDER_POLICY = "emulated_cloud"
DEFAULT_TRACE_FOLDER = "availability-1node-aws-2023-02"
DEFAULT_ZONE_FILE = "us-east-1a_v100_1.json"


@dataclass(frozen=True)
class EmulatedResult:
    status: str  # "completed", or "deadline_exceeded_wall" when max_wall_s ran out
    run_id: str
    run_dir: Path
    steps: int
    max_steps: int
    preemptions: int
    resumes: int  # trainer processes started from a checkpoint
    launches: int
    notices_missed: int  # trainers SIGKILLed after the notice (work since the checkpoint lost)
    spot_share: float
    cost_usd: float
    spot_node_s: float
    on_demand_node_s: float
    deadline_s: float
    finish_s: float | None  # emulated seconds since job start
    final_eval_loss: float | None
    wall_s: float
    policy: str
    trace_source: str
    zone: str
    instance_type: str
    window_start_tick: int
    seconds_per_tick: float
    spot_usd_per_hour: float
    on_demand_usd_per_hour: float
    holdings: tuple[dict[str, Any], ...]
    trainer_pids: tuple[int, ...]
    # Steps re-run after resumes and what they cost (billed, but not progress; see module doc).
    replayed_steps: int = 0
    preemption_waste_s: float = 0.0
    preemption_waste_usd: float = 0.0
    # Emulated seconds of first-time training steps (steps x the seconds a step stands for).
    useful_train_s: float = 0.0
    # Billed node seconds after a notice/release, until the node was down (shutdowns, kills).
    stopping_node_s: float = 0.0
    zones: tuple[str, ...] = ()  # the zones replayed (the first is `zone`, the home zone)
    zones_held: tuple[str, ...] = ()  # zones the job launched nodes in, in first-launch order
    node_count: int = 1  # the gang's size
    node_launches: int = 0  # provider nodes launched (a gang launch is node_count of them)

    @property
    def deadline_met(self) -> bool:
        return self.finish_s is not None and self.finish_s <= self.deadline_s


def risk_model_kwargs(policy_name: str, market: replay.ReplayMarket, trace_folder: str,
                      spot_dir: Path) -> dict[str, Any]:
    """trainwise_heuristic's hazard model, fitted as the cost suite does: the market's own folder
    and node shape before the window start only, the other trace folders as the prior."""
    if policy_name != "trainwise_heuristic":
        return {}
    from cloud.risk_fit import AvailabilityHistory, fit_risk_model, folder_histories

    if market.synthetic:
        empty = AvailabilityHistory("synthetic", (market.zone,), float(market.tick_s),
                                    market.available[None, :0], 1)
        return {"risk_model": fit_risk_model(empty, 0)}
    shape = Path(market.source).stem.split("_", 1)[1]
    target = next(h for h in folder_histories(trace_folder, str(spot_dir))
                  if h.name.endswith(f"/{shape}"))
    prior = [h for folder in FOLDER_MEANING if folder != trace_folder
             and (spot_dir / folder).is_dir() for h in folder_histories(folder, str(spot_dir))]
    return {"risk_model": fit_risk_model(target, market.window_start_tick, prior)}


@dataclass
class _Trainer:
    """One trainer process (one emulated node's life)."""

    process: subprocess.Popen
    spawn_wall_s: float
    result_path: Path
    resumed_from: str | None
    # The nodes it runs on (one, or a gang's N) at the provider, and their bills (each billed
    # until it is down).
    nodes: tuple[NodeHandle, ...] = ()
    holdings: tuple[replay.Holding, ...] = ()
    ready: bool = False
    stop_reason: str = ""
    notice_monotonic: float | None = None
    kill_at_monotonic: float | None = None
    # Told to stop (SIGTERM) at this wall time (time.time(), as telemetry) and at this clock
    # time; `left_loop`: it has since left its step loop (its `preemption` or `run_end` event).
    stop_wall_s: float | None = None
    stop_clock_s: float | None = None
    left_loop: bool = False
    loop_start_wall_s: float | None = None  # its `run_start` (restored), time.time()
    killed: bool = False


@dataclass
class _Emulation:
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
            action=action, reason=reason, numbers=numbers, observation=observation or {}))

    def read_progress(self) -> None:
        """Steps done and the last checkpoint, from the trainer's rank-0 telemetry."""
        if not (self.telemetry_dir / "rank0").is_dir():
            return
        for event in read_run_events(self.telemetry_dir, rank=0):
            kind = event["type"]
            if kind == "run_start":
                # Restored, entering its step loop: from here its time is training time
                # (`boot_jump_s`), though the clock waits for its first step (then its SIGTERM
                # handler is in place, so a notice checkpoints instead of killing it).
                if self.trainer is not None and event["wall_time_s"] >= self.trainer.spawn_wall_s:
                    self.trainer.loop_start_wall_s = event["wall_time_s"]
            elif kind == "step":
                self.steps = max(self.steps, int(event["step"]))
                if self.trainer is not None and event["wall_time_s"] >= self.trainer.spawn_wall_s:
                    self.trainer.ready = True
            elif kind == "checkpoint" and int(event["step"]) >= self.checkpoint_step:
                if self.checkpoint_path != event["path"]:
                    self.checkpoint_time_s = self.clock.now_s
                self.checkpoint_step, self.checkpoint_path = int(event["step"]), event["path"]
            elif kind == "eval":
                self.final_eval_loss = event["eval_loss"]
            if (kind in ("preemption", "run_end") and self.trainer is not None
                    and self.trainer.stop_wall_s is not None
                    and event["wall_time_s"] >= self.trainer.stop_wall_s):
                self.trainer.left_loop = True
        trainer = self.trainer
        if (self.freeze_after_last_step and self.steps >= self.max_steps and trainer is not None
                and trainer.ready and self.last_step_s is None):
            # The last step is done: the final eval, checkpoint and exit run on this machine's
            # seconds with the clock frozen (as a boot), and the set is billed for them as for a
            # shutdown: until the trainer exits at replay speed, at most the notice.
            self.last_step_s = self.clock.now_s
            self.note_notice(trainer)

    # -- processes --------------------------------------------------------------------------
    def trainer_risk(self) -> float | None:
        """The preemption risk a new trainer's fast layer starts with (None without a fast
        layer): the train job's rule (`trainwise.slow_tick.preemption_risk`: reclaims seen so far
        over the time observed, half a reclaim while none is seen, 0 on on-demand only), on the
        trainer's clock. Trainers run at replay speed, so the observed time is the clock's
        emulated seconds in this machine's seconds (`ReplayClock.wall_s`): the hazard per wall
        second is the trace's, times `emulated_per_wall_s`, as the trainer lives it. Each
        replacement trainer gets the risk with every reclaim so far counted."""
        if self.fast_policy is None:
            return None
        from trainwise.slow_tick import preemption_risk

        held = self.held
        return preemption_risk(len(self.preemption_times), self.clock.wall_s(self.clock.now_s),
                               held.spot_nodes if held is not None else 0)

    def spawn(self) -> None:
        """Start a trainer process, resuming from the newest checkpoint when there is one."""
        index = len(self.pids)
        folder = self.run_dir / "emulated"
        folder.mkdir(parents=True, exist_ok=True)
        resume_from = self.checkpoint_path
        if self.store_dir is not None and resume_from is not None:
            from trainwise.emulated_worker import RESUME_FROM_STORE

            resume_from = RESUME_FROM_STORE  # the new node's disk is empty: the store has it
        job = {"shards_dir": str(self.shards_dir), "run_dir": str(self.run_dir),
               "result_path": str(folder / f"result-{index:03d}.json"),
               "resume_from": resume_from, "train_config": self.train_config,
               "block_sigterm": self.trainer_ignores_notice,
               "store_dir": str(self.store_dir) if self.store_dir is not None else None,
               "store_key_prefix": self.store_key_prefix, "fast_policy": self.fast_policy}
        risk = self.trainer_risk()
        if risk is not None:
            job["preemption_risk"] = risk
        job_path = folder / f"job-{index:03d}.json"
        job_path.write_text(json.dumps(job, indent=1))
        log = open(folder / f"worker-{index:03d}.log", "w")  # noqa: SIM115 (child owns it)
        process = subprocess.Popen(
            [sys.executable, "-m", "trainwise.emulated_worker", str(job_path)],
            cwd=settings.PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        gang = self.gang
        holdings = tuple(self.provider.holding(n) for n in gang)
        self.trainer = _Trainer(process, time.time(), Path(job["result_path"]),
                                self.checkpoint_path, nodes=tuple(gang), holdings=holdings)
        self.pids.append(process.pid)
        if self.checkpoint_path is not None:
            self.resumes += 1
        self.spawns.append((self.trainer.spawn_wall_s,
                            sum(h.price_usd_per_hour for h in holdings)))
        held = self.held
        label = _set_label(held)
        # Steps an earlier trainer recorded after the checkpoint this one starts from will run
        # again (counted at the end from the telemetry, `count_replays`).
        will_replay = max(0, self.steps - (self.checkpoint_step if self.checkpoint_path else 0))
        self.record(PROVIDER_POLICY,
                    {"event": "resume" if self.checkpoint_path else "start",
                     "pid": process.pid, "node": label, "zone": held.zone if held else None,
                     "from_checkpoint": self.checkpoint_path},
                    (f"trainer process {process.pid} started on {label}"
                     + (f", resuming from step {self.checkpoint_step}" if self.checkpoint_path
                        else ", fresh run")
                     + (f"; its fast layer's preemption risk {risk:.3f} (reclaims so far "
                        f"{len(self.preemption_times)})" if risk is not None else "")),
                    {"checkpoint_step": float(self.checkpoint_step),
                     "time_s": self.clock.now_s,
                     "steps_to_replay": float(will_replay),
                     **({"preemption_risk": risk} if risk is not None else {})})

    def count_replays(self) -> replay.ReplayWaste:
        """Step events that re-ran an already recorded step, priced at the node of the trainer
        that wrote them (the trainer started last before the event)."""
        if not (self.telemetry_dir / "rank0").is_dir():
            return replay.ReplayWaste(0, 0.0, 0.0)
        steps = [e for e in read_run_events(self.telemetry_dir, rank=0) if e["type"] == "step"]
        starts = [wall for wall, _ in self.spawns]
        count, waste_usd = 0, 0.0
        for event, again in zip(steps, replay.replayed(e["step"] for e in steps)):
            if not again:
                continue
            index = max(0, bisect.bisect_right(starts, event["wall_time_s"]) - 1)
            price = self.spawns[index][1] if self.spawns else 0.0
            count += 1
            waste_usd += replay.replay_waste(1, self.step_s, price).waste_usd
        return replay.ReplayWaste(count, count * self.step_s, waste_usd)

    def stop_trainer(self, reason: str) -> None:
        """SIGTERM by pid (the spot reclaim notice, or a policy move); SIGKILL after the notice."""
        trainer = self.trainer
        if trainer is None or trainer.kill_at_monotonic is not None:
            return
        trainer.stop_reason = reason
        self.note_notice(trainer)
        trainer.stop_wall_s, trainer.stop_clock_s = time.time(), self.clock.now_s
        trainer.kill_at_monotonic = time.monotonic() + self.notice_wall_s
        if trainer.process.poll() is None:
            os.kill(trainer.process.pid, signal.SIGTERM)

    def note_notice(self, trainer: _Trainer) -> None:
        """The trainer's node was told to stop now: it is billed until it is down."""
        if trainer.notice_monotonic is None:
            trainer.notice_monotonic = time.monotonic()
        for holding in trainer.holdings:
            if holding.notice_at_s is None:
                holding.notice_at_s = self.clock.now_s

    def node_down(self, trainer: _Trainer) -> None:
        """The trainer exited (or was killed): its nodes were up until then, at most the
        notice (each node of a gang stands by the one process)."""
        if trainer.notice_monotonic is None:
            return
        shutdown_wall_s = time.monotonic() - trainer.notice_monotonic
        for node, holding in zip(trainer.nodes, trainer.holdings):
            if holding.notice_at_s is not None:
                self.provider.node_down(node, shutdown_wall_s)

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

    def poll_trainer(self) -> None:
        """Collect an exited trainer; kill one past its notice; boot a pending launch."""
        trainer = self.trainer
        if trainer is None:
            if self.pending_launch:
                self.pending_launch = False
                self.spawn()
            return
        code = trainer.process.poll()
        if code is None:
            if trainer.kill_at_monotonic is not None and time.monotonic() > trainer.kill_at_monotonic:
                os.kill(trainer.process.pid, signal.SIGKILL)
                trainer.killed = True
                self.notices_missed += 1
                trainer.process.wait()
                self.node_down(trainer)
            else:
                if not trainer.ready:
                    self.read_progress()
                    if trainer.ready:
                        # Booted: the emulated node's changeover (launch + restore) has passed,
                        # and its steps so far ran on the clock (`boot_jump_s`).
                        self.advance(self.clock.now_s + self.boot_jump_s(trainer, time.time()))
                return
        if not trainer.killed:
            self.node_down(trainer)
        self.read_progress()
        result = (json.loads(trainer.result_path.read_text())
                  if trainer.result_path.exists() else None)
        self.trainer = None
        if result is None and not trainer.killed:
            log = trainer.result_path.parent / trainer.result_path.name.replace(
                "result-", "worker-").replace(".json", ".log")
            raise RuntimeError(f"trainer pid {trainer.process.pid} exited with code {code} and no "
                               f"result; see {log}")
        # A trainer reclaimed on its last step stops "preempted" with every step done: the work is
        # finished and no policy relaunches finished work, so it counts as completed (else the
        # run would wait for a launch until max_wall_s).
        if result is not None and (result["status"] == "completed"
                                   or int(result["steps"]) >= self.max_steps):
            if self.pending_launch:
                # The trainer finished while a relaunch waited for it to exit: never booted.
                self.pending_launch = False
                for node in self.nodes:
                    self.provider.forget(node)
                self.nodes = []
                self.launches -= 1
            self.finish_s = self.clock.now_s
            self.final_eval_loss = result["final_eval_loss"]
            self.end_holding("completed")
            for node in trainer.nodes:  # billed to its exit (freeze_after_last_step): now done
                holding = self.provider.holding(node)
                holding.end_reason = holding.end_reason or "completed"
                self.provider.terminate(node, "completed")
            self.record(PROVIDER_POLICY, {"event": "completed", "pid": result["pid"]},
                        f"training done at step {result['steps']}: node released",
                        {"time_s": self.clock.now_s, "steps": float(result["steps"])})
            return
        if result is not None:
            self.checkpoint_path = result["checkpoint_path"]
            self.checkpoint_step = int(result["steps"])
        if trainer.stop_reason == "":
            raise RuntimeError(f"trainer pid {trainer.process.pid} stopped unasked with status "
                               f"{result['status'] if result else code}")
        if self.store_dir is not None:
            # The node is gone and its local disk with it: only the store keeps checkpoints.
            shutil.rmtree(self.run_dir / "checkpoints", ignore_errors=True)
        self.record(PROVIDER_POLICY,
                    {"event": "trainer_stopped", "pid": trainer.process.pid,
                     "status": result["status"] if result else "killed"},
                    f"trainer pid {trainer.process.pid} stopped ({trainer.stop_reason}): "
                    + (f"checkpoint at step {self.checkpoint_step} within the notice"
                       if not trainer.killed else "SIGKILL after the notice, work since the "
                       f"last checkpoint (step {self.checkpoint_step}) lost"),
                    {"checkpoint_step": float(self.checkpoint_step), "time_s": self.clock.now_s})
        if self.pending_launch:
            self.pending_launch = False
            self.spawn()


def _set_label(held: replay.HeldSet | None) -> str | None:
    """"spot", "on_demand" (one node) or "4 spot + 0 on_demand in us-east-1f" (a gang)."""
    if held is None:
        return None
    if held.spot_nodes + held.on_demand_nodes == 1:
        return replay.SPOT if held.spot_nodes else replay.ON_DEMAND
    return f"{held.spot_nodes} spot + {held.on_demand_nodes} on_demand in {held.zone}"


def _train_config(run_id: str, max_steps: int, market: replay.ReplayMarket,
                  overrides: dict[str, Any] | None) -> dict[str, Any]:
    config = {"max_steps": max_steps, "micro_batch_size": 16, "eval_every_steps":
              max(10, max_steps // 4), "eval_batches": 2, "eval_batch_size": 32,
              "checkpoint_every_steps": max(10, max_steps // 4), "run_id": run_id,
              "instance_type": market.instance_type,
              # The trainer's own wall-clock bill; the emulated bill is the provider's.
              "price_usd_per_hour": market.on_demand_usd_per_hour,
              "num_threads": int(settings.get("TRAINWISE_TORCH_THREADS"))}
    config.update(overrides or {})
    return config


def run_emulated(
    partition: str,
    *,
    max_steps: int,
    trace_folder: str = DEFAULT_TRACE_FOLDER,
    zone_file: str = DEFAULT_ZONE_FILE,
    window_start_tick: int = 0,
    seconds_per_tick: float = 0.2,
    policy_name: str = "trainwise_heuristic",
    deadline_factor: float = 2.0,
    out_dir: str | Path,
    data_dir: str | Path | None = None,
    run_id: str | None = None,
    step_wall_s_estimate: float = 0.1,
    min_notice_wall_s: float = 10.0,
    max_wall_s: float = 600.0,
    poll_s: float = 0.02,
    train_overrides: dict[str, Any] | None = None,
    trainer_ignores_notice: bool = False,
    object_store_dir: str | Path | None = None,
    zone_files: Sequence[str] | None = None,
    nodes: int = 1,
    fast_policy: str | None = None,
    freeze_after_last_step: bool = False,
) -> EmulatedResult:
    """Train `partition` for `max_steps` on the emulated cloud (see the module docstring).

    `out_dir` is a runs root: the run lives in `<out_dir>/<run_id>` (so `trainwise explain
    RUN_ID` with runs root `out_dir` finds it) and the shards in `<out_dir>/shards/<partition>`.
    `data_dir` (default: the `TRAINWISE_DATA_DIR` setting) holds the corpora and `spot/`.
    `trainer_ignores_notice` (fault injection): trainers block SIGTERM, so each notice ends in a
    SIGKILL and the resumed trainer re-runs the killed one's steps since its checkpoint.
    `object_store_dir` (a `LocalObjectStore` folder): trainers upload every checkpoint under
    `checkpoints/<partition>/<run_id>`, a stopped node's checkpoint folder is deleted (its disk
    is gone), and each replacement restores the store's newest committed checkpoint.
    `zone_files` (default: `[zone_file]`): the zones replayed together, trace files of
    `trace_folder` with one tick length and instance type, all from `window_start_tick`; the
    first is the home zone. `nodes`: the gang's size (see "Gang" in the module docstring).
    `fast_policy`: written into each trainer's job JSON as "fast_policy" (the worker's fast
    layer); None leaves the worker's default.
    `freeze_after_last_step`: the clock stops at the last training step (completion = that
    time, as the simulator's finish) while the trainer writes its final eval and checkpoint and
    exits, and the set is billed for that as for a shutdown (wall seconds at replay speed, at
    most the notice: `replay.node_down_s`). Off (the default): that tail runs on the clock and
    is billed whole (at replay speed a process exit of 1 wall second is 975-1500 emulated s).
    """
    from training import shards

    if max_steps < 1:
        raise ValueError(f"max_steps={max_steps} must be >= 1")
    if nodes < 1:
        raise ValueError(f"nodes={nodes} must be >= 1 (the gang's node count)")
    files = list(zone_files) if zone_files else [zone_file]
    if len(set(files)) != len(files):
        raise ValueError(f"zone_files {files} repeat a file: give each zone once")
    if not (seconds_per_tick > 0 and deadline_factor >= 1.0 and step_wall_s_estimate > 0):
        raise ValueError(f"seconds_per_tick={seconds_per_tick} and step_wall_s_estimate="
                         f"{step_wall_s_estimate} must be > 0, deadline_factor={deadline_factor} "
                         ">= 1 (the deadline is a multiple of the work plus one changeover)")
    started = time.monotonic()
    out_dir = Path(out_dir)
    data_dir = Path(data_dir) if data_dir is not None else settings.data_dir()
    rules = replay.default_rules()
    emulated_per_wall_s = 195.0 / seconds_per_tick  # refined below with the trace's tick length
    run_id = run_id or f"emulated-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    shards_dir = out_dir / "shards" / partition
    if not (shards_dir / "manifest.json").exists():
        shards.build_shards(partition, data_dir, shards_dir)
    # Window length needs the deadline, the deadline the tick length: read the trace's tick first.
    probe = replay.load_replay_market(trace_folder, files[0], window_start_tick, 1,
                                      data_dir / "spot")
    emulated_per_wall_s = probe.tick_s / seconds_per_tick
    work_total_s = max_steps * step_wall_s_estimate * emulated_per_wall_s
    deadline_s = deadline_factor * (work_total_s + rules.changeover_s)
    markets = [replay.load_replay_market(trace_folder, f, window_start_tick,
                                         replay.window_ticks(deadline_s, probe.tick_s),
                                         data_dir / "spot") for f in files]
    market = markets[0]
    if len({m.instance_type for m in markets}) != 1:
        raise ValueError(f"zone_files {files} hold different instance types "
                         f"{sorted({m.instance_type for m in markets})}: replay one shape")
    policy = make_policy(policy_name, **risk_model_kwargs(policy_name, market, trace_folder,
                                                          data_dir / "spot"))
    run_dir = out_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    clock = replay.ReplayClock(float(market.tick_s), seconds_per_tick)
    notice_wall_s = max(min_notice_wall_s, clock.wall_s(rules.notice_s))
    with SegmentWriter(run_dir / "telemetry", run_id, rank=PROVIDER_RANK) as writer:
        job = _Emulation(
            rules=rules, clock=clock,
            markets=markets, provider=EmulatedProvider(markets, clock, rules), policy=policy,
            writer=writer, node_count=nodes, fast_policy=fast_policy,
            freeze_after_last_step=freeze_after_last_step,
            run_id=run_id,
            run_dir=run_dir, shards_dir=shards_dir,
            train_config=_train_config(run_id, max_steps, market, train_overrides),
            max_steps=max_steps, work_total_s=work_total_s, deadline_s=deadline_s,
            notice_wall_s=notice_wall_s, trainer_ignores_notice=trainer_ignores_notice,
            store_dir=Path(object_store_dir) if object_store_dir is not None else None,
            store_key_prefix=f"checkpoints/{partition}/{run_id}")
        zones = [m.zone for m in markets]
        job.record(PROVIDER_POLICY, {"event": "job", "trace": market.source, "zone": market.zone,
                                     "zones": zones, "nodes": nodes,
                                     "instance_type": market.instance_type},
                   f"emulated job: {max_steps} steps on {nodes} x {market.instance_type} in "
                   f"{', '.join(zones)}, "
                   f"trace {market.source} from tick {window_start_tick}, "
                   f"{seconds_per_tick} s wall per {market.tick_s} s tick",
                   {"deadline_s": deadline_s, "work_total_h": job.work_total_h,
                    "spot_usd_per_hour": market.spot_usd_per_hour,
                    "on_demand_usd_per_hour": market.on_demand_usd_per_hour})
        status = "completed"
        try:
            job.advance(0.0)  # tick 0: the first decision
            last_wall = time.monotonic()
            while job.finish_s is None:
                if time.monotonic() - started > max_wall_s:
                    status = "deadline_exceeded_wall"
                    break
                time.sleep(poll_s)
                now_wall = time.monotonic()
                elapsed_wall, last_wall = now_wall - last_wall, now_wall
                job.poll_trainer()
                if job.finish_s is not None:
                    break
                if job.frozen:
                    continue
                if job.trainer is not None:
                    job.read_progress()
                    if job.frozen:
                        continue
                job.advance(clock.now_s + elapsed_wall * clock.emulated_per_wall_s)
        finally:
            if job.trainer is not None and job.trainer.process.poll() is None:
                os.kill(job.trainer.process.pid, signal.SIGKILL)
                job.trainer.process.wait()
                job.node_down(job.trainer)
            job.end_holding("stopped")
    holdings = job.holdings
    waste = job.count_replays()
    return EmulatedResult(
        status=status, run_id=run_id, run_dir=run_dir, steps=job.steps, max_steps=max_steps,
        preemptions=len(job.preemption_times), resumes=job.resumes, launches=job.launches,
        notices_missed=job.notices_missed, spot_share=replay.spot_share(holdings),
        cost_usd=replay.bill_usd(holdings),
        spot_node_s=sum(h.billed_s() for h in holdings if h.kind == replay.SPOT),
        on_demand_node_s=sum(h.billed_s() for h in holdings if h.kind == replay.ON_DEMAND),
        deadline_s=deadline_s, finish_s=job.finish_s, final_eval_loss=job.final_eval_loss,
        wall_s=time.monotonic() - started, policy=policy_name, trace_source=market.source,
        zone=market.zone, instance_type=market.instance_type,
        window_start_tick=market.window_start_tick, seconds_per_tick=seconds_per_tick,
        spot_usd_per_hour=market.spot_usd_per_hour,
        on_demand_usd_per_hour=market.on_demand_usd_per_hour,
        holdings=tuple(asdict(h) for h in holdings), trainer_pids=tuple(job.pids),
        replayed_steps=waste.replayed_steps, preemption_waste_s=waste.waste_s,
        preemption_waste_usd=waste.waste_usd,
        useful_train_s=min(job.steps, max_steps) * job.step_s,
        stopping_node_s=sum(h.end_s - h.notice_at_s for h in holdings
                            if h.notice_at_s is not None and h.end_s is not None),
        zones=tuple(m.zone for m in markets),
        zones_held=tuple(dict.fromkeys(h.zone for h in holdings)),
        node_count=nodes, node_launches=len(holdings))


def result_record(result: EmulatedResult) -> dict[str, Any]:
    """JSON-ready figures of a run (paths as strings, the deadline verdict included)."""
    record = asdict(result)
    record["run_dir"] = str(result.run_dir)
    record["deadline_met"] = result.deadline_met
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()}


# -- a replacement node restores from the object store -------------------------------------------
@dataclass(frozen=True)
class RestorePoint:
    """Where a replacement node resumes: a committed checkpoint in its local folder."""

    path: Path
    step: int
    source: str  # "store" (downloaded) or "local" (the folder already held it, or a newer one)
    skipped: tuple[tuple[str, str], ...] = ()  # newer store checkpoints that failed to verify


def restore_from_store(store: Any, key_prefix: str, checkpoints_dir: str | Path
                       ) -> RestorePoint | None:
    """Bring the store's newest committed checkpoint under `key_prefix` into `checkpoints_dir`
    (a node's local checkpoint folder, empty on a replacement node) unless the folder already
    holds a good checkpoint at least as new. None: nothing to resume from (start fresh).

    The download is verified against the commit marker (sha256, bytes) and lands payload first,
    manifest last, so `training.checkpoint.latest_good_checkpoint` (and `runs.is_resumable`)
    see it as any local checkpoint. `trainwise/runs.py` can call this before `_resume_point`
    with `checkpoints/<partition>/<run_id>` (the uploader's prefix) and `run_dir/checkpoints`.
    """
    from training.checkpoint import latest_good_checkpoint
    from trainwise.object_store import latest_committed_checkpoint

    folder = Path(checkpoints_dir)
    local = latest_good_checkpoint(folder) if folder.is_dir() else None
    folder.mkdir(parents=True, exist_ok=True)
    stored = latest_committed_checkpoint(store, key_prefix, folder)
    skipped = tuple(stored.skipped) if stored is not None else ()
    if local is not None and (stored is None or local.step >= stored.step):
        return RestorePoint(Path(local.path), int(local.step), "local", skipped)
    if stored is None:
        return None
    return RestorePoint(stored.path, stored.step, "store", skipped)
