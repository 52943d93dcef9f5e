"""The agent task: what a launcher tells a node's agent to run (one strict JSON in the store).

The launcher puts it at `runs/<run_id>/agent/task.json` (`task_key`, `put_task`) before the node
starts; the agent reads it (`read_task`) and refuses it whole, naming the key and the fix,
before anything runs:

    {"format": "trainwise-agent-task/1",
     "run_id": "blobs-7",
     "job": {"name": "blobs-classifier",          # what --job checks, if given
             "project_dir": "/srv/project",       # an absolute folder on the node
             "entry": "train.py",                 # a script in project_dir, or pkg.module:function
             "args": ["--max-steps", "40"]},      # strings, passed as argv (no shell)
     "spec": {"max_steps": 40, "seed": 0},        # run-spec fields (trainwise.sdk.spec.RunSpec)
     "gang": {"nodes": 3, "procs_per_node": 1,    # optional: a multi-host gang under torchrun
              "rdzv_endpoint": "10.0.1.5:29400", "rdzv_id": "blobs-7-launch-2",
              "join_timeout_s": 600}}                # optional: torchrun's join timeout

The document is data: the only thing the agent ever runs from it is the declared entry, as
`python <project_dir>/<script> ARGS...` or `python -m trainwise.sdk.entry ENTRY ARGS...`, with
no shell and no environment taken from it. With a `gang`, the same entry runs under torchrun
(`python -m torch.distributed.run`) with c10d rendezvous at the endpoint the provider gives
(one node hosts it: the one whose address is the endpoint's host), `nodes` hosts of
`procs_per_node` ranks each; torchrun gives each rank its RANK and WORLD_SIZE, and the SDK
joins the process group from them. The spec's `run_dir`, `store_root`, `notice_file` and
`rebalance_file` are the agent's to set (the node's own folder, the store it was given, its notice file).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwise.sdk.spec import RunSpec, RunSpecError, with_fields

TASK_FORMAT = "trainwise-agent-task/1"
TASK_LIMIT_BYTES = 1 << 20
MAX_ARGS = 256
MAX_ARG_CHARS = 4096
_TOP_KEYS = {"format": str, "run_id": str, "job": dict, "spec": dict, "gang": dict}
_GANG_KEYS = {"nodes": int, "procs_per_node": int, "rdzv_endpoint": str, "rdzv_id": str,
              "join_timeout_s": int}
MAX_JOIN_TIMEOUT_S = 86_400
MAX_GANG_NODES, MAX_PROCS_PER_NODE = 1024, 64
# host:port, the host a DNS name or an IPv4 address (no shell metacharacters reach torchrun's
# argv anyway: it is a list, but a value that is not an endpoint is refused by name here).
_ENDPOINT = re.compile(r"(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?)"
                       r":(?P<port>[0-9]{1,5})")
_JOB_KEYS = {"name": str, "project_dir": str, "entry": str, "args": list}
_JOB_REQUIRED = ("name", "project_dir", "entry")
# spec fields a task may not give
AGENT_SETS = ("run_dir", "store_root", "notice_file", "rebalance_file")
_MODULE_ENTRY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FIX = "the launcher writes this document (trainwise.agent.task.put_task); regenerate it"


class AgentTaskError(ValueError):
    """A task document the agent refuses; the message names the key and the fix."""


@dataclass(frozen=True)
class GangSpec:
    """A multi-host gang: `nodes` hosts, each running `procs_per_node` ranks under torchrun,
    meeting at `rdzv_endpoint` (c10d) under `rdzv_id` (new for each launch of the gang)."""

    nodes: int
    procs_per_node: int
    rdzv_endpoint: str
    rdzv_id: str
    # How long the hosts wait for all of them to join (torchrun's join_timeout, 600 s unless
    # given): a host whose boot failed ends the others' wait, and the launcher names it.
    join_timeout_s: int | None = None

    @property
    def host(self) -> str:
        return self.rdzv_endpoint.rsplit(":", 1)[0]

    def torchrun(self, node_addr: str | None) -> list[str]:
        """torchrun's arguments for this node. The node whose address is the endpoint's host
        hosts the rendezvous store (`is_host`): torchrun guesses it from the hostname, which
        is wrong where a host's name does not resolve to the address peers reach."""
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes),
                "--nproc-per-node", str(self.procs_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id,
                "--max-restarts", "0"]
        conf = []
        if node_addr:
            conf.append(f"is_host={str(node_addr == self.host).lower()}")
        if self.join_timeout_s is not None:
            conf.append(f"join_timeout={self.join_timeout_s}")
        if conf:
            argv += ["--rdzv-conf", ",".join(conf)]
        if node_addr:
            argv += ["--local-addr", node_addr]
        return argv


@dataclass(frozen=True)
class AgentTask:
    run_id: str
    job_name: str
    project_dir: Path
    entry: str
    args: tuple[str, ...]
    spec: dict[str, Any]  # run-spec fields, checked against RunSpec
    gang: GangSpec | None = None

    @property
    def entry_kind(self) -> str:
        return "module" if _MODULE_ENTRY.fullmatch(self.entry) else "script"

    @property
    def script(self) -> Path | None:
        return self.project_dir / self.entry if self.entry_kind == "script" else None

    def command(self, node_addr: str | None = None) -> list[str]:
        """The one command the task may start (argv, no shell); under torchrun for a gang, with
        `node_addr` the address this node is reached at (the agent's setting)."""
        if self.gang is None:
            if self.script is not None:
                return [sys.executable, str(self.script), *self.args]
            return [sys.executable, "-m", "trainwise.sdk.entry", self.entry, *self.args]
        runner = self.gang.torchrun(node_addr)
        if self.script is not None:
            return [*runner, str(self.script), *self.args]
        return [*runner, "-m", "trainwise.sdk.entry", self.entry, *self.args]

    def run_spec(self, run_dir: Path, store_root: Path | str, notice_file: Path,
                 **agent_fields: Any) -> RunSpec:
        """The node's run spec: the task's fields plus what the agent sets."""
        base = RunSpec(run_id=self.run_id, run_dir=str(run_dir))
        try:
            return with_fields(base, **{**self.spec, **agent_fields, "run_dir": str(run_dir),
                                        "store_root": str(store_root),
                                        "notice_file": str(notice_file),
                                        # beside the notice file, in the agent's folder
                                        "rebalance_file": str(Path(notice_file).with_name(
                                            "rebalance"))})
        except RunSpecError as error:
            raise AgentTaskError(f"task key 'spec': {error}; {FIX}") from error

    def to_json(self) -> dict[str, Any]:
        return {"format": TASK_FORMAT, "run_id": self.run_id,
                "job": {"name": self.job_name, "project_dir": str(self.project_dir),
                        "entry": self.entry, "args": list(self.args)},
                "spec": dict(self.spec),
                **({"gang": {"nodes": self.gang.nodes, "procs_per_node": self.gang.procs_per_node,
                             "rdzv_endpoint": self.gang.rdzv_endpoint,
                             "rdzv_id": self.gang.rdzv_id,
                             **({"join_timeout_s": self.gang.join_timeout_s}
                                if self.gang.join_timeout_s is not None else {})}}
                   if self.gang else {})}


def _parse_gang(gang: dict[str, Any], where: str) -> GangSpec:
    for key, value in gang.items():
        if key not in _GANG_KEYS:
            raise AgentTaskError(f"{where}: unknown key 'gang.{key}'; known: "
                                 f"{', '.join(sorted(_GANG_KEYS))}. Fix: {FIX}")
        if isinstance(value, bool) or not isinstance(value, _GANG_KEYS[key]):
            raise AgentTaskError(f"{where}: key 'gang.{key}' is {type(value).__name__} "
                                 f"{value!r:.80}. Fix: {FIX}")
    for key in ("nodes", "rdzv_endpoint", "rdzv_id"):
        if key not in gang:
            raise AgentTaskError(f"{where}: key 'gang.{key}' is missing. Fix: {FIX}")
    nodes, procs = gang["nodes"], gang.get("procs_per_node", 1)
    if not 1 <= nodes <= MAX_GANG_NODES or not 1 <= procs <= MAX_PROCS_PER_NODE:
        raise AgentTaskError(f"{where}: 'gang.nodes' {nodes} must be 1-{MAX_GANG_NODES} and "
                             f"'gang.procs_per_node' {procs} 1-{MAX_PROCS_PER_NODE}. Fix: {FIX}")
    endpoint = _ENDPOINT.fullmatch(gang["rdzv_endpoint"])
    if endpoint is None or not 1 <= int(endpoint["port"]) <= 65535:
        raise AgentTaskError(f"{where}: 'gang.rdzv_endpoint' {gang['rdzv_endpoint']!r:.80} is "
                             "not host:port (a DNS name or IPv4 address, a port 1-65535). Fix: "
                             "give the address the provider gave the gang's first node")
    if not _JOB_NAME.fullmatch(gang["rdzv_id"]):
        raise AgentTaskError(f"{where}: 'gang.rdzv_id' {gang['rdzv_id']!r:.80} must match "
                             f"{_JOB_NAME.pattern}. Fix: {FIX}")
    join_timeout_s = gang.get("join_timeout_s")
    if join_timeout_s is not None and not 1 <= join_timeout_s <= MAX_JOIN_TIMEOUT_S:
        raise AgentTaskError(f"{where}: 'gang.join_timeout_s' {join_timeout_s} must be "
                             f"1-{MAX_JOIN_TIMEOUT_S} seconds. Fix: {FIX}")
    return GangSpec(nodes, procs, gang["rdzv_endpoint"], gang["rdzv_id"], join_timeout_s)


def task_key(run_id: str) -> str:
    return f"runs/{run_id}/agent/task.json"


def _check_keys(data: dict[str, Any], allowed: dict[str, type], where: str) -> None:
    for key, value in data.items():
        if key not in allowed:
            raise AgentTaskError(f"{where}: unknown key {key!r}; known: "
                                 f"{', '.join(sorted(allowed))}. Fix: remove or rename it; {FIX}")
        kind = allowed[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise AgentTaskError(f"{where}: key {key!r} is {type(value).__name__} "
                                 f"{value!r:.80}, it must be a JSON "
                                 f"{ {str: 'string', dict: 'object', list: 'array'}[kind]}. "
                                 f"Fix: {FIX}")


def parse_task(data: Any, where: str = "agent task", *, on_node: bool = True) -> AgentTask:
    """A checked AgentTask, or AgentTaskError naming the key and the fix. `on_node` False (the
    launcher's side) leaves out what only the node can check: the folder and script exist."""
    if not isinstance(data, dict):
        raise AgentTaskError(f"{where} is not a JSON object; {FIX}")
    if data.get("format") != TASK_FORMAT:
        raise AgentTaskError(f"{where}: key 'format' is {data.get('format')!r}, this agent reads "
                             f"{TASK_FORMAT!r}. Fix: {FIX} with this trainwise version")
    _check_keys(data, _TOP_KEYS, where)
    for key in ("run_id", "job", "spec"):
        if key not in data:
            raise AgentTaskError(f"{where}: key {key!r} is missing. Fix: {FIX}")
    job = data["job"]
    _check_keys(job, _JOB_KEYS, f"{where} 'job'")
    for key in _JOB_REQUIRED:
        if key not in job:
            raise AgentTaskError(f"{where}: key 'job.{key}' is missing. Fix: {FIX}")
    if not _JOB_NAME.fullmatch(job["name"]):
        raise AgentTaskError(f"{where}: key 'job.name' {job['name']!r} must match "
                             f"{_JOB_NAME.pattern}. Fix: {FIX}")
    args = job.get("args", [])
    if len(args) > MAX_ARGS or any(not isinstance(a, str) or len(a) > MAX_ARG_CHARS or "\0" in a
                                   for a in args):
        raise AgentTaskError(f"{where}: key 'job.args' must be at most {MAX_ARGS} strings of at "
                             f"most {MAX_ARG_CHARS} characters without NUL. Fix: {FIX}")
    project_dir = Path(job["project_dir"])
    if not project_dir.is_absolute() or (on_node and not project_dir.is_dir()):
        raise AgentTaskError(f"{where}: key 'job.project_dir' {job['project_dir']!r} is not an "
                             "absolute path to a folder on this node. Fix: name the folder the "
                             "node's image holds the project in")
    project_dir = project_dir.resolve() if on_node else project_dir
    entry = job["entry"]
    if not _MODULE_ENTRY.fullmatch(entry):
        script = (project_dir / entry).resolve() if on_node else project_dir / entry
        if (Path(entry).is_absolute() or not entry.endswith(".py") or ".." in Path(entry).parts
                or not script.is_relative_to(project_dir) or (on_node and not script.is_file())):
            raise AgentTaskError(
                f"{where}: key 'job.entry' {entry!r} is neither package.module:function nor a "
                f".py script inside job.project_dir ({project_dir}). Fix: name a script "
                "relative to the project folder, or a module entry")
    spec = data["spec"]
    for key in AGENT_SETS:
        if key in spec:
            raise AgentTaskError(f"{where}: key 'spec.{key}' is the agent's to set (the node's "
                                 "own folder, store and notice file). Fix: remove it from the "
                                 "task")
    if spec.get("run_id", data["run_id"]) != data["run_id"]:
        raise AgentTaskError(f"{where}: key 'spec.run_id' {spec['run_id']!r} differs from "
                             f"run_id {data['run_id']!r}. Fix: remove spec.run_id")
    if spec.get("world_size", 1) != 1 or spec.get("rank", 0) != 0:
        raise AgentTaskError(f"{where}: keys 'spec.world_size'/'spec.rank' are torchrun's to "
                             "give each rank. Fix: remove them; a multi-host gang is the task's "
                             "'gang' key")
    gang = _parse_gang(data["gang"], where) if "gang" in data else None
    task = AgentTask(run_id=data["run_id"], job_name=job["name"], project_dir=project_dir,
                     entry=entry, args=tuple(args),
                     spec={k: v for k, v in spec.items() if k != "run_id"}, gang=gang)
    task.run_spec(Path("/nonexistent/run"), Path("/nonexistent/store"),
                  Path("/nonexistent/notice"))  # every field and type, checked now
    return task


def read_task(store: Any, run_id: str) -> AgentTask:
    key = task_key(run_id)
    where = f"agent task {store.uri(key)}"
    try:
        raw = store.get_bytes(key)
    except FileNotFoundError as error:
        raise AgentTaskError(f"{where} does not exist. Fix: the launcher puts the task there "
                             "before the node starts (put_task); check --store and --run-id"
                             ) from error
    if len(raw) > TASK_LIMIT_BYTES:
        raise AgentTaskError(f"{where} is {len(raw)} bytes, more than {TASK_LIMIT_BYTES}. "
                             f"Fix: {FIX}")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AgentTaskError(f"{where} is not JSON ({error}). Fix: {FIX}") from error
    task = parse_task(data, where)
    if task.run_id != run_id:
        raise AgentTaskError(f"{where}: key 'run_id' is {task.run_id!r}, the agent was started "
                             f"for {run_id!r}. Fix: {FIX}")
    return task


def put_task(store: Any, task: AgentTask | dict[str, Any]) -> str:
    """The launcher's side: check the task and put it where the agent reads it."""
    checked = task if isinstance(task, AgentTask) else parse_task(task, on_node=False)
    return store.put_bytes((json.dumps(checked.to_json(), indent=1) + "\n").encode(),
                           task_key(checked.run_id))
