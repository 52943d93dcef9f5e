"""Columns of sealed telemetry segments without parsing their lines in Python (issue 29).

`telemetry.store.ingest` used to parse every line with the standard library's decoder, check it
field by field and re-encode it: 75% of its CPU time. For a sealed segment (its marker's sha256
checked by `telemetry.reader.segment_body`), `sealed_columns` decodes the whole body with one
msgspec call into a small struct per line (type, run_id, rank, step, wall_time_s; the other
fields are checked as JSON and skipped, not built), finds the line ends with numpy, and hands
the line texts to the store as one Arrow array of the `arrow.json` type (the body's bytes less
its newlines, one copy), which DuckDB takes as JSON without parsing them again.

Why not DuckDB's own reader (`read_ndjson` with an explicit schema), measured again for issue 29
on DuckDB 2.0.1 over the 1M events of `benchmarks/ingestion.py --full` (465 MiB, 1001 sealed
segments; CPU seconds, one thread):
- typed columns (type, run_id, rank, step, wall_time_s) by `read_ndjson(..., columns=...)`: 0.84 s,
  against 0.44 s for msgspec's `decode_lines` of the same fields;
- `read_ndjson` cannot hand back a line's text for `payload`: `read_json(records=false)` with a
  JSON column writes the value out again (1M lines came back 12 bytes longer); the text needs
  a second reader (`read_csv` of whole lines, 0.40 s) and `from_json` per line (1.33 s both);
- the whole INSERT ... SELECT from those, over every file in one statement, line numbers by
  `WITH ORDINALITY`: 2.62 s, the same as msgspec's columns plus the Arrow insert (2.65 s); one
  statement per segment (its line numbers its own) 4.5 s;
- its parser accepts what the reader refuses: NaN, Infinity, trailing commas, any nesting
  depth; and a duplicate key reads as its first value (`from_json`) where Python reads the last.
  Each would need a check of its own per line.
So DuckDB reading the files costs as much CPU, checks less, and still needs the bytes read in
Python for the marker's sha256; msgspec stays, and DuckDB takes its columns as Arrow.

Strictness. msgspec is stricter than the standard library where they differ (it refuses NaN,
trailing commas, a lone surrogate escape, a float step, a bool rank), so it never accepts a line
the strict path (`telemetry.reader.parse_text`) refuses, given these checks around it:
- ASCII only: msgspec skips unknown fields without checking their UTF-8 (and the writer writes
  ASCII, `ensure_ascii`, so other text is not its canonical text anyway);
- one JSON object per line: `decode_lines` reads a stream of values and takes a newline for
  blank space, so `{"a":[` then `]}{...}` would pass as two values on two lines. When every line
  starts with `{` and ends with `}` (checked around each newline), no newline can sit inside a
  value (inside an object or array, a `}` must be followed by `,`, `]` or `}`, never `{`), so as
  many values as lines means one object per line;
- nesting: both decoders stop at the interpreter's recursion limit, a few levels apart, so
  msgspec decodes `_DEPTH_MARGIN_FRAMES` frames deeper and stops ~100 levels sooner;
- run_id and rank are `Literal`s of the folder's: a misplaced line fails the decode.
A segment refused anywhere takes the strict path, which names the file, the line and the fix as
before, or stores the lines if they are valid after all (non-ASCII text, a float out of range).

Canonical text. A sealed segment's lines are stored as written: they are the writer's
`json.dumps` text (the marker's sha256 says the bytes are the ones it sealed). Where the text may
not be the writer's, the caller checks it: the first line, whose canonical form is the segment
key, and every open segment (no seal: a hand edit lands there), which takes the strict path.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from itertools import accumulate
from operator import attrgetter
from typing import Annotated, Literal

import msgspec
import numpy as np
import pyarrow as pa

_MAX_BIGINT = 2**63 - 1  # DuckDB's BIGINT, the `step` column
_DEPTH_MARGIN_FRAMES = 100  # see "nesting" in the module docstring
JSON_TYPE = pa.json_(pa.string())  # DuckDB reads this Arrow type as JSON, unparsed
_NEWLINE, _OPEN, _CLOSE = ord("\n"), ord("{"), ord("}")
_TYPE, _STEP, _WALL_TIME_S = attrgetter("type"), attrgetter("step"), attrgetter("wall_time_s")


# Arrow arrays are built from buffers (`struct.pack`, `str.join`), not with
# `pa.array`: that converts element by element and, on its first call, imports pandas to ask
# whether the list is a Series (0.4 s and 40 MiB in a fresh process, for nothing here).


def _packed(kind: pa.DataType, code: str, values) -> pa.Array:
    values = values if isinstance(values, (list, tuple)) else list(values)
    data = struct.pack(f"<{len(values)}{code}", *values)  # twice as fast as `array`
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(data)])


def int64_array(values: list[int]) -> pa.Array:
    return _packed(pa.int64(), "q", values)


def int32_range(first: int, count: int) -> pa.Array:
    return _packed(pa.int32(), "i", range(first, first + count))


def float64_array(values: list[float | None]) -> pa.Array:
    """Floats, None as null (ints are converted, as `float()` would)."""
    if None not in values:
        return _packed(pa.float64(), "d", values)
    valid = sum(1 << index for index, value in enumerate(values) if value is not None)
    data = struct.pack(f"<{len(values)}d", *(0.0 if value is None else value for value in values))
    return pa.Array.from_buffers(pa.float64(), len(values), [
        pa.py_buffer(valid.to_bytes((len(values) + 7) // 8, "little")), pa.py_buffer(data)])


def string_array(values: list[str]) -> pa.Array:
    data = "".join(values).encode("utf-8")
    if len(data) == sum(map(len, values)):  # ASCII: a character is a byte
        lengths = map(len, values)
    else:
        lengths = (len(value.encode("utf-8")) for value in values)
    offsets = struct.pack(f"<{len(values) + 1}i", *accumulate(lengths, initial=0))
    return pa.Array.from_buffers(pa.string(), len(values),
                                 [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def repeated_string(value: str, count: int) -> pa.Array:
    data = value.encode("utf-8")
    offsets = struct.pack(f"<{count + 1}i", *range(0, len(data) * (count + 1), len(data)))
    return pa.Array.from_buffers(pa.string(), count,
                                 [None, pa.py_buffer(offsets), pa.py_buffer(data * count)])


def repeated_int32(value: int, count: int) -> pa.Array:
    return pa.Array.from_buffers(pa.int32(), count,
                                 [None, pa.py_buffer(struct.pack("<i", value) * count)])


def equal_strings(strings: pa.Array, text: str) -> np.ndarray:
    """Which values of a string array without nulls equal `text`, as a numpy bool array. Not
    `pyarrow.compute.equal`: its first call adds 40 MiB to the process's RSS."""
    target = text.encode("utf-8")
    count = len(strings)
    _, offsets_buffer, data_buffer = strings.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int32, count + 1, strings.offset * 4)
    starts = offsets[:-1]
    match = (offsets[1:] - starts) == len(target)
    if data_buffer is None or not match.any():
        return match
    data = np.frombuffer(data_buffer, np.uint8)
    for index, byte in enumerate(target):
        match[match] = data[starts[match] + index] == byte
    return match


def int64_values(values: pa.Array) -> np.ndarray:
    """The values of an int64 array without nulls, as numpy over its buffer (no copy). Not
    `to_numpy`: its first call imports pandas (40 MiB of RSS)."""
    return np.frombuffer(values.buffers()[1], np.int64, len(values), values.offset * 8)


@dataclass(frozen=True)
class SegmentColumns:
    """The store's per-line columns of lines `first`.. of one segment, in line order."""

    event_type: pa.Array  # string
    step: pa.Array  # int64
    wall_time_s: pa.Array  # float64, null where absent
    payload: pa.Array  # JSON_TYPE: the stored text of each line
    first: int = 0

    def __len__(self) -> int:
        return len(self.step)

    def tail(self, start: int) -> SegmentColumns:
        """Lines `start`.. (the ones an earlier ingest of a growing segment did not store)."""
        return SegmentColumns(
            self.event_type.slice(start), self.step.slice(start), self.wall_time_s.slice(start),
            self.payload.slice(start), self.first + start)


@dataclass(frozen=True)
class SegmentRows:
    """The lines of one segment that a store lacks: lines `columns.first`.. of the segment."""

    rank: int
    segment: int
    segment_key: str
    run_instance: str
    columns: SegmentColumns


@functools.lru_cache(maxsize=256)
def _decoder(run_id: str, rank: int) -> msgspec.json.Decoder:
    """A decoder of one line of (run_id, rank): the fields the store needs, typed strictly."""
    line = msgspec.defstruct("TelemetryLine", [
        ("type", str),
        ("run_id", Literal[run_id]),  # type: ignore[valid-type]  # the folder's, nothing else
        ("rank", Literal[rank]),  # type: ignore[valid-type]
        ("step", Annotated[int, msgspec.Meta(ge=0, le=_MAX_BIGINT)]),
        ("wall_time_s", float | None, None),
    ], gc=False)  # a thousand structs a segment, no cycles: not worth the collector's time
    return msgspec.json.Decoder(line)


def _deeper(frames: int, decode, body: bytes):
    return decode(body) if frames == 0 else _deeper(frames - 1, decode, body)


def payload_array(texts: list[str]) -> pa.Array:
    """Line texts as DuckDB JSON (no parse on insert: they were checked before)."""
    return pa.ExtensionArray.from_storage(JSON_TYPE, string_array(texts))


def _line_texts(body: bytes) -> pa.Array | None:
    """The lines of `body` as a string array over its bytes less the newlines, or None unless
    every line starts with `{` and ends with `}` (see "one JSON object per line")."""
    view = np.frombuffer(body, np.uint8)
    ends = np.flatnonzero(view == _NEWLINE)
    framed = (view[0] == _OPEN and (view[ends - 1] == _CLOSE).all()
              and (view[ends[:-1] + 1] == _OPEN).all())
    if not framed:
        return None
    # Line i starts at ends[i - 1] + 1 in the body, i bytes earlier once the newlines are gone.
    offsets = np.zeros(len(ends) + 1, np.int32)
    offsets[1:] = ends - np.arange(len(ends))
    return pa.StringArray.from_buffers(len(ends), pa.py_buffer(offsets),
                                       pa.py_buffer(body.replace(b"\n", b"")))


def sealed_columns(body: bytes, run_id: str, rank: int) -> SegmentColumns | None:
    """Columns of a sealed segment's lines `body`, or None when they are not plainly the
    writer's (the strict path then decides; see the module docstring)."""
    if not (body.isascii() and body.endswith(b"}\n")):
        return None
    lines = _line_texts(body)
    if lines is None:
        return None
    try:
        records = _deeper(_DEPTH_MARGIN_FRAMES, _decoder(run_id, rank).decode_lines, body)
    except (msgspec.MsgspecError, RecursionError):
        return None
    if len(records) != len(lines):
        return None
    return SegmentColumns(
        event_type=string_array(list(map(_TYPE, records))),
        step=int64_array(list(map(_STEP, records))),
        wall_time_s=float64_array(list(map(_WALL_TIME_S, records))),
        payload=pa.ExtensionArray.from_storage(JSON_TYPE, lines),
    )


def rows_table(run_id: str, parts: list[SegmentRows]) -> pa.Table:
    """Segments' new lines as one Arrow table of the store's columns (but `is_replay`)."""
    def constant(value_of, build) -> pa.ChunkedArray:
        chunks = [build(value_of(part), len(part.columns)) for part in parts]
        return pa.chunked_array(chunks, chunks[0].type)

    def column(name: str, kind: pa.DataType) -> pa.ChunkedArray:
        return pa.chunked_array([getattr(part.columns, name) for part in parts], kind)

    return pa.table({
        "run_id": constant(lambda part: run_id, repeated_string),
        "run_instance": constant(lambda part: part.run_instance, repeated_string),
        "rank": constant(lambda part: part.rank, repeated_int32),
        "segment": constant(lambda part: part.segment, repeated_int32),
        "segment_key": constant(lambda part: part.segment_key, repeated_string),
        "line_no": pa.chunked_array([int32_range(part.columns.first, len(part.columns))
                                     for part in parts], pa.int32()),
        "event_type": column("event_type", pa.string()),
        "step": column("step", pa.int64()),
        "wall_time_s": column("wall_time_s", pa.float64()),
        "payload": column("payload", JSON_TYPE),
    })
