"""The run ledger: the trainer's own record of its clock, the one source of a resume's bill.

Why (issue 31, class 4). A resume used to bill the newest `elapsed_s` that the run's telemetry
recorded, and derive the replay range from its newest step. Telemetry is a folder of plain JSONL
segments any process can add to: one planted sealed segment billed a 0.002 USD run 8,500 USD.
Now the trainer commits its clock to this ledger itself, and a resume bills from the ledger's
verified lines only; telemetry is merely cross-checked against it (`training.loop`).

File: `<out_dir>/ledger/<run_id>/rank<R>.jsonl`, append-only, one JSON object per line, each
appended with one write(2). It lives beside `checkpoints/`, not under `telemetry/`, so a full
telemetry disk does not stop it. Lines:

- `start`: a process begins on the run (after its set-up), at the step it resumed from;
- `step`: an optimizer step finished (written just before that step's telemetry record, with
  the same `elapsed_s`);
- `mark`: an eval or preemption record (the clock at that moment);
- `checkpoint`: a checkpoint became durable: its step, its clock (`checkpoint_elapsed_s`, what
  the checkpoint holds) and its sha256, so a resume finds the line of exactly its checkpoint;
- `end`: the process stops (with the run_end record's `elapsed_s`);
- `unwritten`: a telemetry record the full telemetry disk refused (issue 31, class 5): the
  resumed process writes it into telemetry first (`unwritten_records`), once.

Each line carries `prev` (the previous line's `mac`) and `mac` = HMAC-SHA256(key, prev + the
line's other fields), hex, truncated to 128 bits. The key (`ledger_key`): `TRAINWISE_LEDGER_KEY`
(any string) if set, else one derived from the deployment's checkpoint key
(`training._checkpoint_trust.state_key`: `TRAINWISE_STATE_KEY` or `<TRAINWISE_HOME>/state.key`),
which lives outside the run folder. Only when neither can be had is the key empty (a warning
says so), which makes the mac a plain hash chain.

What a resume trusts (`read_ledger`, `committed_bill`):
- a line whose mac does not verify, that names another run or rank, or is malformed, is
  rejected and counted; with a key nobody without it can write a line that verifies;
- a verified line is used only if it is plausible: each process's step lines count up by one
  from its start line, its clock never runs back nor faster than the wall clock since its start,
  no line lies in the future, a process resumes at a step an earlier line reached;
- the bill: the checkpoint's clock, moved up to the newest plausible line past it, provided that
  line claims no more seconds past the checkpoint than the wall clock let pass since the
  checkpoint's own `checkpoint` line (or, for a process killed between a checkpoint's write and
  its line, since the ledger's line at that step).

Without a key the chain is tamper-evident, not forgery-proof: someone who can write the run
folder and knows this format can append lines that verify, and the checks above then bound what
they can add to the bill by the real time elapsed since the checkpoint. With a key, nobody
without it can raise the bill at all. Anyone who can write the folder can still remove lines
(or the whole ledger): that can only lower the bill, by the removed lines' seconds, and is
warned about (lines that fail their mac, places where lines are missing).

Unbilled time after kill -9: the lines are in the page cache the moment write(2) returns, so a
killed process loses none; what it worked after its last line is not billed. That is at most
one step boundary: one optimizer step, an eval, a checkpoint write (a line follows each), or
the set-up before the `start` line. A machine crash loses the lines written since the last
fsync: at every checkpoint record and at least every `FSYNC_EVERY_S`. A line the disk refuses is
kept in memory and written before the next one (in order, so the chain holds); a process killed
with lines still pending loses them.

Cost: about 240 bytes and 50 us per step (measured on a shared 2-core machine); a resume
reads 100,000 lines in about 3 s there (a 0.1 s-per-step run makes that many in 3 hours).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import time
import uuid
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from telemetry.reader import list_segments, read_segment_lines
from training.safe_files import ensure_inside, open_for_append

LEDGER_KEY_ENV = "TRAINWISE_LEDGER_KEY"
LEDGER_FOLDER = "ledger"
FORMAT_VERSION = 1
KINDS = ("start", "step", "mark", "checkpoint", "end", "unwritten")
MAC_HEX = 32  # 128 bits of the HMAC: forging one is still 2**128 guesses
GENESIS = "0" * MAC_HEX  # `prev` of a ledger's first line
FSYNC_EVERY_S = 30.0
# Clock checks: perf_counter and the wall clock may drift apart a little, and a line's wall time
# is taken a moment after its elapsed time; 2 s and 0.1 % absorb both, not a forged hour.
CLOCK_SLACK_S = 2.0
RATE_SLACK = 1e-3
MAX_PENDING_LINES = 100_000  # lines a refusing disk may hold back before new ones are dropped
_write_fd = os.write  # the one call that appends; fault-injection tests replace it


def ledger_key(key: str | bytes | None = None) -> bytes:
    """The mac key: `key` if given, else `TRAINWISE_LEDGER_KEY`, else one derived from the
    deployment's checkpoint key (`training._checkpoint_trust.state_key`: `TRAINWISE_STATE_KEY`
    or `<TRAINWISE_HOME>/state.key`, outside the run folder). b"" (unkeyed) only when neither
    can be had, with a warning."""
    if key is None:
        key = os.environ.get(LEDGER_KEY_ENV, "")
        if not key:
            return _derived_key()
    return key.encode("utf-8") if isinstance(key, str) else bytes(key)


def _derived_key() -> bytes:
    # A key of its own (HMAC of a label), so a ledger mac is never also a valid manifest mac.
    try:
        from training._checkpoint_trust import StateFileError, state_key
    except ImportError:  # pragma: no cover - the checkpoint trust module is part of the tree
        return b""
    try:
        deployment = state_key(create=True)
    except (StateFileError, OSError) as error:
        warnings.warn(f"the run ledger is written unkeyed: the deployment key could not be had "
                      f"({error}); set {LEDGER_KEY_ENV} or fix the key named above",
                      RuntimeWarning, stacklevel=3)
        return b""
    return hmac.new(deployment, b"trainwise run ledger v1", hashlib.sha256).digest() \
        if deployment else b""


def ledger_path(out_dir: str | Path, run_id: str, rank: int = 0) -> Path:
    """`<out_dir>/ledger/<run_id>/rank<R>.jsonl` (run_id is checked by the caller's rank_dir)."""
    return Path(out_dir) / LEDGER_FOLDER / run_id / f"rank{rank}.jsonl"


def _content(fields: dict[str, Any]) -> bytes:
    # The mac covers every field but the mac itself, in one canonical encoding.
    body = {k: v for k, v in fields.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def line_mac(key: bytes, fields: dict[str, Any]) -> str:
    """The mac of a line's fields (`prev` included, `mac` excluded)."""
    return hmac.digest(key, _content(fields), "sha256").hex()[:MAC_HEX]


@dataclass(slots=True)
class LedgerLine:
    """A line whose mac verified (`plausible`, `why`, `skipped` are set while reading)."""

    n: int
    proc: str
    kind: str
    step: int
    elapsed_s: float
    wall_time_s: float
    mac: str
    prev: str
    record: dict[str, Any] | None = None
    # kind "checkpoint": the checkpoint that became durable (its step, clock and sha256).
    checkpoint_step: int | None = None
    checkpoint_elapsed_s: float | None = None
    sha256: str | None = None
    # kind "start": the hourly price the process bills at (None: a line written before it was kept)
    price_usd_per_hour: float | None = None
    skipped: int = 0  # lines missing right before it (its `prev` is not the line before)
    plausible: bool = True
    why: str = ""  # why not plausible


@dataclass(frozen=True)
class LedgerRead:
    path: Path
    lines: list[LedgerLine]  # verified, in file order
    rejected: list[str]  # "line N: why" of each line that did not verify
    gaps: int  # verified lines whose `prev` is not the previous verified line (lines removed)
    torn_bytes: int  # a last line without its newline (a killed write): ignored
    keyed: bool
    run_id: str
    rank: int

    @property
    def head(self) -> tuple[int, str]:
        """(next n, prev) for the next line appended: after the last verified line."""
        if not self.lines:
            return 0, GENESIS
        last = self.lines[-1]
        return last.n + 1, last.mac

    @property
    def implausible(self) -> list[LedgerLine]:
        return [line for line in self.lines if not line.plausible]

    def problems(self) -> list[str]:
        """One sentence per thing a reader of the bill should know (empty: none)."""
        said = []
        if self.rejected:
            said.append(f"{len(self.rejected)} line(s) of {self.path} failed their check and "
                        f"were ignored ({'; '.join(self.rejected[:3])})")
        if self.gaps:
            said.append(f"{self.gaps} place(s) in {self.path} where lines were removed")
        bad = self.implausible
        if bad:
            said.append(f"{len(bad)} verified line(s) of {self.path} were not believed and not "
                        f"billed ({'; '.join(f'line n={b.n}: {b.why}' for b in bad[:3])})")
        return said


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)  # one for all lines: a new one
# per `json.loads(..., parse_constant=...)` call was a third of a resume's read time


_MAC_SUFFIX_BYTES = len(b',"mac":""}') + MAC_HEX
# `type(...) in`, not isinstance: a bool is no int here.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "v": (int,), "run_id": (str,), "rank": (int,), "n": (int,), "proc": (str,), "kind": (str,),
    "step": (int,), "elapsed_s": (int, float), "wall_time_s": (int, float), "prev": (str,),
    "mac": (str,)}


def _mac_of_raw(key: bytes, raw: bytes, fields: dict[str, Any]) -> str:
    """The mac a line should carry. The writer writes the canonical content with the mac
    appended last, so the content is the raw line without that suffix (no re-encoding,
    which doubled a resume's read); any other layout is re-encoded."""
    suffix = raw[-_MAC_SUFFIX_BYTES:]
    if suffix.startswith(b',"mac":"') and suffix.endswith(b'"}'):
        content = raw[:-_MAC_SUFFIX_BYTES] + b"}"
        if content.startswith(b'{"'):
            fast = hmac.digest(key, content, "sha256").hex()[:MAC_HEX]
            if fast == fields.get("mac"):
                return fast
    return line_mac(key, fields)


def _parse(raw: bytes, key: bytes, run_id: str, rank: int) -> LedgerLine | str:
    """A verified line, or why it is rejected."""
    try:
        fields = _DECODER.decode(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        return f"not JSON ({type(error).__name__})"
    if not isinstance(fields, dict):
        return "not a JSON object"
    if any(type(fields.get(name)) not in kinds for name, kinds in _FIELD_TYPES.items()):
        return "a field is missing or mistyped"
    if fields["v"] != FORMAT_VERSION or fields["kind"] not in KINDS:
        return f"unknown version {fields['v']!r} or kind {fields['kind']!r}"
    if not hmac.compare_digest(fields["mac"], _mac_of_raw(key, raw, fields)):
        return "mac does not verify (edited, forged, or written with another key)"
    if fields["run_id"] != run_id or fields["rank"] != rank:
        return f"belongs to run {fields['run_id']!r} rank {fields['rank']}"
    elapsed_s, wall_time_s = float(fields["elapsed_s"]), float(fields["wall_time_s"])
    if not (math.isfinite(elapsed_s) and elapsed_s >= 0 and math.isfinite(wall_time_s)
            and fields["step"] >= 0 and fields["n"] >= 0):
        return "negative or non-finite step, n or clock"
    record = fields.get("record")
    if fields["kind"] == "unwritten" and not isinstance(record, dict):
        return "an unwritten line without its record"
    checkpoint: dict[str, Any] = {}
    if fields["kind"] == "checkpoint":
        step, clock, sha = (fields.get("checkpoint_step"), fields.get("checkpoint_elapsed_s"),
                            fields.get("sha256"))
        if (type(step) is not int or type(clock) not in (int, float) or not isinstance(sha, str)
                or not 0 <= step <= fields["step"] or not 0 <= clock <= elapsed_s):
            return "a checkpoint line without a sound checkpoint step, clock and sha256"
        checkpoint = {"checkpoint_step": step, "checkpoint_elapsed_s": float(clock),
                      "sha256": sha}
    price = fields.get("price_usd_per_hour")
    if price is not None and (type(price) not in (int, float) or not math.isfinite(price)
                              or price < 0):
        return "a start line with a negative, non-finite or mistyped price"
    return LedgerLine(n=fields["n"], proc=fields["proc"], kind=fields["kind"],
                      step=fields["step"], elapsed_s=elapsed_s, wall_time_s=wall_time_s,
                      mac=fields["mac"], prev=fields["prev"],
                      record=record if isinstance(record, dict) else None,
                      price_usd_per_hour=None if price is None else float(price), **checkpoint)


@dataclass
class _Process:
    start_elapsed_s: float
    start_wall_s: float
    step: int
    elapsed_s: float


def _judge(lines: list[LedgerLine], now_wall_s: float) -> list[LedgerLine]:
    """Marks each verified line plausible or not, in place (see the module docstring)."""
    processes: dict[str, _Process] = {}
    max_step: int | None = None
    for line in lines:
        why = ""
        proc = processes.get(line.proc)
        if line.wall_time_s > now_wall_s + CLOCK_SLACK_S:
            why = f"wall time {line.wall_time_s:.0f} is in the future"
        elif line.kind == "start":
            if proc is not None:
                why = "a second start line of one process"
            elif max_step is not None and line.step > max_step:
                why = f"resumes at step {line.step}, which no earlier line reached"
        elif proc is None:
            why = "no start line for its process"
        # Lines removed before this one (an edited line fails its mac) may have been steps.
        elif line.kind == "step" and not proc.step < line.step <= proc.step + 1 + line.skipped:
            why = f"step {line.step} does not follow step {proc.step}"
        elif line.kind != "step" and not proc.step <= line.step <= proc.step + line.skipped:
            why = f"a {line.kind} line at step {line.step}, but its process is at {proc.step}"
        else:
            # The step follows: even if its clock is not believed, the next line follows it
            # (one clock hiccup must not discredit the rest of the process).
            proc.step = line.step
            if line.elapsed_s < proc.elapsed_s:
                why = "its clock went back"
            elif (line.elapsed_s - proc.start_elapsed_s > (line.wall_time_s - proc.start_wall_s)
                  * (1 + RATE_SLACK) + CLOCK_SLACK_S):
                why = "more seconds than the wall clock let pass since its process started"
        if why:
            line.plausible, line.why = False, why
            continue
        if line.kind == "start":
            processes[line.proc] = _Process(line.elapsed_s, line.wall_time_s, line.step,
                                            line.elapsed_s)
        else:
            assert proc is not None
            proc.elapsed_s = line.elapsed_s
        max_step = line.step if max_step is None else max(max_step, line.step)
    return lines


def read_ledger(path: str | Path, *, run_id: str, rank: int = 0, key: bytes | None = None,
                now_wall_s: float | None = None) -> LedgerRead:
    """Reads and checks a ledger (a missing file reads as empty); never raises on its content."""
    path = Path(path)
    key = ledger_key() if key is None else key
    try:
        data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
    except OSError as error:
        warnings.warn(f"cannot read the run ledger {path} ({error}); nothing past the "
                      "checkpoint is billed", RuntimeWarning, stacklevel=2)
        data = b""
    complete = data[: data.rfind(b"\n") + 1]
    lines, rejected, gaps = [], [], 0
    for number, raw in enumerate(complete.splitlines(), 1):
        parsed = _parse(raw, key, run_id, rank)
        if isinstance(parsed, str):
            rejected.append(f"line {number}: {parsed}")
            continue
        expected_prev = lines[-1].mac if lines else GENESIS
        if parsed.prev != expected_prev:
            gaps += 1
            # How many lines are missing, by the sequence numbers (each is under the mac).
            parsed.skipped = max(0, parsed.n - (lines[-1].n + 1 if lines else 0))
        lines.append(parsed)
    now = time.time() if now_wall_s is None else now_wall_s
    return LedgerRead(path=path, lines=_judge(lines, now), rejected=rejected, gaps=gaps,
                      torn_bytes=len(data) - len(complete), keyed=bool(key), run_id=run_id,
                      rank=rank)


@dataclass(frozen=True)
class CommittedBill:
    """What a resume bills past its checkpoint, from the ledger alone."""

    lost_s: float | None  # None: the ledger says nothing about this checkpoint
    replay_to_step: int | None  # the newest step recorded past the checkpoint (None: none)
    billed_elapsed_s: float  # the clock the resumed run goes on from
    newest_step: int | None  # the newest plausible step line (for the telemetry cross-check)
    warnings: list[str] = field(default_factory=list)


def _checkpoint_taken_wall_s(good: list[LedgerLine], state_step: int, state_elapsed_s: float,
                             sha256: str | None, said: list[str], path: Path) -> float | None:
    """When, by the wall clock, the checkpoint resumed from was taken; None: the ledger does not
    know it. First its own `checkpoint` line (same sha256, step and clock: this checkpoint and
    no other); else, for a process killed between the write and its record, the newest line at
    the checkpoint's step whose clock is not past the checkpoint's."""
    for line in reversed(good):
        if (line.kind == "checkpoint" and sha256 is not None and line.sha256 == sha256
                and line.checkpoint_step == state_step
                and abs((line.checkpoint_elapsed_s or 0.0) - state_elapsed_s) <= 1e-9):
            return line.wall_time_s - (line.elapsed_s - state_elapsed_s)
    at_step = [line for line in good if line.step == state_step
               and line.elapsed_s <= state_elapsed_s + 1e-9]
    if not at_step:
        if good:
            said.append(f"the run ledger {path} holds no line at the checkpoint's step "
                        f"{state_step} (it was written elsewhere, or the ledger was replaced); "
                        "only the checkpoint's clock is billed")
        return None
    if sha256 is not None:
        said.append(f"the run ledger {path} has no record of checkpoint {sha256[:12]} (step "
                    f"{state_step}) becoming durable (a process killed between its write and "
                    "its record?); the bill is based on the ledger's line at that step")
    base = max(at_step, key=lambda line: line.elapsed_s)
    return base.wall_time_s + (state_elapsed_s - base.elapsed_s)


def committed_bill(read: LedgerRead, *, state_step: int, state_elapsed_s: float,
                   checkpoint_sha256: str | None = None) -> CommittedBill:
    """The bill of a resume from a checkpoint at (`state_step`, `state_elapsed_s`) whose payload
    has `checkpoint_sha256` (None: unknown).

    The ledger says when, by the wall clock, that checkpoint was taken
    (`_checkpoint_taken_wall_s`). A plausible line past the checkpoint's clock is billed unless
    it claims more seconds past the checkpoint than the wall clock let pass since then."""
    said = read.problems()
    good = [line for line in read.lines if line.plausible]
    newest_step = max((line.step for line in good), default=None)
    taken_wall_s = _checkpoint_taken_wall_s(good, state_step, state_elapsed_s,
                                            checkpoint_sha256, said, read.path)
    if taken_wall_s is None:
        return CommittedBill(None, None, state_elapsed_s, newest_step, said)
    past = []
    for line in good:
        if line.elapsed_s <= state_elapsed_s:
            continue
        allowed_s = max(0.0, line.wall_time_s - taken_wall_s) * (1 + RATE_SLACK) + CLOCK_SLACK_S
        if line.elapsed_s - state_elapsed_s > allowed_s:
            said.append(f"line n={line.n} of {read.path} claims {line.elapsed_s - state_elapsed_s:.1f}"
                        f" s past the checkpoint, more than the {allowed_s:.1f} s the wall clock "
                        "let pass: not billed")
            continue
        past.append(line)
    if not past:
        return CommittedBill(0.0, None, state_elapsed_s, newest_step, said)
    billed_s = max(line.elapsed_s for line in past)
    steps = [line.step for line in past if line.step > state_step]
    return CommittedBill(billed_s - state_elapsed_s, max(steps) if steps else None, billed_s,
                         newest_step, said)


def record_identity(record: dict[str, Any]) -> tuple[Any, ...]:
    """What makes a telemetry record the same record: its type, rank, step and wall time (the
    writer's clock to the microsecond)."""
    return (record.get("type"), record.get("rank"), record.get("step"), record.get("wall_time_s"))


def unwritten_records(read: LedgerRead, written: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records a full telemetry disk refused that telemetry still lacks, once each, in order.

    `written`: the records the rank's telemetry holds (read them just before). Only verified
    lines count, and only records of the ledger's own run and rank."""
    seen = {record_identity(record) for record in written}
    found = []
    for line in read.lines:
        record = line.record
        if line.kind != "unwritten" or record is None:
            continue
        identity = record_identity(record)
        if identity in seen or record.get("run_id") != read.run_id \
                or record.get("rank") != read.rank:
            continue
        seen.add(identity)
        found.append(record)
    return found


def pending_telemetry(read: LedgerRead, telemetry_run_dir: Path) -> list[dict[str, Any]]:
    """`unwritten_records` against what the rank's telemetry (`<telemetry>/<run_id>`) holds now.

    A segment that cannot be read is left out of the comparison (its rows cannot be ingested
    either); its reader error is the one to fix."""
    if not any(line.kind == "unwritten" for line in read.lines):
        return []
    written: list[dict[str, Any]] = []
    try:
        segments = list_segments(telemetry_run_dir) if telemetry_run_dir.is_dir() else []
    except OSError:
        segments = []
    for segment in segments:
        if segment.rank != read.rank:
            continue
        try:
            written.extend(record for _, record in read_segment_lines(segment))
        except (ValueError, OSError):
            continue
    return unwritten_records(read, written)


class LedgerWriter:
    """Appends lines to one rank's ledger; never raises for a full disk (lines wait, see above).

    `out_dir` is the run folder; the ledger must resolve inside it (no link out)."""

    def __init__(self, out_dir: str | Path, run_id: str, *, rank: int = 0,
                 head: tuple[int, str] = (0, GENESIS), key: bytes | None = None) -> None:
        self.path = ledger_path(out_dir, run_id, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        ensure_inside(out_dir, self.path)
        self.run_id, self.rank = run_id, rank
        self.key = ledger_key() if key is None else key
        self.proc = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._next_n, self._prev = head
        self._fd: int | None = open_for_append(self.path)
        self._good_bytes = os.fstat(self._fd).st_size
        self._pending: list[bytes] = []
        self._synced_at = time.monotonic()
        self.failure: OSError | None = None  # the newest refused write (None once written)
        self.dropped = 0  # lines lost because too many were pending

    def commit(self, kind: str, *, step: int, elapsed_s: float,
               record: dict[str, Any] | None = None, sync: bool = False,
               **extra: Any) -> None:
        """Appends one line (or keeps it pending while the disk refuses). `extra`: the fields
        of a `checkpoint` line (checkpoint_step, checkpoint_elapsed_s, sha256), or a `start`
        line's price_usd_per_hour (the bill's price: under the mac, unlike telemetry's)."""
        fields: dict[str, Any] = {
            "v": FORMAT_VERSION, "run_id": self.run_id, "rank": self.rank, "n": self._next_n,
            "proc": self.proc, "kind": kind, "step": int(step), "elapsed_s": float(elapsed_s),
            "wall_time_s": time.time(), "prev": self._prev,
        }
        if record is not None:
            fields["record"] = record
        fields.update(extra)
        fields["mac"] = line_mac(self.key, fields)
        if len(self._pending) >= MAX_PENDING_LINES:
            self.dropped += 1  # the chain stays whole: a dropped line never got its n
            return
        self._next_n, self._prev = self._next_n + 1, fields["mac"]
        self._pending.append(_content(fields)[:-1] + f',"mac":"{fields["mac"]}"}}\n'.encode())
        self._flush()
        if sync or time.monotonic() - self._synced_at >= FSYNC_EVERY_S:
            self.sync()

    def _flush(self) -> None:
        if self._fd is None or not self._pending:
            return
        data = b"".join(self._pending)
        written = 0
        try:
            while written < len(data):
                written += _write_fd(self._fd, data[written:])
        except OSError as error:
            try:  # cut a partial line off, so the file ends at a newline
                os.ftruncate(self._fd, self._good_bytes)
            except OSError:
                pass
            if self.failure is None:
                warnings.warn(f"cannot append to the run ledger {self.path} ({error}); its lines "
                              "wait in memory until the disk takes them. Free space there: a "
                              "process killed meanwhile is billed only to its last written line",
                              RuntimeWarning, stacklevel=3)
            self.failure = error
            return
        self._good_bytes += len(data)
        self._pending.clear()
        self.failure = None

    def sync(self) -> None:
        """fsync: the lines so far survive a machine crash."""
        self._synced_at = time.monotonic()
        if self._fd is None or self._pending:
            return
        try:
            os.fsync(self._fd)
        except OSError as error:
            self.failure = error

    def close(self) -> None:
        if self._fd is None:
            return
        self._flush()
        self.sync()
        os.close(self._fd)
        self._fd = None
