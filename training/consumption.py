"""The consumption record: which step trained on which examples, what each epoch skipped and why.

One append-only JSONL file per run, `<telemetry_dir>/<run_id>/consumption.jsonl` (beside the
`rank<R>/` segment folders, which the telemetry reader alone reads). Written by the dynamic
pruning sampler (`training.sampler.DynamicPruningSampler`); one JSON object per line:

  {"type": "session", "start_step": s, ...}        a trainer process starts (fresh: 0, or a resume)
  {"type": "epoch", "epoch": e, "step": s, "phase": "curriculum"|"anneal", "rate": r,
   "kept": n, "skipped": [{"reason": "pruned: below-mean loss, rate 0.5", "ids": [...]},
   {"reason": "not in curriculum <version>", "ids": [...]}], ...}   anneal: "anneal: full data"
  {"type": "batch", "step": s, "epoch": e, "ids": [...], "weights": [...]}   one micro batch
  {"type": "rate", "step": s, "rate": r, "source": "api"|"control_file"|"slow_policy", "reason"}
  {"type": "curriculum", "step": s, "version": v, "source": ...}
  {"type": "warning", "step": s, "message": ...}     a clamp or a refused control file
  {"type": "close", "step": s, "sampler_s": ...}     the process stops (time spent in the sampler)

`step` is the optimizer step being computed (0-based: the batch of step s makes the model of
step s + 1). Lines are buffered and written in one `write` each flush (every `flush_every` lines,
at every checkpoint and at close); a process killed hard loses at most the unflushed lines after
its last checkpoint, which the resumed process redoes and records again.

Resumes: a session that starts at step s supersedes every earlier record with step >= s (those
steps were redone from the checkpoint), so `read_consumption` returns what the final model
actually trained on. A torn last line (no newline) is skipped; a new session starts on a fresh line.

The file has a predictable name, so it is opened with `training.safe_files.open_for_append`: a
planted symbolic link, hard link or FIFO at that name is refused (UnsafeStatePathError) instead
of appended through, and its folder must resolve inside the telemetry folder (issue 31, class 2).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from training.safe_files import ensure_inside, open_for_append

CONSUMPTION_NAME = "consumption.jsonl"
RECORD_TYPES = ("session", "epoch", "batch", "rate", "curriculum", "warning", "close")


def consumption_path(telemetry_dir: str | Path, run_id: str) -> Path:
    """`<telemetry_dir>/<run_id>/consumption.jsonl`."""
    return Path(telemetry_dir) / run_id / CONSUMPTION_NAME


class ConsumptionWriter:
    """Appends records to a run's consumption file; buffered, one `write` per flush."""

    def __init__(self, path: str | Path, *, start_step: int, flush_every: int = 256,
                 **session_fields: Any) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every={flush_every} must be >= 1")
        self.path = Path(path)
        # `<telemetry>/<run_id>/consumption.jsonl`: a link at `<run_id>` must not lead out.
        ensure_inside(self.path.parent.parent, self.path.parent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_every = flush_every
        self._buffer: list[str] = []
        handle = open_for_append(self.path)
        self._handle = os.fdopen(handle, "ab")  # closed in close()
        # A process killed mid-line left a torn fragment: start this session on a fresh line.
        size = os.fstat(handle).st_size
        if size > 0 and os.pread(handle, 1, size - 1) != b"\n":
            self._handle.write(b"\n")
        self.write({"type": "session", "step": start_step, "start_step": start_step,
                    "pid": os.getpid(), "wall_time_s": time.time(), **session_fields})

    def write(self, record: dict[str, Any]) -> None:
        self._buffer.append(json.dumps(record, separators=(",", ":")))
        if len(self._buffer) >= self.flush_every:
            self.flush()

    def batch(self, step: int, epoch: int, ids: np.ndarray, weights: np.ndarray) -> None:
        # Hot path (once per micro batch): build the line by hand, json.dumps of a dict with two
        # lists costs about twice as much.
        id_text = ",".join(map(str, ids.tolist()))
        values = weights.tolist()
        weight_text = ",".join(map(repr, values))  # repr: the shortest exact float text
        line = (f'{{"type":"batch","step":{step},"epoch":{epoch},"ids":[{id_text}],'
                f'"weights":[{weight_text}]}}')
        self._buffer.append(line)
        if len(self._buffer) >= self.flush_every:
            self.flush()

    def flush(self, *, durable: bool = False) -> None:
        """Writes the buffered lines; `durable` also fsyncs (at checkpoints and close)."""
        if self._handle.closed:
            return
        if self._buffer:
            self._handle.write(("\n".join(self._buffer) + "\n").encode("utf-8"))
            self._buffer.clear()
        self._handle.flush()
        if durable:
            os.fsync(self._handle.fileno())

    def close(self, record: dict[str, Any] | None = None) -> None:
        if self._handle.closed:
            return
        if record is not None:
            self.write(record)
        self.flush(durable=True)
        self._handle.close()


def read_consumption(path: str | Path) -> list[dict[str, Any]]:
    """The records that describe the final model's training, in order (see the module docstring).

    Accepts the file or its run folder. Raises FileNotFoundError naming the path, or ValueError
    for a complete line that is not JSON (corruption, not a torn write).
    """
    path = Path(path)
    if path.is_dir():
        path = path / CONSUMPTION_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no consumption record at {path}: it is written by runs trained "
                                "with dynamic pruning (train(..., pruning=DynamicPruningConfig()))")
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    lines = data.split(b"\n")
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            # A torn line is one without its newline: the last one, or one a new session started
            # after (the writer begins a fresh line). Anything else is corruption.
            torn = number == len(lines) - 1 or _followed_by_session(lines, number)
            if torn:
                continue
            raise ValueError(f"{path} line {number + 1} is not JSON ({error}); the consumption "
                             "record is corrupt") from error
        if record.get("type") == "session":
            start = int(record["start_step"])
            records = [r for r in records if r.get("step", -1) < start or r["type"] == "session"]
        records.append(record)
    return records


def _followed_by_session(lines: list[bytes], number: int) -> bool:
    following = lines[number + 1] if number + 1 < len(lines) else b""
    return following.startswith(b'{"type":"session"')


def trained_on(records: list[dict[str, Any]]) -> dict[int, np.ndarray]:
    """step -> example ids the model trained on at that step (its micro batches joined)."""
    by_step: dict[int, list[int]] = defaultdict(list)
    for record in records:
        if record["type"] == "batch":
            by_step[record["step"]].extend(record["ids"])
    return {step: np.asarray(ids, dtype=np.int64) for step, ids in sorted(by_step.items())}


def epochs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The epoch records: per epoch its phase, rate, kept count, skipped ids and the reason."""
    return [r for r in records if r["type"] == "epoch"]


def example_history(records: list[dict[str, Any]], example_id: int) -> dict[str, Any]:
    """What happened to one example: the steps that trained on it and the epochs that skipped it
    (with the reason): the answer to "did the model see example X, and if not, why not"."""
    example_id = int(example_id)
    steps = [r["step"] for r in records if r["type"] == "batch" and example_id in r["ids"]]
    skipped = [{"epoch": r["epoch"], "step": r["step"], "reason": group["reason"]}
               for r in epochs(records) for group in r["skipped"] if example_id in group["ids"]]
    return {"example_id": example_id, "trained_at_steps": steps, "skipped": skipped}


def samples_trained(records: list[dict[str, Any]]) -> int:
    """Sample passes (forward/backward of one example) recorded."""
    return sum(len(r["ids"]) for r in records if r["type"] == "batch")
