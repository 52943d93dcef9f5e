"""Segment writer and reader: layout, rolling, sealing, torn lines, recovery, schema."""

from __future__ import annotations

import json
import math

import pytest

from telemetry.events import (
    EVENT_TYPES,
    BillEvent,
    DecisionEvent,
    StepEvent,
    event_from_record,
    to_record,
)
from telemetry.reader import list_segments, read_run_events
from telemetry.writer import SegmentWriter


def _step(step: int, run_id: str = "run-1", rank: int = 0, noise: float = 12.5) -> StepEvent:
    return StepEvent(
        run_id=run_id, rank=rank, step=step, wall_time_s=1000.0 + step, train_loss=2.0 / step,
        learning_rate=1e-3, grad_norm=0.5, grad_noise_scale=noise, micro_batch_size=8,
        grad_accum_steps=2, step_time_ms=10.0, samples_seen=16 * step, tokens_seen=0,
        elapsed_s=float(step), cost_usd=0.001 * step,
    )


def test_layout_rolling_sealing_and_order(tmp_path):
    with SegmentWriter(tmp_path, "run-1", events_per_segment=3) as writer:
        for step in range(1, 8):
            writer.write(_step(step))
    rank_dir = tmp_path / "run-1" / "rank0"
    names = sorted(p.name for p in rank_dir.iterdir())
    assert names == [
        "segment-00000.complete", "segment-00000.jsonl",
        "segment-00001.complete", "segment-00001.jsonl",
        "segment-00002.complete", "segment-00002.jsonl",
    ]
    assert json.loads((rank_dir / "segment-00002.complete").read_text())["lines"] == 1
    records = read_run_events(tmp_path / "run-1")
    assert [r["step"] for r in records] == list(range(1, 8))
    assert records[0]["type"] == "step" and records[0]["schema_version"] == 1


def test_every_line_is_flushed_before_close(tmp_path):
    writer = SegmentWriter(tmp_path, "run-1")
    writer.write(_step(1))
    writer.write(_step(2))
    # Open segment, read by another reader while the writer runs.
    assert [r["step"] for r in read_run_events(tmp_path / "run-1")] == [1, 2]
    assert not list_segments(tmp_path / "run-1")[0].complete
    writer.close()
    assert list_segments(tmp_path / "run-1")[0].complete


def test_a_torn_last_line_of_an_open_segment_is_skipped(tmp_path):
    writer = SegmentWriter(tmp_path, "run-1")
    for step in (1, 2):
        writer.write(_step(step))
    segment = writer.segment_path
    with open(segment, "a", encoding="utf-8") as handle:  # the process died mid-line
        handle.write('{"type":"step","run_id":"run-1","st')
    assert [r["step"] for r in read_run_events(tmp_path / "run-1")] == [1, 2]
    # A new writer (the resumed process) seals the orphan as recovered and starts the next one.
    with SegmentWriter(tmp_path, "run-1") as resumed:
        resumed.write(_step(3))
    marker = json.loads(segment.with_suffix(".complete").read_text())
    assert marker["recovered"] and marker["lines"] == 2 and marker["torn_bytes"] > 0
    assert [r["step"] for r in read_run_events(tmp_path / "run-1")] == [1, 2, 3]


def test_corruption_is_reported(tmp_path):
    with SegmentWriter(tmp_path, "run-1") as writer:
        writer.write(_step(1))
    segment = tmp_path / "run-1" / "rank0" / "segment-00000.jsonl"
    segment.write_text(segment.read_text().replace("step", "stop", 1))
    with pytest.raises(ValueError, match="does not match its completion marker"):
        read_run_events(tmp_path / "run-1")

    open_dir = tmp_path / "run-2" / "rank0"
    open_dir.mkdir(parents=True)
    (open_dir / "segment-00000.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        read_run_events(tmp_path / "run-2")
    with pytest.raises(FileNotFoundError, match="run that has started"):
        read_run_events(tmp_path / "missing")


def test_ranks_are_separate_and_a_writer_only_takes_its_own_events(tmp_path):
    with SegmentWriter(tmp_path, "run-1", rank=1) as rank1, SegmentWriter(tmp_path, "run-1") as r0:
        r0.write(_step(1))
        rank1.write(_step(1, rank=1))
        with pytest.raises(ValueError, match="own writer"):
            r0.write(_step(2, rank=1))
    assert [r["rank"] for r in read_run_events(tmp_path / "run-1")] == [0, 1]
    assert [r["rank"] for r in read_run_events(tmp_path / "run-1", rank=1)] == [1]
    with pytest.raises(ValueError, match="path separators"):
        SegmentWriter(tmp_path, "../escape")


def test_records_are_strict_json_and_round_trip():
    record = to_record(_step(3, noise=math.nan))
    assert record["grad_noise_scale"] is None  # NaN is not JSON
    json.dumps(record, allow_nan=False)
    assert event_from_record(record) == _step(3, noise=None)
    decision = DecisionEvent(
        run_id="r", step=4, layer="fast", policy="noop", action={"micro_batch_size": 8},
        reason="keep", numbers={"x": math.inf}, observation={"step": 4},
    )
    assert to_record(decision)["numbers"] == {"x": None}
    assert set(EVENT_TYPES) == {"run_start", "step", "eval", "checkpoint", "decision",
                                "preemption", "run_end", "bill"}
    bill = BillEvent(run_id="r", rank=1000, step=4, bill_usd=1.25, provider="emulated",
                     provider_time_s=math.nan, spot_share=0.5, nodes_held=1)
    assert to_record(bill)["provider_time_s"] is None and event_from_record(
        json.loads(json.dumps(to_record(bill), allow_nan=False))).bill_usd == 1.25
    with pytest.raises(ValueError, match="unknown type"):
        event_from_record({"type": "nope"})
