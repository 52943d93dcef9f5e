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
     "spec": {"max_steps": 40, "seed": 0}}        # run-spec fields (trainwise.sdk.spec.RunSpec)

The document is data: the only thing the agent ever runs from it is the declared entry, as
`python <project_dir>/<script> ARGS...` or `python -m trainwise.sdk.entry ENTRY ARGS...`, with
no shell and no environment taken from it. The spec's `run_dir`, `store_root` and `notice_file`
are the agent's to set (the node's own folder, the store it was given, its notice file).
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
_TOP_KEYS = {"format": str, "run_id": str, "job": dict, "spec": dict}
_JOB_KEYS = {"name": str, "project_dir": str, "entry": str, "args": list}
_JOB_REQUIRED = ("name", "project_dir", "entry")
AGENT_SETS = ("run_dir", "store_root", "notice_file")  # spec fields a task may not give
_MODULE_ENTRY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FIX = "the launcher writes this document (trainwise.agent.task.put_task); regenerate it"


class AgentTaskError(ValueError):
    """A task document the agent refuses; the message names the key and the fix."""


@dataclass(frozen=True)
class AgentTask:
    run_id: str
    job_name: str
    project_dir: Path
    entry: str
    args: tuple[str, ...]
    spec: dict[str, Any]  # run-spec fields, checked against RunSpec

    @property
    def entry_kind(self) -> str:
        return "module" if _MODULE_ENTRY.fullmatch(self.entry) else "script"

    @property
    def script(self) -> Path | None:
        return self.project_dir / self.entry if self.entry_kind == "script" else None

    def command(self) -> list[str]:
        """The one command the task may start (argv, no shell)."""
        if self.script is not None:
            return [sys.executable, str(self.script), *self.args]
        return [sys.executable, "-m", "trainwise.sdk.entry", self.entry, *self.args]

    def run_spec(self, run_dir: Path, store_root: Path, notice_file: Path,
                 **agent_fields: Any) -> RunSpec:
        """The node's run spec: the task's fields plus what the agent sets."""
        base = RunSpec(run_id=self.run_id, run_dir=str(run_dir))
        try:
            return with_fields(base, **{**self.spec, **agent_fields, "run_dir": str(run_dir),
                                        "store_root": str(store_root),
                                        "notice_file": str(notice_file)})
        except RunSpecError as error:
            raise AgentTaskError(f"task key 'spec': {error}; {FIX}") from error

    def to_json(self) -> dict[str, Any]:
        return {"format": TASK_FORMAT, "run_id": self.run_id,
                "job": {"name": self.job_name, "project_dir": str(self.project_dir),
                        "entry": self.entry, "args": list(self.args)},
                "spec": dict(self.spec)}


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
        raise AgentTaskError(f"{where}: keys 'spec.world_size'/'spec.rank' ask for a multi-host "
                             "gang, which this agent does not run yet (one host, world_size 1). "
                             "Fix: remove them")
    task = AgentTask(run_id=data["run_id"], job_name=job["name"], project_dir=project_dir,
                     entry=entry, args=tuple(args),
                     spec={k: v for k, v in spec.items() if k != "run_id"})
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
