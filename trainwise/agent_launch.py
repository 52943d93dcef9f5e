"""A team's registered job run by node agents on the nodes a provider launches (aws).

`UserJobLaunch` (`trainwise.user_jobs`) runs the job in this process's machine; with a provider
whose nodes boot the node agent (`ComputeProvider.boots_node_agent`: aws, built by `for_run`
with the run id, the store and the job name, so each node's user-data starts
`python -m trainwise.agent`), `AgentJobLaunch` runs it on the nodes instead. In order:

1. The session launches the allocation and waits until EC2 says running (`GangSession.start`).
2. The launcher writes the run's task into the store (`trainwise.agent.task.put_task`): the
   job's entry and arguments, its project folder on the node (TRAINWISE_NODE_PROJECT_DIR), the
   run-spec fields, and for more than one node a `gang` whose rendezvous endpoint is the first
   node's private address (`node_address`) and whose `rdzv_id` is new for each launch. The
   agents wait for it (TRAINWISE_AGENT_TASK_WAIT_S): a node can boot before the task exists.
3. It follows the agents through the store only (what a launcher on another machine can see):
   each agent start writes `runs/<run_id>/agent/starts/<start_id>/status.json`, its telemetry
   and its outcome there. The telemetry is copied into the run folder as the agents put it
   (`trainwise.remote_telemetry`), so `explain`, the sensor, MLflow and Prometheus read a
   remote run as a local one. The provider's clock runs once every node's agent runs the job; a
   node whose agent reports nothing within `boot_timeout_s` fails the run with the fix (the
   node's `/var/log/trainwise/agent-<run_id>.log` and its console output).
4. The node learns of its end itself (IMDSv2 spot/instance-action on EC2): its agent has the
   job checkpoint to the store and exits 143. The launcher sees that exit, or EC2's reclaim
   (`GangSession.check`), deletes the task, releases what is left of the launch
   (`GangSession.replace`: terminating an instance is the SIGTERM its agent answers) and
   launches the replacement, whose agents resume from the store. A stop the launcher itself
   asks for (the slow layer's new allocation in the run folder, read at each poll) terminates
   the nodes: their agents answer the shutdown's SIGTERM the same way, and the new allocation
   is launched.
5. Every agent of a launch exiting 0 with a completed outcome ends the run; an agent that
   refused the task or whose job failed fails it, with the agent's error and its job log's tail
   from the store. `user_job.json` records each launch (nodes, agent starts, exit codes).

The store is the deployment's S3 bucket (`s3://bucket/prefix`, `trainwise.object_store.store_at`)
or a folder every node mounts at the same path. What is not done here: a gang is relaunched
whole after a reclaim (its surviving nodes are released too).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloud.providers import provider_class
from cloud.providers import provider_name as cloud_provider_name
from telemetry.reader import step_records_written
from training.run_lock import RunFolderLock
from training.safe_files import write_atomic
from trainwise import settings
from trainwise.agent.agent import STATUS_FORMAT, agent_prefix
from trainwise.agent.task import AgentTask, GangSpec, parse_task, put_task, task_key
from trainwise.gang import PROVIDER_RANK, GangSession
from trainwise.object_store import ObjectStore, store_at
from trainwise.remote_telemetry import TelemetryMirror
from trainwise.sdk.spec import PREEMPTED_EXIT_CODE, RunSpec
from trainwise.user_jobs import RECORD_FILE, spec_for_framework
from trainwise.user_project import JobSpec

RDZV_PORT = 29400
LOG_TAIL_CHARS = 2000
# Run-spec fields the task may not carry: the agent sets these on the node, torchrun the ranks.
_NODE_SETS = ("run_id", "run_dir", "store_root", "notice_file", "rebalance_file", "rank",
              "world_size")


def runs_on_nodes(provider_name: str | None = None) -> bool:
    """True when the selected provider's nodes boot the node agent (the job runs on them)."""
    return bool(provider_class(cloud_provider_name(provider_name)).boots_node_agent)


def node_project_dir(project_dir: Path) -> str:
    """Where the nodes hold the project: TRAINWISE_NODE_PROJECT_DIR, else `project_dir`'s own
    path (an image built with the project at the same place)."""
    configured = settings.get("TRAINWISE_NODE_PROJECT_DIR").strip()
    if configured and not configured.startswith("/"):
        raise settings.SettingError(f"TRAINWISE_NODE_PROJECT_DIR={configured!r} is not an "
                                    "absolute path; give the folder the node's image holds "
                                    "the project in")
    return configured or str(Path(project_dir).resolve())


def task_for(job: JobSpec, project_dir_on_node: str, spec: RunSpec,
             gang: GangSpec | None = None) -> AgentTask:
    """The task document for one launch (checked as the agent will check it, less what only
    the node can: its folder and script)."""
    fields = {k: v for k, v in spec.to_json().items() if k != "format" and k not in _NODE_SETS}
    task = AgentTask(run_id=spec.run_id, job_name=job.name,
                     project_dir=Path(project_dir_on_node), entry=job.entry,
                     args=tuple(job.args), spec=fields, gang=gang)
    return parse_task(task.to_json(), f"the task of run {spec.run_id!r}", on_node=False)


def _read_json(store: ObjectStore, key: str) -> dict[str, Any] | None:
    try:
        data = json.loads(store.get_bytes(key))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class AgentJobLaunch:
    """One registered job's run by the node agents of the session's nodes (module doc)."""

    job: JobSpec
    project_dir: Path
    session: GangSession
    spec: RunSpec  # run_id, run_dir (the launcher's record folder), store_root, max_steps, ...
    boot_timeout_s: float = 900.0  # launch to the agents' first status record
    # Every agent running to the job's first step record in the copied telemetry (a job that
    # never calls run.step() is stopped, as on the emulated provider's nodes).
    first_step_timeout_s: float = 300.0
    segment_timeout_s: float = 86_400.0
    poll_s: float = 1.0
    telemetry_every_s: float = 5.0  # how often the agents' telemetry is copied here
    join_timeout_s: float = 600.0  # a gang's hosts wait this long for all to join (torchrun's)
    # After the nodes are gone, how long an agent may still take to report its checkpoint (an
    # EC2 shutdown gives processes about 90 s; a spot notice 120 s before it).
    stop_grace_s: float = 150.0
    launches: list[dict[str, Any]] = field(default_factory=list)
    failure: str = ""

    def __post_init__(self) -> None:
        if self.spec.store_root is None:
            raise ValueError(f"job {self.job.name!r}: a job on agent nodes needs store_root "
                             "(s3://bucket/prefix, or a folder every node mounts: the task, "
                             "checkpoints and telemetry travel through it)")
        self.store = store_at(self.spec.store_root)
        self.node_dir = node_project_dir(self.project_dir)
        self.mirror = TelemetryMirror(self.store, self.spec.run_id, self.run_dir,
                                      provider_rank=PROVIDER_RANK)
        self._gone_at: float | None = None  # when the launch's nodes were all seen gone

    @property
    def run_dir(self) -> Path:
        return Path(self.spec.run_dir)

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Holds the run folder while it follows the nodes, as a local trainer does: the
        orphan-node sensor keeps a run's nodes while a process holds its folder
        (`trainwise.orphan_nodes`), and a second launch of the same run is refused."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with RunFolderLock(self.run_dir):
            return self._run()

    def _run(self) -> dict[str, Any]:
        self.spec = spec_for_framework(self.job, self.spec)
        task_for(self.job, self.node_dir, self.spec)  # a bad spec or entry: refused, no node
        self.session.on_stop = self._tell
        self.session.runs_on = "node agents"
        self.store.delete(task_key(self.spec.run_id))  # an earlier run's task is not this one's
        status = "interrupted"
        try:
            if not self.session.nodes:
                self.session.start()
            while True:
                code = self._launch(len(self.launches))
                self.store.delete(task_key(self.spec.run_id))  # replacements wait for theirs
                if code == 0:
                    status = "completed"
                    break
                if code == PREEMPTED_EXIT_CODE:
                    if not self.session.stop_reason:  # the node heard it before EC2 said so
                        self.session.node_noticed("the node's agent answered its notice "
                                                  "(exit 143)")
                    if not self.session.replace():
                        self.failure = self.session.failure
                        break
                    continue
                status = "failed"
                break
        finally:
            record = self.session.close(status)
        outcome = self._outcome()
        result = {"job": self.job.name, "entry": self.job.entry, "run_id": self.spec.run_id,
                  "status": status, "failure": self.failure, "engine": "node_agent",
                  "segments": self.launches, "reclaims": record.get("reclaims"),
                  "cost_usd": record.get("cost_usd"),
                  "steps": int((outcome or {}).get("step") or 0), "outcome": outcome}
        write_atomic(self.run_dir / RECORD_FILE, (json.dumps(result, indent=1, default=str)
                                                  + "\n").encode())
        return result

    def _gang(self, index: int) -> GangSpec | None:
        nodes = self.session.nodes
        if len(nodes) == 1:
            return None
        address = self.session.provider.node_address(nodes[0])
        if not address:
            raise ValueError(f"provider {self.session.provider.name!r} gives no address for "
                             f"node {nodes[0].node_id}: a gang of {len(nodes)} nodes needs the "
                             "first node's address for its rendezvous")
        return GangSpec(len(nodes), 1, f"{address}:{RDZV_PORT}",
                        f"{self.spec.run_id}-launch-{index}", int(self.join_timeout_s))

    def _launch(self, index: int) -> int:
        """Writes the task for the nodes held now and follows their agents to the end: 0 (all
        completed), 143 (a notice answered, or the nodes reclaimed), else the failing code."""
        starts_prefix = f"{agent_prefix(self.spec.run_id)}/starts"
        before = self._starts(starts_prefix)
        nodes = list(self.session.nodes)
        gang = self._gang(index)
        put_task(self.store, task_for(self.job, self.node_dir, self.spec, gang))
        began = time.monotonic()
        record: dict[str, Any] = {
            "index": index, "nodes": [f"{n.node_id} ({n.market} in {n.zone})" for n in nodes],
            "gang": None if gang is None else gang.rdzv_endpoint, "starts": {},
            "returncode": None, "status": None, "step": None, "stop_reason": ""}
        self.launches.append(record)
        clock_running = False
        code: int | None = None
        next_mirror_s = began
        steps_before = self._steps_seen()
        running_since: float | None = None  # every agent's job running, no step seen yet
        self._gone_at = None
        while code is None:
            if time.monotonic() >= next_mirror_s:  # explain, the sensor, Prometheus read it
                next_mirror_s = time.monotonic() + self.telemetry_every_s
                self.mirror.sync()
            statuses = {sid: s for sid, s in self._statuses(starts_prefix, before).items()}
            record["starts"] = {sid: {"host": s.get("host"), "state": s.get("state"),
                                      "exit_code": s.get("exit_code"),
                                      "resumed_from_step": s.get("resumed_from_step"),
                                      "last_committed_step": s.get("last_committed_step")}
                                for sid, s in statuses.items()}
            waited_s = time.monotonic() - began
            running = [s for s in statuses.values() if s.get("state") == "running"]
            ended = [s for s in statuses.values()
                     if s.get("exit_code") is not None or s.get("state") == "refused"]
            if not clock_running and len(running) + len(ended) >= len(nodes):
                clock_running = True
                self.session.resume_clock()
                running_since = time.monotonic()
            if clock_running:
                self.session.check()
            code = self._judge(statuses, ended, len(nodes), waited_s)
            if running_since is not None and code is None:
                if self._steps_seen() > steps_before:
                    running_since = None
                elif time.monotonic() - running_since > self.first_step_timeout_s:
                    self.failure = (
                        f"job {self.job.name!r} called run.step() not once in "
                        f"{self.first_step_timeout_s:.0f} s on its node(s); a job under "
                        "trainwise calls run.step() after each optimizer step (or uses the "
                        "trainwise callback of its framework), see docs/sdk.md; its job log "
                        f"is under {agent_prefix(self.spec.run_id)}/starts in the store")
                    code = 1
            if code is None and waited_s > self.segment_timeout_s:
                self.failure = (f"job {self.job.name!r} launch {index} ran over "
                                f"{self.segment_timeout_s:.0f} s")
                code = 1
            if code is None:
                time.sleep(self.poll_s)
        self.mirror.sync()  # the agents' last copies (they sync once more at their end)
        outcome = self._outcome()
        record.update(returncode=code, status=(outcome or {}).get("status"),
                      step=(outcome or {}).get("step"), stop_reason=self.session.stop_reason,
                      wall_s=round(time.monotonic() - began, 3))
        return code

    def _judge(self, statuses: dict[str, dict[str, Any]], ended: list[dict[str, Any]],
               nodes: int, waited_s: float) -> int | None:
        for status in ended:
            if status.get("state") in ("refused", "failed"):
                self.failure = self._agent_failure(status) + self._missing(statuses)
                return int(status.get("exit_code") or 1)
        if len(ended) >= nodes:
            if all(s.get("state") == "completed" for s in ended):
                return 0
            return PREEMPTED_EXIT_CODE
        if self.session.stop_reason and not self._alive():
            # Every node is gone (reclaimed or released). An agent still committing on its
            # shutdown's SIGTERM reports within the grace; one that says nothing more is gone:
            # what the store holds then is what the replacement resumes from.
            if self._gone_at is None:
                self._gone_at = time.monotonic()
            if time.monotonic() - self._gone_at >= self.stop_grace_s:
                return PREEMPTED_EXIT_CODE
        if len(statuses) < nodes and waited_s > self.boot_timeout_s:
            self.failure = (f"{nodes - len(statuses)} of {nodes} node agents of run "
                            f"{self.spec.run_id!r} did not report within "
                            f"{self.boot_timeout_s:.0f} s of the launch"
                            + self._missing(statuses))
            return 1
        return None

    def _missing(self, statuses: dict[str, dict[str, Any]]) -> str:
        """The nodes of this launch whose agent never reported (the agent records its EC2
        instance id), with where to look; "" when every node's did."""
        reported = {s.get("instance_id") for s in statuses.values()}
        missing = [n.node_id for n in self.session.nodes if n.node_id not in reported]
        if not missing or len(statuses) >= len(self.session.nodes):
            return ""
        return (f"; no agent reported from node(s) {', '.join(missing)}: their user-data or "
                f"agent did not start (a gang's other hosts wait for them to join), see the "
                f"node's /var/log/trainwise/agent-{self.spec.run_id}.log and its console "
                "output (the AMI must have trainwise installed and mount the store at the "
                "same path, docs/agent.md)")

    def _alive(self) -> bool:
        provider = self.session.provider
        return any(provider.describe(n).state.alive for n in self.session.nodes)

    def _agent_failure(self, status: dict[str, Any]) -> str:
        prefix = f"{agent_prefix(self.spec.run_id)}/starts/{status.get('start_id')}"
        try:
            log = self.store.get_bytes(f"{prefix}/job.log").decode(errors="replace")
        except OSError:
            log = "(no job log in the store)"
        return (f"job {self.job.name!r}: the agent on {status.get('host')} ended "
                f"{status.get('state')} (exit {status.get('exit_code')}): {status.get('error')}; "
                f"its job log ends:\n{log[-LOG_TAIL_CHARS:].strip() or '(empty log)'}")

    def _tell(self, nodes: list[Any], reason: str) -> dict[str, Any]:
        """A reclaimed node hears its own notice (its metadata service). A stop of ours (the
        slow layer's new allocation) terminates the nodes: an instance's shutdown SIGTERMs its
        agent, which has the job checkpoint to the store and leave (exit 143); then the
        launcher launches the new allocation, which resumes from the store."""
        if reason.startswith("reclaim"):
            return {"what": "the nodes' agents answer their own notice (IMDSv2)"}
        ended = []
        for node in self.session.nodes:
            if self.session.provider.describe(node).state.alive:
                self.session.provider.terminate(node, "released: " + reason[:60])
                ended.append(node.node_id)
        return {"what": f"terminated {', '.join(ended) or 'no node'}: their agents checkpoint "
                        "on the shutdown's SIGTERM", "terminated": ended}

    # -- the store -------------------------------------------------------------------------------
    def _starts(self, prefix: str) -> set[str]:
        return {key.split("/")[-2] for key in self.store.list_keys(prefix)
                if key.endswith("/status.json")}

    def _statuses(self, prefix: str, before: set[str]) -> dict[str, dict[str, Any]]:
        found = {}
        for start in sorted(self._starts(prefix) - before):
            status = _read_json(self.store, f"{prefix}/{start}/status.json")
            if status is not None and status.get("format") == STATUS_FORMAT \
                    and status.get("run_id") == self.spec.run_id:
                found[start] = status
        return found

    def _steps_seen(self) -> int:
        """Rank 0's step records in the telemetry copied from the store so far."""
        return step_records_written(self.run_dir / "telemetry" / self.spec.run_id,
                                    self.spec.rank)

    def _outcome(self) -> dict[str, Any] | None:
        """Rank 0's outcome of the newest start that wrote one."""
        prefix = f"{agent_prefix(self.spec.run_id)}/starts"
        keys = sorted(k for k in self.store.list_keys(prefix)
                      if k.endswith(f"/outcome-rank{self.spec.rank}.json"))
        return _read_json(self.store, keys[-1]) if keys else None


__all__ = ["AgentJobLaunch", "RDZV_PORT", "node_project_dir", "runs_on_nodes", "task_for"]
