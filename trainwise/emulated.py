"""The `emulated` way to run the cloud: real trainer processes, a real spot trace replayed fast.

`run_emulated` trains one job on this machine as if on one cloud node (or an N-node gang, in one
of several zones) of the trace's instance type (p3.2xlarge for the V100 traces). The pure parts
(replay clock, market window, billing rule, observations) are in `cloud/emulated.py`; launches,
notices, terminations and the bill go through the `emulated` provider
(`cloud/providers/emulated.py`, the `ComputeProvider` interface); this module drives the job:
`_Emulation` (`trainwise/emulated_job.py`, the held set, the clock and each tick's policy action)
runs the trainer processes (`trainwise/emulated_trainer.py`), freezes the clock while they boot
or stop, and writes telemetry. `restore_from_store` (`trainwise/emulated_store.py`) is how a
replacement node, whose disk is new, gets the run's newest committed checkpoint from the object
store.

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

import math
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cloud import emulated as replay
from cloud.policy_registry import make_policy
from cloud.providers.emulated import EmulatedProvider
from cloud.traces import FOLDER_MEANING
from telemetry.writer import SegmentWriter
from trainwise import settings

# The job's state machine, its trainer processes and the store restore have their own modules;
# re-exported here, where `trainwise/runs.py`, the worker and the tests import them from.
from trainwise.emulated_job import _Emulation
from trainwise.emulated_store import RestorePoint, restore_from_store
from trainwise.emulated_trainer import PROVIDER_POLICY, PROVIDER_RANK, _Trainer

__all__ = ["DEFAULT_TRACE_FOLDER", "DEFAULT_ZONE_FILE", "PROVIDER_POLICY", "PROVIDER_RANK",
           "EmulatedResult", "ReplayPlan", "ReplaySpec", "RestorePoint", "_Emulation", "_Trainer",
           "emulated_result", "plan_replay", "replay_policy", "restore_from_store", "result_record",
           "risk_model_kwargs", "run_emulated", "supervise"]

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


@dataclass(frozen=True)
class ReplaySpec:
    """How the emulated cloud replays a trace for one run (see the module docstring): which
    trace window, how fast, the deadline rule and the work model. `trainwise.runs.run_training`
    takes one to run a job under an allocation policy; `run_emulated` builds one from its
    arguments."""

    trace_folder: str = DEFAULT_TRACE_FOLDER
    zone_files: tuple[str, ...] = (DEFAULT_ZONE_FILE,)
    window_start_tick: int = 0
    seconds_per_tick: float = 0.2
    deadline_factor: float = 2.0
    step_wall_s_estimate: float = 0.1
    min_notice_wall_s: float = 10.0
    max_wall_s: float = 600.0
    poll_s: float = 0.02
    nodes: int = 1
    trainer_ignores_notice: bool = False
    freeze_after_last_step: bool = False

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes={self.nodes} must be >= 1 (the gang's node count)")
        if not self.zone_files:
            raise ValueError("zone_files is empty: give at least the home zone's trace file")
        if len(set(self.zone_files)) != len(self.zone_files):
            raise ValueError(f"zone_files {list(self.zone_files)} repeat a file: give each zone "
                             "once")
        if not (self.seconds_per_tick > 0 and self.deadline_factor >= 1.0
                and self.step_wall_s_estimate > 0):
            raise ValueError(
                f"seconds_per_tick={self.seconds_per_tick} and step_wall_s_estimate="
                f"{self.step_wall_s_estimate} must be > 0, deadline_factor="
                f"{self.deadline_factor} >= 1 (the deadline is a multiple of the work plus one "
                "changeover)")


@dataclass(frozen=True)
class ReplayPlan:
    """The markets of a spec's window, loaded, with the job's work and deadline on their clock."""

    spec: ReplaySpec
    markets: tuple[replay.ReplayMarket, ...]
    rules: Any
    work_total_s: float  # emulated seconds the job's max_steps take on the full gang
    deadline_s: float

    @property
    def market(self) -> replay.ReplayMarket:
        return self.markets[0]

    @property
    def notice_wall_s(self) -> float:
        """The provider's notice in this machine's seconds (at least `min_notice_wall_s`)."""
        per_wall_s = self.market.tick_s / self.spec.seconds_per_tick
        return max(self.spec.min_notice_wall_s, self.rules.notice_s / per_wall_s)


def replay_policy(name: str, plan: ReplayPlan, spot_dir: Path) -> Any:
    """The registered allocation policy `name` for a replayed window, trainwise_heuristic's
    hazard model fitted on the trace before the window (as the cost suite fits it)."""
    return make_policy(name, **risk_model_kwargs(name, plan.market, plan.spec.trace_folder,
                                                 spot_dir))


def plan_replay(spec: ReplaySpec, max_steps: int, spot_dir: Path) -> ReplayPlan:
    """Loads the window: its length needs the deadline, the deadline the trace's tick length."""
    if max_steps < 1:
        raise ValueError(f"max_steps={max_steps} must be >= 1")
    rules = replay.default_rules()
    files = list(spec.zone_files)
    probe = replay.load_replay_market(spec.trace_folder, files[0], spec.window_start_tick, 1,
                                      spot_dir)
    emulated_per_wall_s = probe.tick_s / spec.seconds_per_tick
    work_total_s = max_steps * spec.step_wall_s_estimate * emulated_per_wall_s
    deadline_s = spec.deadline_factor * (work_total_s + rules.changeover_s)
    markets = tuple(replay.load_replay_market(spec.trace_folder, f, spec.window_start_tick,
                                              replay.window_ticks(deadline_s, probe.tick_s),
                                              spot_dir) for f in files)
    if len({m.instance_type for m in markets}) != 1:
        raise ValueError(f"zone_files {files} hold different instance types "
                         f"{sorted({m.instance_type for m in markets})}: replay one shape")
    return ReplayPlan(spec, markets, rules, work_total_s, deadline_s)


def supervise(plan: ReplayPlan, *, policy: Any, run_id: str, run_dir: Path, shards_dir: Path,
              train_config: dict[str, Any], max_steps: int, fast_policy: str | None = None,
              store_dir: Path | None = None, store_key_prefix: str = "",
              job_extra: dict[str, Any] | None = None,
              resume_step: int | None = None, workload: Any = None) -> tuple[_Emulation, str]:
    """Runs the job on the replayed market until its last step (or `max_wall_s`): `policy` (an
    allocation policy object) decides each tick, trainer processes train and answer notices.
    `resume_step`: the run was trained to this step before and its checkpoint is committed in
    the store (`store_dir`); the first trainer restores it from there. `workload`: a user's job
    run in place of the built-in trainer (`_Emulation.workload`; None: the built-in worker).
    Returns the finished job state and the status ("completed" or "deadline_exceeded_wall")."""
    if resume_step is not None and store_dir is None:
        raise ValueError("resume_step needs store_dir: the first trainer restores from the store")
    spec = plan.spec
    started = time.monotonic()
    market = plan.market
    run_dir.mkdir(parents=True, exist_ok=True)
    clock = replay.ReplayClock(float(market.tick_s), spec.seconds_per_tick)
    notice_wall_s = plan.notice_wall_s
    markets = list(plan.markets)
    with SegmentWriter(run_dir / "telemetry", run_id, rank=PROVIDER_RANK) as writer:
        job = _Emulation(
            rules=plan.rules, clock=clock,
            markets=markets, provider=EmulatedProvider(markets, clock, plan.rules), policy=policy,
            writer=writer, node_count=spec.nodes, fast_policy=fast_policy,
            freeze_after_last_step=spec.freeze_after_last_step,
            run_id=run_id, run_dir=run_dir, shards_dir=shards_dir,
            train_config=train_config, max_steps=max_steps, work_total_s=plan.work_total_s,
            deadline_s=plan.deadline_s, notice_wall_s=notice_wall_s,
            trainer_ignores_notice=spec.trainer_ignores_notice, store_dir=store_dir,
            store_key_prefix=store_key_prefix, job_extra=dict(job_extra or {}),
            workload=workload)
        if resume_step is not None:  # the store holds the run's newest committed checkpoint
            job.checkpoint_path = f"store:{store_key_prefix}"
            job.steps = job.checkpoint_step = int(resume_step)
        zones = [m.zone for m in markets]
        job.record(PROVIDER_POLICY, {"event": "job", "trace": market.source, "zone": market.zone,
                                     "zones": zones, "nodes": spec.nodes,
                                     "instance_type": market.instance_type},
                   f"emulated job: {max_steps} steps on {spec.nodes} x {market.instance_type} in "
                   f"{', '.join(zones)}, "
                   f"trace {market.source} from tick {spec.window_start_tick}, "
                   f"{spec.seconds_per_tick} s wall per {market.tick_s} s tick",
                   {"deadline_s": plan.deadline_s, "work_total_h": job.work_total_h,
                    "spot_usd_per_hour": market.spot_usd_per_hour,
                    "on_demand_usd_per_hour": market.on_demand_usd_per_hour})
        status = "completed"
        try:
            job.advance(0.0)  # tick 0: the first decision
            last_wall = time.monotonic()
            while job.finish_s is None:
                if time.monotonic() - started > spec.max_wall_s:
                    status = "deadline_exceeded_wall"
                    break
                time.sleep(spec.poll_s)
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
                job.write_bill()
        finally:
            if job.trainer is not None and job.trainer.process.poll() is None:
                os.kill(job.trainer.process.pid, signal.SIGKILL)
                job.trainer.process.wait()
                job.node_down(job.trainer)
            job.end_holding("stopped")
            job.write_bill(final=True)  # the bill emulated_result reports
    return job, status


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
    spec = ReplaySpec(
        trace_folder=trace_folder, zone_files=tuple(zone_files) if zone_files else (zone_file,),
        window_start_tick=window_start_tick, seconds_per_tick=seconds_per_tick,
        deadline_factor=deadline_factor, step_wall_s_estimate=step_wall_s_estimate,
        min_notice_wall_s=min_notice_wall_s, max_wall_s=max_wall_s, poll_s=poll_s, nodes=nodes,
        trainer_ignores_notice=trainer_ignores_notice,
        freeze_after_last_step=freeze_after_last_step)
    started = time.monotonic()
    out_dir = Path(out_dir)
    data_dir = Path(data_dir) if data_dir is not None else settings.data_dir()
    run_id = run_id or f"emulated-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    shards_dir = out_dir / "shards" / partition
    if not (shards_dir / "manifest.json").exists():
        shards.build_shards(partition, data_dir, shards_dir)
    plan = plan_replay(spec, max_steps, data_dir / "spot")
    market = plan.market
    policy = replay_policy(policy_name, plan, data_dir / "spot")
    run_dir = out_dir / run_id
    job, status = supervise(
        plan, policy=policy, run_id=run_id, run_dir=run_dir, shards_dir=shards_dir,
        train_config=_train_config(run_id, max_steps, market, train_overrides),
        max_steps=max_steps, fast_policy=fast_policy,
        store_dir=Path(object_store_dir) if object_store_dir is not None else None,
        store_key_prefix=f"checkpoints/{partition}/{run_id}")
    return emulated_result(job, plan, status=status, policy_name=policy_name,
                           wall_s=time.monotonic() - started)


def emulated_result(job: _Emulation, plan: ReplayPlan, *, status: str, policy_name: str,
                    wall_s: float) -> EmulatedResult:
    """The figures of a supervised job (`supervise`), the provider's bill among them."""
    market, markets, spec = plan.market, plan.markets, plan.spec
    holdings = job.holdings
    waste = job.count_replays()
    return EmulatedResult(
        status=status, run_id=job.run_id, run_dir=job.run_dir, steps=job.steps,
        max_steps=job.max_steps,
        preemptions=len(job.preemption_times), resumes=job.resumes, launches=job.launches,
        notices_missed=job.notices_missed, spot_share=replay.spot_share(holdings),
        cost_usd=replay.bill_usd(holdings),
        spot_node_s=sum(h.billed_s() for h in holdings if h.kind == replay.SPOT),
        on_demand_node_s=sum(h.billed_s() for h in holdings if h.kind == replay.ON_DEMAND),
        deadline_s=plan.deadline_s, finish_s=job.finish_s, final_eval_loss=job.final_eval_loss,
        wall_s=wall_s, policy=policy_name, trace_source=market.source,
        zone=market.zone, instance_type=market.instance_type,
        window_start_tick=market.window_start_tick, seconds_per_tick=spec.seconds_per_tick,
        spot_usd_per_hour=market.spot_usd_per_hour,
        on_demand_usd_per_hour=market.on_demand_usd_per_hour,
        holdings=tuple(asdict(h) for h in holdings), trainer_pids=tuple(job.pids),
        replayed_steps=waste.replayed_steps, preemption_waste_s=waste.waste_s,
        preemption_waste_usd=waste.waste_usd,
        useful_train_s=min(job.steps, job.max_steps) * job.step_s,
        stopping_node_s=sum(h.end_s - h.notice_at_s for h in holdings
                            if h.notice_at_s is not None and h.end_s is not None),
        zones=tuple(m.zone for m in markets),
        zones_held=tuple(dict.fromkeys(h.zone for h in holdings)),
        node_count=spec.nodes, node_launches=len(holdings))


def result_record(result: EmulatedResult) -> dict[str, Any]:
    """JSON-ready figures of a run (paths as strings, the deadline verdict included)."""
    record = asdict(result)
    record["run_dir"] = str(result.run_dir)
    record["deadline_met"] = result.deadline_met
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()}
