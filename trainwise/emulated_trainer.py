"""The trainer-process side of the emulated cloud (`trainwise/emulated.py`): a trainer process
per emulated node, its boot and progress read from its rank-0 telemetry, its stop (SIGTERM by pid,
SIGKILL after the notice) and its exit. `_TrainerProcesses` holds these methods of
`trainwise.emulated_job._Emulation` (the provider's state, which it uses through `self`).
The process is the built-in worker (`worker_child`), or a user's SDK job when the emulation
has a `workload` (`trainwise.user_job_supervised`): its telemetry is in the same place and
schema (rank 0), and the workload turns its outcome into the worker's result file.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cloud import emulated as replay
from cloud.providers.base import NodeHandle
from controllers.preemption_risk import observed_reclaim_risk
from telemetry.reader import read_run_events
from training.safe_files import replace_with_new, write_atomic
from trainwise import settings
from trainwise.emulated_store import RESUME_FROM_STORE

# The provider's telemetry rank: not a training rank (those count from 0), one writer per rank.
PROVIDER_RANK = 1000
PROVIDER_POLICY = "emulated_cloud"


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


def _set_label(held: replay.HeldSet | None) -> str | None:
    """"spot", "on_demand" (one node) or "4 spot + 0 on_demand in us-east-1f" (a gang)."""
    if held is None:
        return None
    if held.spot_nodes + held.on_demand_nodes == 1:
        return replay.SPOT if held.spot_nodes else replay.ON_DEMAND
    return f"{held.spot_nodes} spot + {held.on_demand_nodes} on_demand in {held.zone}"


class _TrainerProcesses:
    """The trainer-process methods of `_Emulation` (`trainwise/emulated_job.py`), which holds
    the state they read and write (clock, provider, trainer, steps, checkpoint, bills)."""

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
        layer): the train job's rule (`controllers.preemption_risk.observed_reclaim_risk`: reclaims seen so far
        over the time observed, half a reclaim while none is seen, 0 on on-demand only), on the
        trainer's clock. Trainers run at replay speed, so the observed time is the clock's
        emulated seconds in this machine's seconds (`ReplayClock.wall_s`): the hazard per wall
        second is the trace's, times `emulated_per_wall_s`, as the trainer lives it. Each
        replacement trainer gets the risk with every reclaim so far counted."""
        if self.fast_policy is None:
            return None
        held = self.held
        return observed_reclaim_risk(len(self.preemption_times), self.clock.wall_s(self.clock.now_s),
                               held.spot_nodes if held is not None else 0)

    def spawn(self) -> None:
        """Start a trainer process, resuming from the newest checkpoint when there is one."""
        index = len(self.pids)
        folder = self.run_dir / "emulated"
        folder.mkdir(parents=True, exist_ok=True)
        result_path = folder / f"result-{index:03d}.json"
        risk = self.trainer_risk()
        if self.workload is not None:  # a user's job: its own command and run spec
            command, env, cwd = self.workload.child(self, index, result_path)
        else:
            command, env, cwd = self.worker_child(index, folder, result_path, risk)
        log = os.fdopen(replace_with_new(folder / f"worker-{index:03d}.log"), "w")
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        gang = self.gang
        holdings = tuple(self.provider.holding(n) for n in gang)
        self.trainer = _Trainer(process, time.time(), result_path,
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

    def worker_child(self, index: int, folder: Path, result_path: Path, risk: float | None
                     ) -> tuple[list[str], dict[str, str] | None, Path]:
        """The built-in trainer's command (`trainwise.emulated_worker` with its job file)."""
        resume_from = self.checkpoint_path
        if self.store_dir is not None and resume_from is not None:
            resume_from = RESUME_FROM_STORE  # the new node's disk is empty: the store has it
        job = {"shards_dir": str(self.shards_dir), "run_dir": str(self.run_dir),
               "result_path": str(result_path),
               "resume_from": resume_from, "train_config": self.train_config,
               "block_sigterm": self.trainer_ignores_notice,
               "store_dir": str(self.store_dir) if self.store_dir is not None else None,
               "store_key_prefix": self.store_key_prefix, "fast_policy": self.fast_policy,
               **self.job_extra}
        if risk is not None:
            job["preemption_risk"] = risk
        job_path = folder / f"job-{index:03d}.json"
        # The run folder is shared and these names are predictable: a planted link is replaced,
        # never written through (issue 31, class 2).
        write_atomic(job_path, json.dumps(job, indent=1).encode("utf-8"))
        return ([sys.executable, "-m", "trainwise.emulated_worker", str(job_path)], None,
                settings.PROJECT_ROOT)

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
        if self.workload is not None:  # a user's job: its outcome becomes the result file
            self.workload.collect(self, trainer, code)
        result = (json.loads(trainer.result_path.read_text())
                  if trainer.result_path.exists() else None)
        self.trainer = None
        if result is not None:
            self.last_result = result
            self.uploaded += [str(u) for u in result.get("uploaded") or []]
            self.upload_failed += [(str(k), str(w)) for k, w in result.get("upload_failed") or []]
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
