"""torchrun entry point: one rank of a data-parallel `training.loop.train` run.

    torchrun --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29500 \\
        -m training.ddp_worker spec.json

Across machines the same command runs on each node with `--nnodes=N` and the rendezvous
endpoint of one of them (torchrun's c10d backend); the checkpoint folder must then be on storage
every node reads (rank 0 writes it, every rank resumes from it).

The spec (JSON) names everything a rank needs, the same file for all ranks:
  examples        "module:function" returning the ExampleSet (every rank builds the same one)
  examples_kwargs keyword arguments of that function
  config          TrainConfig fields; "model" is a GPTConfig/CNNConfig dict with "kind"
  out_dir, resume_from, stop_after_steps
                  resume_from "auto": the newest good checkpoint in out_dir/checkpoints if there
                  is one, else a fresh start. With `torchrun --max-restarts=K` (elastic) a gang
                  restarted after a worker died so continues from its last checkpoint.
  curriculum      {"path": folder, "version": "..."}: the published curriculum every rank
                  trains on (`training.curriculum.load_curriculum`, verified); absent = every
                  train example at weight 1
  policy          {"kind": "noop" | "fixed_shares" | "stragglers" | "heuristic" | "learned_fast",
                  "shares": [...]}; "learned_fast" also names "path" (a fast policy file, e.g.
                  the region's champion) and "region", loaded by rank 0 over the heuristic
  slowdown        {"rank": R, "factors": [...]}: rank R's compute is stretched by factors[step %
                  len] (benchmarks: delays replayed from straggler traces)
  micro_batch_ms  emulated device milliseconds per micro batch (benchmarks)
  result_dir      each rank writes rank<R>.json there (TrainResult as JSON), and rank<R>.pid
                  when it starts (tests send one rank a preemption notice: SIGTERM to that pid)
  store           {"uploader": "module:function", "root": folder, "key_prefix": "...", ...}
                  (further keys go to the factory too, e.g. an S3 bucket): rank 0
                  uploads each checkpoint to that object store (a local folder standing for
                  it) as soon as it is durable, and waits for the uploads before it exits
                  (`upload_timeout_s`, default 60); its
                  result says what reached the store ("uploads"). A replacement node restores
                  from there (`trainwise.torchrun_gang.TorchrunGang`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controllers.fast_heuristic import HeuristicFastPolicy
from controllers.fast_types import FastAction, FastObservation, FastPolicy, NoOpFastPolicy
from controllers.stragglers import StragglerBalancer, StragglerConfig
from training import distributed
from training.checkpoint import latest_good_checkpoint
from training.loop import TrainConfig, train
from training.model import CNNConfig, GPTConfig
from training.safe_files import write_atomic


class FixedSharesPolicy:
    """Keeps batch and learning rate, hands out fixed shares (tests of uneven shares)."""

    name = "fixed_shares"

    def __init__(self, shares: Sequence[float]) -> None:
        self.shares = tuple(float(s) for s in shares)

    def act(self, observation: FastObservation) -> FastAction:
        return FastAction(
            micro_batch_size=observation.micro_batch_size,
            grad_accum_steps=observation.grad_accum_steps,
            learning_rate=observation.learning_rate, rank_work_shares=self.shares,
            reason=f"fixed shares {self.shares}",
        )


class StragglerSharesPolicy:
    """Only the fast layer's straggler part (controllers.stragglers): shares from measured
    per-rank speed, batch and learning rate kept; the benchmark isolates re-balancing with it."""

    name = "stragglers"

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.balancer = StragglerBalancer(config)

    def act(self, observation: FastObservation) -> FastAction:
        decision = self.balancer.update(observation.rank_step_time_ms)
        return FastAction(
            micro_batch_size=observation.micro_batch_size,
            grad_accum_steps=observation.grad_accum_steps,
            learning_rate=observation.learning_rate, rank_work_shares=decision.shares,
            reason=decision.reason, numbers={"predicted_gain": decision.predicted_gain},
        )


class GangBatchFit:
    """A fast policy for a gang of `world_size` ranks: an answer with fewer micro batches per
    step than ranks (a batch lever that halves accumulation, written for one process) gets one
    micro batch per rank at the same global batch, rounded up, and the reason says so. Without
    it the gang would stop: every rank needs at least one micro batch."""

    def __init__(self, inner: FastPolicy, world_size: int) -> None:
        self.inner, self.world_size = inner, world_size
        self.name = getattr(inner, "name", type(inner).__name__)

    def act(self, observation: FastObservation) -> FastAction:
        action = self.inner.act(observation)
        accum = int(action.grad_accum_steps)
        if accum >= self.world_size:
            return action
        global_batch = int(action.micro_batch_size) * accum
        micro = -(-global_batch // self.world_size)  # ceil: never a smaller batch than asked
        return dataclasses.replace(
            action, micro_batch_size=micro, grad_accum_steps=self.world_size,
            reason=f"{action.reason}; {self.world_size} ranks: {accum} x "
                   f"{action.micro_batch_size} became {self.world_size} x {micro} (one micro "
                   "batch per rank, same global batch)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def build_policy(spec: dict[str, Any]) -> FastPolicy:
    kind = spec.get("kind", "noop")
    if kind == "noop":
        return NoOpFastPolicy()
    if kind == "fixed_shares":
        return FixedSharesPolicy(spec["shares"])
    if kind == "stragglers":
        return StragglerSharesPolicy(StragglerConfig(**spec.get("config", {})))
    if kind == "heuristic":
        return HeuristicFastPolicy()
    if kind == "learned_fast":  # as trainwise.champion: refused on a wrong layout, region, NaN
        from rl.fast_obs import FAST_OBS_LAYOUT
        from rl.fast_path import LearnedFastPolicy, NumpyPolicy
        from rl.policy_file import load_policy

        weights = load_policy(Path(spec["path"]), "fast", FAST_OBS_LAYOUT, spec["region"])
        return LearnedFastPolicy(NumpyPolicy(weights), HeuristicFastPolicy())
    raise ValueError(f"policy kind {kind!r} unknown; use noop, fixed_shares, stragglers, "
                     "heuristic, learned_fast")


def load_spec_curriculum(spec: dict[str, Any] | None) -> Any:
    """The spec's curriculum (the exact version the driver trained with), or None."""
    if not spec:
        return None
    from training.curriculum import load_curriculum

    return load_curriculum(Path(spec["path"]), spec.get("version"))


def build_config(values: dict[str, Any]) -> TrainConfig:
    values = dict(values)
    model = values.pop("model", None)
    if model is not None:
        model = dict(model)
        kind = model.pop("kind")
        model = GPTConfig(**model) if kind == "gpt" else CNNConfig(**model)
    return TrainConfig(**values, model=model)


def model_spec(config: GPTConfig | CNNConfig) -> dict[str, Any]:
    """The spec's "model" entry for a model config."""
    kind = "gpt" if isinstance(config, GPTConfig) else "cnn"
    return {"kind": kind, **dataclasses.asdict(config)}


def resolve_resume(resume_from: str | None, out_dir: Path) -> str | None:
    """"auto": out_dir's checkpoint folder when it holds a good checkpoint (every rank reads the
    same folder, so the gang agrees), else None (fresh); anything else is passed on."""
    if resume_from != "auto":
        return resume_from
    folder = out_dir / "checkpoints"
    return str(folder) if folder.is_dir() and latest_good_checkpoint(folder) else None


def checkpoint_uploader(store: dict[str, Any] | None, rank: int) -> Any:
    """Rank 0's uploader to the spec's object store (the one rank that writes checkpoints);
    None on other ranks or without a store. The spec names the uploader's factory as
    "module:function" (like `examples`): the driver that launches the gang owns the store, so the
    trainer does not depend on it."""
    if not store or rank != 0:
        return None
    missing = [key for key in ("uploader", "root", "key_prefix") if key not in store]
    if missing:
        raise ValueError(f"spec store={store!r} lacks {', '.join(missing)}: give {{'uploader': "
                         "'module:function', 'root': folder, 'key_prefix': '...'}")
    module, _, function = store["uploader"].partition(":")
    factory = getattr(importlib.import_module(module), function)
    # Any further keys are the factory's own (an S3 store's bucket, prefix, endpoint).
    return factory(**{k: v for k, v in store.items() if k != "uploader"})


def torchrun_command(spec_path: Path, nproc_per_node: int, master_port: int,
                     python: str = sys.executable) -> list[str]:
    """torchrun for one machine (static rendezvous on loopback: c10d's store start-up costs
    ~2 s a job) running this worker on `spec_path`."""
    return [python, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}",
            "--master_addr=127.0.0.1", f"--master_port={master_port}",
            "-m", "training.ddp_worker", str(spec_path)]


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: torchrun ... -m training.ddp_worker SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    ctx = distributed.init_from_env()
    rank = ctx.rank if ctx else 0
    if spec.get("result_dir"):
        Path(spec["result_dir"]).mkdir(parents=True, exist_ok=True)
        # Predictable names: written via an unpredictable temp name, so a planted link there
        # is replaced, not written through (issue 31, class 2).
        write_atomic(Path(spec["result_dir"]) / f"rank{rank}.pid", str(os.getpid()).encode())
    module, _, function = spec["examples"].partition(":")
    examples = getattr(importlib.import_module(module), function)(
        **spec.get("examples_kwargs", {})
    )
    slowdown = None
    slow = spec.get("slowdown")
    if slow and int(slow["rank"]) == rank:
        factors = [float(f) for f in slow["factors"]]
        slowdown = lambda step: factors[step % len(factors)]  # noqa: E731
    emulation = None
    if slowdown is not None or spec.get("micro_batch_ms"):
        emulation = distributed.Emulation(micro_batch_ms=float(spec.get("micro_batch_ms", 0.0)),
                                          slowdown=slowdown)
    uploader = None
    try:
        uploader = checkpoint_uploader(spec.get("store"), rank)
        result = train(
            build_config(spec["config"]), examples, load_spec_curriculum(spec.get("curriculum")),
            spec["out_dir"],
            fast_policy=GangBatchFit(build_policy(spec.get("policy", {})),
                                     ctx.world_size if ctx else 1),
            resume_from=resolve_resume(spec.get("resume_from"), Path(spec["out_dir"])),
            stop_after_steps=spec.get("stop_after_steps"),
            on_checkpoint=uploader.submit if uploader is not None else None,
            emulation=emulation,
        )
        record = {k: str(v) if isinstance(v, Path) else v
                  for k, v in dataclasses.asdict(result).items()}
    except Exception as error:  # noqa: BLE001 - recorded for the caller, then the exit code
        record = {"error": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()}
    if uploader is not None:  # before the node goes: what is not in the store is lost with it
        report = uploader.drain(float(spec.get("upload_timeout_s", 60.0)))
        record["uploads"] = {"uploaded": list(report.uploaded),
                             "failed": [list(f) for f in report.failed]}
    if spec.get("result_dir"):
        out = Path(spec["result_dir"])
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / f"rank{rank}.json", json.dumps(record, indent=1).encode("utf-8"))
    if ctx is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
