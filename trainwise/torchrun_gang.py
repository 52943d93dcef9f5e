"""A torchrun gang on the provider's nodes, one rank per node (issue 11 item 5, issue 10 item 1).

`TorchrunGang` runs `training.ddp_worker` under torchrun on the nodes a `GangSession`
(`trainwise.gang`) holds, rank r on node r, and answers a reclaim of one node by one checkpoint
(rank 0 uploads it to the object store), the replacement of that node and a restart of the
gang from the store. `train_ranks` is the `train` job's way in (`trainwise.runs.run_training`
when its allocation holds more than one node): it hands the run's config, data, curriculum and
fast policy to the ranks, refuses what the ranks cannot take yet, and returns the gang's result
in the shape of the single process's (`training.loop.TrainResult`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloud.providers import NodeHandle
from telemetry.reader import step_records_written
from training.safe_files import replace_with_new, write_atomic

if TYPE_CHECKING:
    from trainwise.gang import GangSession


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class TorchrunGang:
    """A torchrun gang (`training.ddp_worker`, one process per rank) on the session's nodes,
    rank r on `session.nodes[r]`, run through the provider until it completes:

    1. the session launches one node per rank and boots it (the changeover; skipped when the
       caller, the train job, launched already); torchrun starts
       the ranks; the provider's clock runs from the gang's first step on every rank (start-up
       and restore are inside the changeover already modelled);
    2. the driver polls the provider at `poll_s` (`GangSession.check`): a reclaim notice for
       a node SIGTERMs that node's rank only, as the node's agent would; the ranks exchange the
       notice at the next step (`training.distributed`), the fast layer answers it, the whole
       gang stops at one step boundary, rank 0 writes one checkpoint and uploads it to the
       object store before it exits;
    3. the noticed node is released and replaced (`GangSession.replace_noticed`: same zone and
       market, spot refused -> on-demand, recorded); the gang's checkpoint folder, standing for
       the nodes' disks, is emptied and the store's newest committed checkpoint restored into
       it; torchrun starts the gang again at the same world size from that checkpoint.

    A segment that ends without completing for any other reason (an error, a stop nobody sent,
    `stop()`: rank 0 told, one checkpoint) ends the run "interrupted" with `failure` set: never
    a success with a partial model.
    Everything is recorded in `gang.json` (the session) and returned by `run()`.
    """

    session: GangSession
    spec: dict[str, Any]  # ddp_worker spec: out_dir, config, examples, policy (resume_from)
    work_dir: Path
    store_root: Path
    key_prefix: str
    nproc: int
    timeout_s: float = 600.0  # per segment
    poll_s: float = 0.05
    # The object store (an ObjectStore) and rank 0's uploader spec (ddp_worker "store"); None:
    # the local folder `store_root` for both.
    store: Any = None
    uploader_spec: dict[str, Any] | None = None
    segments: list[dict[str, Any]] = field(default_factory=list)
    failure: str = ""
    # A stop asked from outside (the train job's own SIGTERM, `stop`): rank 0 is told as soon
    # as the ranks run, the gang checkpoints at one step boundary and the run ends preempted.
    external_stop: str = ""
    _pids: dict[int, int] = field(default_factory=dict)
    _told_external: bool = False

    def run(self) -> dict[str, Any]:
        if self.session.allocation.nodes != self.nproc:
            raise ValueError(f"allocation of {self.session.allocation.nodes} node(s) for "
                             f"{self.nproc} rank(s): give one node per rank (nodes={self.nproc})")
        self.work_dir = Path(self.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.session.on_stop = self._tell
        if not self.session.nodes:  # the train job launches before it writes anything
            self.session.start()
        resume_from = self.spec.get("resume_from")
        status, results = "interrupted", []
        try:
            while True:
                results = self._segment(len(self.segments), resume_from)
                statuses = [r.get("status") for r in results]
                if statuses == ["completed"] * self.nproc:
                    status = "completed"
                    break
                if statuses != ["preempted"] * self.nproc or not self.session.stop_reason:
                    self.failure = (f"segment {len(self.segments) - 1} ended {statuses} without a "
                                    f"stop of ours: {self._errors(results)}")
                    if self.external_stop and statuses == ["preempted"] * self.nproc:
                        self.failure = f"the gang was stopped: {self.external_stop}"
                    break
                if not self.session.replace_noticed():
                    self.failure = self.session.failure
                    break
                if len(self.session.nodes) != self.nproc:  # the slow layer's new node count
                    self.failure = (f"the allocation now holds {len(self.session.nodes)} node(s) "
                                    f"for a gang of {self.nproc} rank(s): a resume at another "
                                    "world size is refused; restart the run with "
                                    f"nproc={len(self.session.nodes)} from its checkpoint")
                    break
                resume_from = self._restore(results[0])  # onto the replacement's empty disk
        finally:
            record = self.session.close(status)
        return {"status": status, "failure": self.failure, "results": results,
                "segments": self.segments, "gang": record}

    def _segment(self, index: int, resume_from: str | None) -> list[dict[str, Any]]:
        """One torchrun job of the gang; its ranks' results."""
        import subprocess
        import sys

        from training.ddp_worker import torchrun_command

        result_dir = self.work_dir / f"segment-{index}"
        spec = {**self.spec, "resume_from": resume_from, "result_dir": str(result_dir),
                "store": {**(self.uploader_spec or {
                    "uploader": "trainwise.object_store:local_checkpoint_uploader",
                    "root": str(self.store_root)}), "key_prefix": self.key_prefix}}
        spec_path = self.work_dir / f"segment-{index}.json"
        # The gang folder lies in the shared run folder and these names are predictable: a
        # planted link is replaced, never written through (issue 31, class 2).
        write_atomic(spec_path, json.dumps(spec).encode("utf-8"))
        seen = [self._steps_seen(rank) for rank in range(self.nproc)]
        repo = Path(__file__).resolve().parents[1]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(repo),
                                                           os.environ.get("PYTHONPATH")]))}
        log = self.work_dir / f"segment-{index}.log"
        self._pids = {}
        began = time.monotonic()
        with os.fdopen(replace_with_new(log), "w") as stderr:
            process = subprocess.Popen(
                torchrun_command(spec_path, self.nproc, _free_port(), sys.executable),
                cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                start_new_session=True)
            try:
                while process.poll() is None:
                    if time.monotonic() - began > self.timeout_s:
                        raise TimeoutError(f"segment {index} ran over {self.timeout_s:.0f} s; "
                                           f"see {log}")
                    if len(self._pids) < self.nproc:
                        self._started(result_dir, seen)
                    elif self.external_stop and not self._told_external:
                        self._told_external = True
                        self._tell([], self.external_stop)
                    else:
                        self.session.check()
                    time.sleep(self.poll_s)
            finally:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        results = []
        for rank in range(self.nproc):
            path = result_dir / f"rank{rank}.json"
            results.append(json.loads(path.read_text()) if path.exists() else
                           {"error": f"rank {rank} left no result; see {log}"})
        self.segments.append({"index": index, "resume_from": resume_from,
                              "returncode": process.returncode,
                              "status": [r.get("status") for r in results],
                              "steps": [r.get("steps") for r in results],
                              "wall_s": time.monotonic() - began})
        return results

    def stop(self, reason: str) -> None:
        """Stop the gang at its next step boundary with one checkpoint (signal-handler safe:
        only a flag; the driver's poll tells rank 0)."""
        self.external_stop = self.external_stop or reason

    def _started(self, result_dir: Path, seen: list[int]) -> None:
        """Every rank has its pid file and a step beyond the segment's start: the gang trains,
        so the provider's clock runs (and a notice finds every rank's handler installed)."""
        pids = {}
        for rank in range(self.nproc):
            pid_file = result_dir / f"rank{rank}.pid"
            if not pid_file.exists() or self._steps_seen(rank) <= seen[rank]:
                return
            pids[rank] = int(pid_file.read_text())
        self._pids = pids
        self.session.resume_clock()

    def _steps_seen(self, rank: int) -> int:
        run_id = self.spec["config"].get("run_id") or ""
        return step_records_written(Path(self.spec["out_dir"]) / "telemetry" / run_id, rank)

    def _tell(self, nodes: list[NodeHandle], reason: str) -> dict[str, Any]:
        """SIGTERM to the noticed nodes' ranks (the whole gang's stop: rank 0; one is enough,
        the ranks exchange it)."""
        ranks = [self.session.nodes.index(n) for n in nodes] or [0]
        told = []
        for rank in ranks:
            try:
                os.kill(self._pids[rank], signal.SIGTERM)
                told.append(rank)
            except (KeyError, ProcessLookupError):
                pass  # not started or already gone: the segment's end says what happened
        return {"what": f"SIGTERM to rank(s) {told} of the gang",
                "ranks": told, "pids": [self._pids[r] for r in told]}

    def _restore(self, rank0: dict[str, Any]) -> str:
        """The gang's disks after a node was lost: emptied, then the store's newest committed
        checkpoint restored. When the stopped gang's last checkpoint did not reach the store,
        the local copy is kept (trained work is never dropped) and the note says so."""
        import shutil

        from trainwise.emulated_store import restore_from_store
        from trainwise.object_store import LocalObjectStore

        folder = Path(self.spec["out_dir"]) / "checkpoints"
        stopped = int(rank0.get("steps") or 0)
        name = Path(str(rank0.get("checkpoint_path") or "")).name
        uploaded = [u for u in rank0.get("uploads", {}).get("uploaded", [])
                    if name and str(u).rstrip("/").endswith("/" + name)]
        if not uploaded:
            self.session.note("restore", f"the checkpoint of step {stopped} did not reach the "
                              f"store ({rank0.get('uploads')}); the gang resumes from the local "
                              f"copy in {folder}", step=stopped, source="local")
            return str(folder)
        shutil.rmtree(folder, ignore_errors=True)  # the lost node's (and the gang's) disk
        point = restore_from_store(self.store or LocalObjectStore(Path(self.store_root)),
                                   self.key_prefix, folder)
        if point is None:
            raise RuntimeError(f"the store at {self.store_root} lost the committed checkpoint "
                               f"{uploaded[0]} of step {stopped}")
        self.session.note("restore", f"step {point.step} restored from the object store "
                          f"({point.source}) for the replacement gang", step=point.step,
                          source=point.source, path=str(point.path))
        return str(folder)

    @staticmethod
    def _errors(results: list[dict[str, Any]]) -> str:
        return "; ".join(f"rank {r}: {row['error']}" for r, row in enumerate(results)
                         if "error" in row) or "no error recorded"




# -- the train job's ranks (trainwise.runs.run_training with more than one node) ----------------
def partition_examples(folder: str) -> Any:
    """Every rank's data: the published shards of the run's partition (verified, read only)."""
    from training.shards import load_shards

    return load_shards(Path(folder))


def _policy_spec(policy: Any, region: str) -> dict[str, Any] | None:
    """The ddp_worker spec of the run's fast policy (rank 0 runs it), or None when the ranks
    cannot rebuild it."""
    from controllers.fast_heuristic import HeuristicFastPolicy
    from controllers.fast_types import NoOpFastPolicy

    if type(policy) is NoOpFastPolicy:
        return {"kind": "noop"}
    if type(policy) is HeuristicFastPolicy:
        return {"kind": "heuristic"}
    from rl.fast_path import LearnedFastPolicy

    if type(policy) is LearnedFastPolicy and type(policy.heuristic) is HeuristicFastPolicy:
        from rl.retrain import policy_dir
        from trainwise.champion import CHAMPION_FILE

        return {"kind": "learned_fast", "region": region,
                "path": str(policy_dir("fast", region) / CHAMPION_FILE)}
    return None


def check_ranks(request: Any, store: Any, policy: Any, nodes: int) -> None:
    """Refuse, before any node is launched, what the ranks cannot run yet; each error names the
    setting and the fix."""

    where = f"the train request of run {request.run_id!r} holds {nodes} nodes (one rank each)"
    if request.data_selection != "static":
        raise ValueError(f"{where} with data_selection={request.data_selection!r}: dynamic "
                         "pruning under torchrun is not supported yet (each rank's loss table "
                         "would differ); use data_selection='static', or nodes=1")
    if request.grad_accum_steps < nodes:
        raise ValueError(f"{where} with grad_accum_steps={request.grad_accum_steps}: under "
                         "torchrun it is the global number of micro batches per step, at least "
                         f"one per rank; set grad_accum_steps >= {nodes} (the same global batch "
                         "as one process with it), or nodes=1")
    if _uploader_spec(store) is None:
        raise ValueError(f"{where} with the object store {type(store).__name__}: rank 0 uploads "
                         "checkpoints to a local folder or S3 only; set TRAINWISE_S3_BUCKET or "
                         "leave it empty for the local folder, or train with nodes=1")
    if _policy_spec(policy, request.region) is None:
        name = getattr(policy, "name", type(policy).__name__)
        raise ValueError(f"{where} with the fast policy {name!r}: rank 0 can only rebuild noop, "
                         "heuristic or the region's fast champion; use fast_policy='heuristic' or "
                         "'noop', or nodes=1")


def s3_checkpoint_uploader(root: str, key_prefix: str, bucket: str, prefix: str,
                           endpoint_url: str | None, region_name: str | None) -> Any:
    """Rank 0's uploader to the train job's S3 bucket (ddp_worker spec "store"): a boto3 client
    of its own (botocore's standard retries, as every S3 client of the product), credentials
    from the same environment chain as the job's."""
    from trainwise.object_store import CheckpointUploader, S3ObjectStore, s3_client

    return CheckpointUploader(S3ObjectStore(s3_client(endpoint_url, region_name), bucket,
                                            prefix), key_prefix)


def _uploader_spec(store: Any) -> dict[str, Any] | None:
    """Rank 0's uploader for the train job's store (without the key prefix), None for a store
    the ranks cannot rebuild."""
    from trainwise.object_store import LocalObjectStore, S3ObjectStore

    if type(store) is LocalObjectStore:
        return {"uploader": "trainwise.object_store:local_checkpoint_uploader",
                "root": str(store.root)}
    if type(store) is S3ObjectStore:
        meta = getattr(store.client, "meta", None)
        return {"uploader": f"{__name__}:s3_checkpoint_uploader",
                "root": f"s3://{store.bucket}/{store.prefix}", "bucket": store.bucket,
                "prefix": store.prefix, "endpoint_url": getattr(meta, "endpoint_url", None),
                "region_name": getattr(meta, "region_name", None)}
    return None


@dataclass
class RankUploads:
    """Rank 0's uploads, as the train job's `CheckpointUploader.drain` reports them (rank 0
    uploaded each checkpoint and waited for them before it exited)."""

    rank0: dict[str, Any]

    def drain(self, timeout_s: float) -> Any:
        from trainwise.object_store import UploadReport

        uploads = self.rank0.get("uploads") or {}
        return UploadReport(uploaded=list(uploads.get("uploaded", [])),
                            failed=[tuple(f) for f in uploads.get("failed", [])])


def train_ranks(session: GangSession, config: Any, *, request: Any, shards_dir: Path,
                curriculum: Any, curriculum_dir: Path, run_dir: Path, policy: Any,
                resume_from: Path | None, store: Any, key_prefix: str,
                upload_timeout_s: float) -> tuple[Any, RankUploads]:
    """The train job's run as a torchrun gang, one rank per node of `session` (launched by the
    caller); returns (rank 0's result as a `TrainResult`, cost summed over the ranks; rank 0's
    uploads). A rank that failed raises RuntimeError naming it and its log; a gang stopped by
    the provider (replacement refused) or by this process's SIGTERM returns the preempted
    result with `session.failure` saying why (the caller raises RunInterruptedError)."""
    import dataclasses
    import math
    import threading

    from training.ddp_worker import model_spec
    from training.loop import TrainResult

    nproc = len(session.nodes)
    values = dataclasses.asdict(config)
    values["model"] = model_spec(config.model) if config.model is not None else None
    # Every emulated node is a process on this machine: the threads are shared out.
    values["num_threads"] = max(1, config.num_threads // nproc)
    spec = {"examples": f"{__name__}:partition_examples",
            "examples_kwargs": {"folder": str(shards_dir)},
            "curriculum": {"path": str(curriculum_dir), "version": curriculum.version},
            "config": values, "out_dir": str(run_dir),
            "policy": _policy_spec(policy, request.region),
            "resume_from": str(resume_from) if resume_from is not None else None,
            "upload_timeout_s": upload_timeout_s}
    work_dir = run_dir / "gang"
    if spec["policy"]["kind"] == "learned_fast":  # the champion accepted now, not a later one
        work_dir.mkdir(parents=True, exist_ok=True)
        pinned = work_dir / "fast_champion.npz"
        # Not shutil.copyfile: it opens the target following a link planted at this name.
        write_atomic(pinned, Path(spec["policy"]["path"]).read_bytes())
        spec["policy"] = {**spec["policy"], "path": str(pinned)}
    uploader_spec = _uploader_spec(store)
    driver = TorchrunGang(session, spec, work_dir, Path(uploader_spec["root"]), key_prefix, nproc,
                          timeout_s=math.inf,  # as the single process: no limit of its own
                          store=store, uploader_spec=uploader_spec)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: driver.stop(
        f"SIGTERM to the train job (pid {os.getpid()})")) if main else None
    try:
        found = driver.run()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    rows = found["results"]
    if not rows or any("error" in row or "status" not in row for row in rows):
        logs = sorted(str(p) for p in driver.work_dir.glob("segment-*.log"))
        raise RuntimeError(f"the torchrun gang of run {request.run_id} failed: "
                           f"{driver.failure or TorchrunGang._errors(rows)}; logs: {logs}")
    if found["status"] != "completed" and not session.failure:
        session.failure = driver.failure  # recorded in the summary's pending and gang.json
    rank0 = rows[0]
    names = {f.name for f in dataclasses.fields(TrainResult)}
    result = TrainResult(**{
        **{k: v for k, v in rank0.items() if k in names},
        "checkpoint_path": Path(rank0["checkpoint_path"]),
        "telemetry_dir": Path(rank0["telemetry_dir"]),
        "cost_usd": float(sum(row["cost_usd"] for row in rows)),  # every node billed
    })
    return result, RankUploads(rank0)
