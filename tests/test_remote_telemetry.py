"""The launcher's copy of remote agents' telemetry (`trainwise.remote_telemetry`): two starts'
segments become one run's, in start order; markers follow their segments; a sealed segment is
not read again; what is not the writer's (another rank name, the provider's rank, stray files)
stays in the store."""

from __future__ import annotations

import json

from telemetry.events import RunEndEvent, StepEvent, to_record
from telemetry.reader import read_run_events
from telemetry.writer import seal_segment
from trainwise.object_store import LocalObjectStore
from trainwise.remote_telemetry import SEGMENTS_PER_START, TelemetryMirror

RUN = "remote-7"


def _step(step: int) -> dict:
    return to_record(StepEvent(
        run_id=RUN, step=step, train_loss=1.0 / step, learning_rate=1e-3, grad_norm=1.0,
        grad_noise_scale=1.0, micro_batch_size=8, grad_accum_steps=1, step_time_ms=10.0,
        samples_seen=8 * step, tokens_seen=0, elapsed_s=0.01 * step, cost_usd=0.0))


def _put_segment(node, start: str, steps: range, *, status: str | None = None,
                 seal: bool = True, rank: str = "rank0", index: int = 0):
    """A node's telemetry as the agent's sync puts it into the store."""
    folder = node / start / RUN / rank
    folder.mkdir(parents=True, exist_ok=True)
    lines = [_step(s) for s in steps]
    if status is not None:
        lines.append(to_record(RunEndEvent(
            run_id=RUN, step=steps[-1], status=status, elapsed_s=1.0, cost_usd=0.0,
            samples_seen=8 * steps[-1], tokens_seen=0, final_eval_loss=None,
            final_eval_accuracy=None, checkpoint_path=None, checkpoint_sha256=None)))
    path = folder / f"segment-{index:05d}.jsonl"
    path.write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))
    if seal:
        seal_segment(path)
    return path


def _store_from(node, store: LocalObjectStore) -> None:
    for path in sorted(node.rglob("*")):
        if path.is_file():
            start, *rest = path.relative_to(node).parts
            store.put_file(path, f"runs/{RUN}/agent/starts/{start}/telemetry/{'/'.join(rest)}")


def test_two_starts_become_one_run_in_start_order(tmp_path):
    store, node = LocalObjectStore(tmp_path / "store"), tmp_path / "node"
    _put_segment(node, "20261207T100000Z-aaaaaa", range(1, 11), status="preempted")
    _put_segment(node, "20261207T101500Z-bbbbbb", range(11, 21), status="completed")
    _store_from(node, store)
    mirror = TelemetryMirror(store, RUN, tmp_path / "run", provider_rank=1000)
    assert mirror.sync() == 4  # two segments, two markers
    local = tmp_path / "run" / "telemetry" / RUN / "rank0"
    assert sorted(p.name for p in local.iterdir()) == [
        "segment-00000.complete", "segment-00000.jsonl",
        f"segment-{SEGMENTS_PER_START:05d}.complete",
        f"segment-{SEGMENTS_PER_START:05d}.jsonl"]
    events = read_run_events(tmp_path / "run" / "telemetry" / RUN, rank=0)
    assert [e["step"] for e in events if e["type"] == "step"] == list(range(1, 21))
    assert [e["status"] for e in events if e["type"] == "run_end"] == ["preempted", "completed"]
    assert mirror.sync() == 0  # sealed: nothing read or copied again


def test_an_open_segment_is_copied_as_it_grows_and_its_marker_after_it(tmp_path):
    store, node = LocalObjectStore(tmp_path / "store"), tmp_path / "node"
    start = "20261207T100000Z-aaaaaa"
    path = _put_segment(node, start, range(1, 4), seal=False)
    _store_from(node, store)
    mirror = TelemetryMirror(store, RUN, tmp_path / "run", provider_rank=1000)
    assert mirror.sync() == 1
    local = tmp_path / "run" / "telemetry" / RUN / "rank0" / "segment-00000.jsonl"
    assert local.read_bytes() == path.read_bytes()
    path = _put_segment(node, start, range(1, 7))  # grown, then sealed by the writer
    _store_from(node, store)
    assert mirror.sync() == 2
    assert local.read_bytes() == path.read_bytes()
    assert [e["step"] for e in read_run_events(local.parent.parent, rank=0)] == list(range(1, 7))


def test_what_is_not_the_writers_stays_in_the_store(tmp_path):
    store, node = LocalObjectStore(tmp_path / "store"), tmp_path / "node"
    start = "20261207T100000Z-aaaaaa"
    _put_segment(node, start, range(1, 3))
    _put_segment(node, start, range(1, 3), rank="rank1000")  # the provider's rank is ours
    _put_segment(node, start, range(1, 3), rank="rankX")
    (node / start / RUN / "rank0" / "notes.txt").write_text("not telemetry")
    _store_from(node, store)
    store.put_bytes(b"{}", f"runs/{RUN}/agent/starts/{start}/telemetry/other-run/rank0/"
                           "segment-00000.jsonl")
    TelemetryMirror(store, RUN, tmp_path / "run", provider_rank=1000).sync()
    local = tmp_path / "run" / "telemetry"
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == [
        f"{RUN}/rank0/segment-00000.complete", f"{RUN}/rank0/segment-00000.jsonl"]
