"""The run spec: what a launcher tells a user's job about the run it is (one strict JSON file).

A launcher (the `train` job, a node agent) writes the spec and starts the user's script with
`TRAINWISE_RUN_SPEC=<path>`; `trainwise.init()` reads it. Without the variable the job is a local
run: its folder is `<TRAINWISE_HOME>/sdk_runs/<run_id>`, and running the script again resumes it.
Arguments given to `init` override the spec's fields, so a script can state its own defaults.

The file is data only (JSON, every key known and typed); it never names code to run.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from training.safe_files import read_small, write_atomic

SPEC_ENV = "TRAINWISE_RUN_SPEC"
# 128 + SIGTERM: what a supervisor expects of a job a notice ended. Part of the launcher's
# contract with the job, so here, where a launcher reads it without importing torch.
PREEMPTED_EXIT_CODE = 143
SPEC_FORMAT = "trainwise-run-spec/1"
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SPEC_LIMIT_BYTES = 1 << 20


class RunSpecError(ValueError):
    """A run spec (file or `init` argument) that cannot be used; the message names the fix."""


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    run_dir: str  # the run's own folder: telemetry/, checkpoints/, outcome.json
    max_steps: int | None = None  # None: the job decides when it is done (run.finish())
    seed: int = 0
    checkpoint_every_steps: int | None = 100  # None: only on a notice, a stop and at the end
    keep_checkpoints: int = 3  # local checkpoints kept (the store keeps every committed one)
    fast_every_steps: int = 10
    fast_policy: str = "heuristic"  # "heuristic" or "noop"
    fast_levers: tuple[str, ...] = ("batch_scaling", "preemption")
    # The object store the checkpoints go to: a local folder standing for it, or none.
    store_root: str | None = None
    store_prefix: str = ""  # key prefix; "" -> "runs/<run_id>/checkpoints"
    notice_file: str | None = None  # a node agent writes it when the node is being reclaimed
    # A node agent writes it when the cloud raises the node's risk without ending it (EC2's
    # rebalance recommendation): the job checkpoints at its next fast tick and goes on.
    rebalance_file: str | None = None
    notice_s: float = 120.0  # what a SIGTERM leaves before the kill (EC2 spot: 2 minutes)
    # The chance of a reclaim within the fast heuristic's risk horizon, as the launcher observed
    # it on the node's market (0: none known). With it the fast layer checkpoints on Young's
    # interval for that risk (`PreemptionResponse.CHECKPOINT_NOW` without a notice).
    preemption_risk: float = 0.0
    schedule_version: str = ""
    instance_type: str = "local"
    price_usd_per_hour: float = 0.0
    rank: int = 0
    world_size: int = 1
    # The process group's backend when world_size > 1 (trainwise.sdk.ranks): auto = nccl when
    # the run's device is a GPU, gloo on the CPU. A group the job initialised itself is kept.
    dist_backend: str = "auto"
    # How long a collective (the step's all-reduces, DDP's gradients) waits for the other ranks
    # before this rank gives up with an error: a host lost without notice or cut off from the
    # gang ends the survivors in this time instead of torch's 30 minutes, and the launcher
    # relaunches the gang from the last committed step.
    collective_timeout_s: float = 300.0
    # The registered dataset's published shards (its data_shards partition); run.dataset().
    dataset_dir: str | None = None
    # Where it runs (trainwise.sdk.device): auto = CUDA when present; auto precision = bf16 or
    # fp16 autocast on a GPU, fp32 on the CPU; cpu_threads None = torch's default (every core).
    device: str = "auto"
    precision: str = "auto"
    cpu_threads: int | None = None
    # A launcher's cap on the steps that the job's own arguments cannot raise (a throughput
    # probe runs a job for a few steps whatever max_steps its command line asks for).
    step_limit: int | None = None

    def __post_init__(self) -> None:
        for name in _PATH_FIELDS:  # a Path given for a folder is kept as the text a file holds
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))

    @property
    def telemetry_dir(self) -> Path:
        return Path(self.run_dir) / "telemetry"

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.run_dir) / "checkpoints" / f"rank{self.rank}"

    @property
    def checkpoint_key_prefix(self) -> str:
        return self.store_prefix or f"runs/{self.run_id}/checkpoints"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["fast_levers"] = list(self.fast_levers)
        return {"format": SPEC_FORMAT, **data}


_PATH_FIELDS = ("run_dir", "store_root", "notice_file", "rebalance_file", "dataset_dir")
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "run_id": (str,), "run_dir": (str,), "max_steps": (int, type(None)), "seed": (int,),
    "checkpoint_every_steps": (int, type(None)), "keep_checkpoints": (int,),
    "fast_every_steps": (int,), "fast_policy": (str,), "fast_levers": (list, tuple),
    "store_root": (str, type(None)), "store_prefix": (str,), "notice_file": (str, type(None)),
    "rebalance_file": (str, type(None)),
    "notice_s": (int, float), "preemption_risk": (int, float), "schedule_version": (str,),
    "instance_type": (str,), "price_usd_per_hour": (int, float), "rank": (int,),
    "world_size": (int,), "dist_backend": (str,), "collective_timeout_s": (int, float),
    "dataset_dir": (str, type(None)),
    "device": (str,), "precision": (str,), "cpu_threads": (int, type(None)),
    "step_limit": (int, type(None)),
}


def _checked(values: dict[str, Any], where: str) -> RunSpec:
    known = {f.name for f in fields(RunSpec)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise RunSpecError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    values = {name: os.fspath(value) if name in _PATH_FIELDS and isinstance(value, os.PathLike)
              else value for name, value in values.items()}
    for name, value in values.items():
        kinds = _FIELD_TYPES[name]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise RunSpecError(f"{where}: {name} is {value!r}, which is not "
                               f"{' or '.join(k.__name__ for k in kinds)}")
    missing = [name for name in ("run_id", "run_dir") if name not in values]
    if missing:
        raise RunSpecError(f"{where}: {missing} missing; a spec names the run and its folder")
    values = dict(values)
    values["fast_levers"] = tuple(values.get("fast_levers", RunSpec.fast_levers))
    for name in ("notice_s", "price_usd_per_hour", "preemption_risk", "collective_timeout_s"):
        if name in values:
            values[name] = float(values[name])
    limit = values.get("step_limit")
    if isinstance(limit, int) and limit >= 1:  # the job's max_steps, at most the launcher's cap
        asked = values.get("max_steps")
        values["max_steps"] = limit if asked is None else min(asked, limit)
    spec = RunSpec(**values)
    problems = []
    if not _RUN_ID.match(spec.run_id):
        problems.append(f"run_id {spec.run_id!r} must match {_RUN_ID.pattern} (it names a "
                        "folder and store keys)")
    if spec.max_steps is not None and spec.max_steps < 1:
        problems.append(f"max_steps {spec.max_steps} must be >= 1 (or None)")
    if spec.step_limit is not None and spec.step_limit < 1:
        problems.append(f"step_limit {spec.step_limit} must be >= 1 (or None)")
    if spec.checkpoint_every_steps is not None and spec.checkpoint_every_steps < 1:
        problems.append(f"checkpoint_every_steps {spec.checkpoint_every_steps} must be >= 1 "
                        "(or None: checkpoint only on a notice, a stop and at the end)")
    if spec.keep_checkpoints < 1 or spec.fast_every_steps < 1:
        problems.append("keep_checkpoints and fast_every_steps must be >= 1")
    if spec.fast_policy not in ("heuristic", "noop"):
        problems.append(f"fast_policy {spec.fast_policy!r} is not one of heuristic, noop")
    if not 0 <= spec.rank < spec.world_size:
        problems.append(f"rank {spec.rank} is not in 0..world_size-1 ({spec.world_size})")
    if spec.dist_backend not in ("auto", "gloo", "nccl"):
        problems.append(f"dist_backend {spec.dist_backend!r} is not one of auto, gloo, nccl")
    if not spec.collective_timeout_s > 0:  # False for nan too
        problems.append(f"collective_timeout_s {spec.collective_timeout_s!r} must be > 0")
    if spec.notice_s <= 0 or spec.price_usd_per_hour < 0:
        problems.append("notice_s must be > 0 and price_usd_per_hour >= 0")
    if not 0.0 <= spec.preemption_risk <= 1.0:  # False for nan too
        problems.append(f"preemption_risk {spec.preemption_risk!r} must be a probability in "
                        "[0, 1]")
    if problems:
        raise RunSpecError(f"{where}: " + "; ".join(problems))
    return spec


def read_spec(path: str | Path) -> RunSpec:
    path = Path(path)
    try:
        raw = read_small(path, _SPEC_LIMIT_BYTES)
    except FileNotFoundError as error:
        raise RunSpecError(f"run spec {path} ({SPEC_ENV}) does not exist; unset {SPEC_ENV} for "
                           "a local run, or point it at the launcher's spec") from error
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunSpecError(f"run spec {path} is not JSON ({error}); the launcher writes it, "
                           "do not edit it by hand") from error
    if not isinstance(data, dict) or data.pop("format", None) != SPEC_FORMAT:
        raise RunSpecError(f"run spec {path} is not a {SPEC_FORMAT} object")
    return _checked(data, f"run spec {path}")


def write_spec(spec: RunSpec, path: str | Path) -> Path:
    """Atomically (a reader never sees half a spec)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(spec.to_json(), indent=1) + "\n").encode())
    return path


def _local_run_id() -> str:
    stem = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c") else "local"
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", stem).strip("-.") or "local"
    return cleaned[:128]


def resolve_spec(**overrides: Any) -> RunSpec:
    """The launcher's spec (`TRAINWISE_RUN_SPEC`) or a local one, with `overrides` applied
    (None values are not overrides, except where a field's None is meaningful and given as
    `checkpoint_every_steps=None` explicitly through `init`)."""
    where = "trainwise.init()"
    path = os.environ.get(SPEC_ENV)
    if "RANK" in os.environ and "rank" not in overrides:
        # torchrun's: the rank is the launcher of the ranks' to give. A node agent's spec is one
        # per node, shared by the ranks torchrun starts there (and a gang's hosts get their
        # ranks at the rendezvous), so the spec never names one.
        overrides["rank"] = int(os.environ["RANK"])
        overrides["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
    if path:
        base = read_spec(path)
        if "run_id" in overrides and overrides["run_id"] != base.run_id:
            raise RunSpecError(f"{where}: run_id={overrides['run_id']!r} but the launcher's spec "
                               f"{path} runs {base.run_id!r}; drop the argument under a launcher")
        values = {**asdict(base), **overrides}
        return _checked(values, f"{where} over {path}")
    run_id = overrides.pop("run_id", None) or _local_run_id()
    run_dir = overrides.pop("run_dir", None)
    if run_dir is None:
        from trainwise import settings

        run_dir = str(settings.home_dir() / "sdk_runs" / run_id)
    return _checked({"run_id": run_id, "run_dir": str(run_dir), **overrides}, where)


def with_fields(spec: RunSpec, **values: Any) -> RunSpec:
    return _checked({**asdict(spec), **values}, "run spec")


__all__ = ["RunSpec", "RunSpecError", "SPEC_ENV", "read_spec", "resolve_spec", "write_spec",
           "with_fields", "replace"]
