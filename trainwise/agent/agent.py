"""The node agent: runs a run's job on this node and answers the node's end (one host).

`NodeAgent(...).run()` in order:

1. Reads the task document from the store (`trainwise.agent.task`; refused whole, with the key
   and the fix, before anything starts) and picks the watcher the settings name
   (`trainwise.agent.imds`; an endpoint that does not answer: SIGTERM alone, with a warning).
2. Writes the node's run spec into the local run folder (`<run_dir>/agent/spec.json`): the
   task's fields, this folder, the store, and the notice file `<run_dir>/agent/notice`. The SDK
   restores the newest committed checkpoint from the store when the local disk has none.
3. Starts the job (the task's declared command only, no shell) in its own process group, and
   every `TRAINWISE_AGENT_POLL_S` asks the watcher. A notice that ends the node (a spot
   instance-action, GCP's preempted, Azure's Preempt, a SIGTERM to the agent) writes the notice
   file: the SDK answers at its next step with a checkpoint committed to the store and exit 143.
   A job still running `TRAINWISE_AGENT_NOTICE_MARGIN_S` before the notice's end gets SIGTERM;
   one still running that long after the end is killed. A notice that does not end the node
   (a rebalance recommendation, an Azure Freeze) is recorded only.
4. Copies the job's telemetry folder into the store every `TRAINWISE_AGENT_TELEMETRY_EVERY_S`
   and at the end, under `runs/<run_id>/agent/starts/<start_id>/telemetry/`.
5. Writes its status record (`STATUS_FORMAT`) into the local folder and the store at the start,
   at each notice and at the end: the notice's source and times, notice to exit, notice to the
   checkpoint's commit, the exit code and the last committed step. Its exit code is the job's
   (0 completed, 143 preempted, else failed; killed by signal N: 128 + N).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from training.safe_files import replace_with_new, write_atomic
from trainwise import settings
from trainwise.agent.imds import (
    NOTICE_S,
    MetadataUnreachableError,
    Notice,
    WatchChoice,
    parse_time,
    watcher_from_settings,
)
from trainwise.agent.task import AgentTask, AgentTaskError, read_task, task_key
from trainwise.agent.telemetry_sync import TelemetrySync
from trainwise.object_store import COMMIT_SUFFIX, S3_URI_PREFIX, ObjectStore, store_at
from trainwise.sdk.spec import PREEMPTED_EXIT_CODE, write_spec
from trainwise.services import ServiceUnreachableError
from trainwise.user_jobs import job_env

LOG = logging.getLogger("trainwise.agent")
STATUS_FORMAT = "trainwise-agent-status/1"
REFUSED_EXIT_CODE = 2  # a task, a setting or an argument the agent refuses: nothing ran
AGENT_FAILED_EXIT_CODE = 1
TICK_S = 0.05  # how often the loop looks at the job and the signals
MAX_COMMIT_BYTES = 64 * 1024


def _iso(wall_s: float | None) -> str | None:
    if wall_s is None:
        return None
    return datetime.fromtimestamp(wall_s, UTC).isoformat(timespec="milliseconds")


def agent_prefix(run_id: str) -> str:
    return f"runs/{run_id}/agent"


def poll_s() -> float:
    return settings.get_float("TRAINWISE_AGENT_POLL_S", 0.01, 60.0)


def notice_margin_s() -> float:
    return settings.get_float("TRAINWISE_AGENT_NOTICE_MARGIN_S", 0.0, 600.0)


def node_addr() -> str | None:
    """TRAINWISE_AGENT_NODE_ADDR: the address this node is reached at by the other hosts of a
    gang (on EC2 its private IPv4); empty: torchrun's guess from the hostname."""
    value = settings.get("TRAINWISE_AGENT_NODE_ADDR").strip()
    return value or None


def task_wait_s() -> float:
    return settings.get_float("TRAINWISE_AGENT_TASK_WAIT_S", 0.0, 86_400.0)


def telemetry_every_s() -> float:
    return settings.get_float("TRAINWISE_AGENT_TELEMETRY_EVERY_S", 0.1, 86_400.0)


def committed_steps(store: ObjectStore, key_prefix: str) -> dict[int, dict[str, Any]]:
    """step -> commit marker, for every readable marker under key_prefix."""
    found: dict[int, dict[str, Any]] = {}
    for key in store.list_keys(key_prefix):
        if not key.endswith(COMMIT_SUFFIX):
            continue
        try:
            raw = store.get_bytes(key)
            marker = json.loads(raw) if len(raw) <= MAX_COMMIT_BYTES else None
            found[int(marker["step"])] = marker
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged marker commits nothing
    return found


class NodeAgent:
    """One start of the agent on one node (module doc)."""

    def __init__(self, store_root: Path | str, run_id: str, run_dir: Path, *,
                 job_name: str | None = None, choice: WatchChoice | None = None,
                 poll_every_s: float | None = None, margin_s: float | None = None,
                 telemetry_s: float | None = None) -> None:
        # s3://bucket/prefix as given; a folder resolved (the job's spec names it absolutely).
        self.store_root = (str(store_root) if str(store_root).startswith(S3_URI_PREFIX)
                           else str(Path(store_root).resolve()))
        self.run_id, self.run_dir = run_id, Path(run_dir).resolve()
        self.job_name = job_name
        self.node_addr = node_addr()
        self.choice = choice
        self.poll_every_s = poll_s() if poll_every_s is None else poll_every_s
        self.margin_s = notice_margin_s() if margin_s is None else margin_s
        self.telemetry_s = telemetry_every_s() if telemetry_s is None else telemetry_s
        self.store: ObjectStore = store_at(self.store_root)
        self.start_id = (datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-"
                         + uuid.uuid4().hex[:6])
        self.agent_dir = self.run_dir / "agent"
        self.notice_file = self.agent_dir / "notice"
        self.rebalance_file = self.agent_dir / "rebalance"  # AgentTask.run_spec names it so
        self.start_prefix = f"{agent_prefix(run_id)}/starts/{self.start_id}"
        self.status: dict[str, Any] = {
            "format": STATUS_FORMAT, "run_id": run_id, "start_id": self.start_id,
            "host": socket.gethostname(), "node_addr": self.node_addr, "instance_id": None,
            "state": "starting",
            "started_at": _iso(time.time()),
            "ended_at": None, "watching": None, "metadata": None, "metadata_warning": None,
            "job": None, "resumed_from_step": None, "notice": None, "events": [],
            "sigterm_sent_at": None, "killed_at": None, "exit_code": None,
            "job_exit_at": None, "notice_to_exit_s": None, "notice_to_commit_s": None,
            "last_committed_step": None, "telemetry_prefix": f"{self.start_prefix}/telemetry",
            "telemetry_files": 0, "error": None}
        self._signal_wall_s: float | None = None
        self._signal_name = ""
        self._active: Notice | None = None
        self._metadata_down = False

    # -- the record ------------------------------------------------------------------------------
    def _write_status(self) -> None:
        data = (json.dumps(self.status, indent=1) + "\n").encode()
        try:
            self.agent_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.agent_dir / "status.json", data)
        except OSError as error:
            LOG.warning("status record not written locally: %s", error)
        try:
            self.store.put_bytes(data, f"{self.start_prefix}/status.json")
        except OSError as error:
            LOG.warning("status record not put into the store: %s", error)

    def _refuse(self, error: Exception) -> int:
        self.status.update(state="refused", error=str(error), exit_code=REFUSED_EXIT_CODE,
                           ended_at=_iso(time.time()))
        LOG.error("refused, nothing was started: %s", error)
        try:
            self._write_status()
        except Exception:  # noqa: BLE001 - the refusal is what matters; it was logged
            pass
        return REFUSED_EXIT_CODE

    # -- signals ---------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal_wall_s is None:
            self._signal_wall_s, self._signal_name = time.time(), signal.Signals(signum).name

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self.store.check_reachable()
        except ServiceUnreachableError as error:
            LOG.error("%s", error)
            return AGENT_FAILED_EXIT_CODE
        try:
            self._wait_for_task()
            task = read_task(self.store, self.run_id)
            if self.job_name is not None and task.job_name != self.job_name:
                raise AgentTaskError(
                    f"the task names job {task.job_name!r}, the agent was started with --job "
                    f"{self.job_name!r}. Fix: start the agent for the job the launcher put there, "
                    "or regenerate the task")
            choice = self.choice if self.choice is not None else watcher_from_settings()
            notice_s = float(task.spec.get("notice_s", NOTICE_S.get(choice.cloud, 120.0)))
            spec = task.run_spec(self.run_dir, self.store_root, self.notice_file,
                                 notice_s=notice_s)
        except (AgentTaskError, settings.SettingError) as error:
            return self._refuse(error)
        self.status.update(watching=choice.describe, metadata={"cloud": choice.cloud,
                                                                "url": choice.url},
                           metadata_warning=choice.warning)
        if task.gang is not None and self.node_addr is None:
            self.node_addr = self._address_from_metadata(choice)
        self.status["node_addr"] = self.node_addr
        self.status["instance_id"] = self._instance_id(choice)
        try:
            self.agent_dir.mkdir(parents=True, exist_ok=True)
            self.notice_file.unlink(missing_ok=True)  # a stale one from an earlier start
            self.rebalance_file.unlink(missing_ok=True)
            spec_path = write_spec(spec, self.agent_dir / "spec.json")
        except OSError as error:
            LOG.error("the local run folder %s cannot be written (%s); give --run-dir a "
                      "writable folder on the node's disk", self.run_dir, error)
            return AGENT_FAILED_EXIT_CODE
        checkpoint_prefix = f"{spec.checkpoint_key_prefix}/rank{spec.rank}"
        steps = committed_steps(self.store, checkpoint_prefix)
        self.status["resumed_from_step"] = max(steps) if steps else None
        LOG.info("run %s start %s: job %s (%s), watching %s, resuming from step %s",
                 self.run_id, self.start_id, task.job_name,
                 " ".join(task.command(self.node_addr)[1:]),
                 choice.describe, self.status["resumed_from_step"])
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = self._supervise(task, spec_path, spec.telemetry_dir, choice,
                                   float(spec.notice_s))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._finish(code, checkpoint_prefix)
        return code

    @staticmethod
    def _address_from_metadata(choice: WatchChoice) -> str | None:
        """A gang host's address when TRAINWISE_AGENT_NODE_ADDR is not set: on EC2 the
        instance's private IPv4 from IMDSv2 (what the launcher named as the rendezvous host,
        so this node knows whether it hosts the store); elsewhere torchrun's guess."""
        local_ipv4 = getattr(choice.watcher, "local_ipv4", None)
        if local_ipv4 is None:
            return None
        try:
            address = local_ipv4()
        except MetadataUnreachableError as error:
            address, why = None, str(error)
        else:
            why = "it gave no IPv4 address"
        if address is None:
            LOG.warning("no local-ipv4 from %s (%s): torchrun guesses this host's address from "
                        "its hostname; set TRAINWISE_AGENT_NODE_ADDR", choice.url, why)
            return None
        LOG.info("this host's address for the gang: %s (from the metadata service)", address)
        return address

    @staticmethod
    def _instance_id(choice: WatchChoice) -> str | None:
        """The provider's id of this node (for the launcher, which names the nodes whose agent
        never reported): TRAINWISE_AGENT_NODE_ID, else EC2's from IMDSv2; None elsewhere or
        when the metadata service does not say."""
        given = settings.get("TRAINWISE_AGENT_NODE_ID").strip()
        if given:  # the kubernetes provider hands each pod its name
            return given
        instance_id = getattr(choice.watcher, "instance_id", None)
        if instance_id is None:
            return None
        try:
            return instance_id()
        except MetadataUnreachableError:
            return None

    def _wait_for_task(self) -> None:
        """A node can boot before its launcher has written the task (a gang's task names the
        first node's address, known only once EC2 gave it): wait for it, up to
        TRAINWISE_AGENT_TASK_WAIT_S; a SIGTERM meanwhile stops the wait (nothing runs)."""
        key = task_key(self.run_id)
        wait_s = task_wait_s()  # a bad value: SettingError, the agent refuses naming it
        deadline = time.monotonic() + wait_s
        previous = signal.signal(signal.SIGTERM, self._on_signal)
        try:
            logged = False
            while (not self.store.exists(key) and time.monotonic() < deadline
                   and self._signal_wall_s is None):
                if not logged:
                    LOG.info("waiting up to %.0f s for the task %s", wait_s, self.store.uri(key))
                    logged = True
                time.sleep(min(self.poll_every_s, 1.0))
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _supervise(self, task: AgentTask, spec_path: Path, telemetry_dir: Path,
                   choice: WatchChoice, notice_s: float) -> int:
        command = task.command(self.node_addr)
        self.status["job"] = {"name": task.job_name, "command": command,
                              "cwd": str(task.project_dir),
                              "gang": task.to_json().get("gang")}
        self.status["state"] = "running"
        self._write_status()
        self.sync = TelemetrySync(self.store, telemetry_dir, f"{self.start_prefix}/telemetry")
        log_path = self.agent_dir / "job.log"
        with os.fdopen(replace_with_new(log_path), "w") as log:
            started_wall = time.time()
            child = subprocess.Popen(command, cwd=task.project_dir,
                                     env=job_env(task.project_dir, spec_path), stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        found: queue.Queue[Notice] = queue.Queue()
        stop = threading.Event()
        if choice.watcher is not None:
            threading.Thread(target=self._watch, args=(choice, found, stop), daemon=True,
                             name="metadata-watcher").start()
        next_sync_s = time.monotonic()
        try:
            while child.poll() is None:
                now_s = time.monotonic()
                if self._signal_wall_s is not None and self._active is None:
                    wall = self._signal_wall_s
                    self._notice(Notice(self._signal_name, "sigterm", wall, wall + notice_s, True,
                                        {"signal": self._signal_name}))
                while not found.empty():
                    self._notice(found.get_nowait())
                if self._active is not None:
                    self._enforce(child)
                if now_s >= next_sync_s:
                    next_sync_s = now_s + self.telemetry_s
                    self.sync.sync()
                time.sleep(TICK_S)
        finally:
            exit_wall = time.time()
            stop.set()
            if child.poll() is None:  # the agent itself failed: leave nothing running
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            try:  # anything the job left behind in its group
                os.killpg(child.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.status["job_exit_at"] = _iso(exit_wall)
        if self._active is not None:
            self.status["notice_to_exit_s"] = round(exit_wall - self._active.received_wall_s, 3)
        code = child.returncode
        code = 128 - code if code < 0 else code
        return self._gang_code(code, started_wall) if task.gang is not None else code

    def _gang_code(self, torchrun_code: int, started_wall: float) -> int:
        """torchrun exits 1 whenever a rank exits non-zero, so a gang's answer to a notice (every
        rank leaves with 143 at one step) reads as a failure. The ranks' own outcome records of
        this start (`outcome-rank<R>.json` in this node's folder) say what happened: all
        preempted -> 143, all completed -> 0; otherwise torchrun's code stands."""
        statuses = []
        for path in sorted(self.run_dir.glob("outcome-rank*.json")):
            try:
                if path.is_symlink() or path.stat().st_mtime < started_wall:
                    continue  # a link, or an earlier start's record
                statuses.append(json.loads(path.read_text(encoding="utf-8")).get("status"))
            except (OSError, ValueError, AttributeError):
                statuses.append(None)
        if statuses and all(s == "preempted" for s in statuses):
            return PREEMPTED_EXIT_CODE
        if statuses and all(s == "completed" for s in statuses) and torchrun_code == 0:
            return 0
        return torchrun_code

    def _watch(self, choice: WatchChoice, found: queue.Queue, stop: threading.Event) -> None:
        """The watcher's loop, on its own thread: a slow or hung endpoint (each request times
        out in about a second) never delays the agent's answer to the job's exit or a SIGTERM."""
        assert choice.watcher is not None
        while not stop.is_set():
            try:
                notice = choice.watcher.poll()
            except MetadataUnreachableError as error:
                if not self._metadata_down:
                    LOG.warning("metadata endpoint %s stopped answering (%s); still watching "
                                "SIGTERM, and asking it again every %.1f s", choice.url, error,
                                self.poll_every_s)
                    self._metadata_down = True
                notice = None
            except Exception as error:  # noqa: BLE001 - a watcher bug must not end the job
                LOG.error("the %s watcher failed (%s: %s); watching SIGTERM only from now",
                          choice.cloud, type(error).__name__, error)
                return
            else:
                if self._metadata_down:
                    LOG.info("metadata endpoint %s answers again", choice.url)
                    self._metadata_down = False
            if notice is not None:
                found.put(notice)
            stop.wait(self.poll_every_s)

    def _notice(self, notice: Notice) -> None:
        if notice.stops_job and self._active is None:
            self._active = notice
            self.status["notice"] = notice.record()
            payload = json.dumps(notice.record()) + "\n"
            write_atomic(self.notice_file, payload.encode())  # the SDK answers at its next step
            left_s = (notice.ends_wall_s or notice.received_wall_s) - time.time()
            LOG.warning("notice from %s (%s): the node ends in %.1f s; the job was told to "
                        "checkpoint and leave", notice.source, notice.kind, left_s)
        elif notice.kind == "rebalance" and self._active is None:
            # The node's risk went up, its end is not set: the job checkpoints at its next fast
            # tick (to the store) and goes on, so a reclaim that follows loses less.
            write_atomic(self.rebalance_file, (json.dumps(notice.record()) + "\n").encode())
            LOG.info("recorded %s (%s): the job was asked for a checkpoint", notice.source,
                     notice.kind)
        else:
            LOG.info("recorded %s (%s)%s", notice.source, notice.kind,
                     "" if not notice.stops_job else " after the first notice")
        self.status["events"].append(notice.record())
        self._write_status()

    def _enforce(self, child: subprocess.Popen) -> None:
        """SIGTERM the job when the notice's end is `margin_s` away; kill it `margin_s` after."""
        notice = self._active
        assert notice is not None
        ends = notice.ends_wall_s if notice.ends_wall_s is not None else notice.received_wall_s
        now = time.time()
        if self.status["sigterm_sent_at"] is None and now >= ends - self.margin_s:
            LOG.warning("the job has not left %.1f s before the notice's end: SIGTERM",
                        ends - now)
            self.status["sigterm_sent_at"] = _iso(now)
            self._signal_group(child, signal.SIGTERM)
        elif self.status["killed_at"] is None and now >= ends + self.margin_s:
            LOG.error("the job is still running %.1f s after the notice's end: killed", now - ends)
            self.status["killed_at"] = _iso(now)
            self._signal_group(child, signal.SIGKILL)

    @staticmethod
    def _signal_group(child: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(child.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _finish(self, code: int, checkpoint_prefix: str) -> None:
        state = ("completed" if code == 0 else "preempted" if code == PREEMPTED_EXIT_CODE
                 else "failed")
        steps = committed_steps(self.store, checkpoint_prefix)
        last = max(steps) if steps else None
        self.status.update(state=state, exit_code=code, last_committed_step=last,
                           ended_at=_iso(time.time()))
        if self._active is not None and last is not None:
            committed = parse_time(steps[last].get("committed_at"))
            if committed is not None and committed >= self._active.received_wall_s:
                self.status["notice_to_commit_s"] = round(
                    committed - self._active.received_wall_s, 3)
        if code not in (0, PREEMPTED_EXIT_CODE):
            self.status["error"] = f"the job exited {code}; see {self.start_prefix}/job.log"
        self._write_status()  # first: the node may be gone before the telemetry is copied
        self.sync.sync()
        for name in ("job.log", "spec.json"):
            try:
                self.store.put_file(self.agent_dir / name, f"{self.start_prefix}/{name}")
            except OSError as error:
                LOG.warning("%s not put into the store: %s", name, error)
        for outcome in sorted(self.run_dir.glob("outcome-rank*.json")):
            if outcome.is_file() and not outcome.is_symlink():
                self.store.put_file(outcome, f"{self.start_prefix}/{outcome.name}")
        self.status["telemetry_files"] = self.sync.files
        self._write_status()
        LOG.info("job exited %d (%s); last committed step %s; notice to exit %s s", code,
                 state, last, self.status["notice_to_exit_s"])
