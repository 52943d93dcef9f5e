"""A resume's bill and replay range come from the trainer's run ledger, never from telemetry
(issue 31, class 4): planted sealed segments, rewritten markers declaring real lines torn, forged
or edited ledger lines, with and without a deployment key."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from telemetry.events import StepEvent, to_record
from telemetry.reader import TelemetryFormatError, TornLineWarning, read_run, read_run_events
from telemetry.writer import seal_segment
from tests.test_training_loop import text_examples, tiny_config
from tests.test_training_loop_faults import run_start_events, train_in_a_process_killed_at_step_20
from training import ledger as ledger_module
from training.checkpoint import load_checkpoint
from training.ledger import (
    GENESIS,
    LEDGER_KEY_ENV,
    ledger_path,
    line_mac,
    read_ledger,
)
from training.loop import train

HUGE_S = 10_000_000.0
HUGE_STEP = 10_000_000


def plant_sealed_segment(out_dir: Path, *, elapsed_s: float = HUGE_S, step: int = HUGE_STEP,
                         index: int = 99) -> Path:
    """A sealed segment with a self-consistent marker, as a forger would write it."""
    record = to_record(StepEvent(
        run_id="tiny", step=step, train_loss=1.0, learning_rate=1e-3, grad_norm=1.0,
        grad_noise_scale=1.0, micro_batch_size=8, grad_accum_steps=2, step_time_ms=1.0,
        samples_seen=step * 16, tokens_seen=0, elapsed_s=elapsed_s,
        cost_usd=elapsed_s * 3.06 / 3600))
    path = out_dir / "telemetry" / "tiny" / "rank0" / f"segment-{index:05d}.jsonl"
    path.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    seal_segment(path)
    return path


def stopped_run(out_dir: Path, steps: int = 8):
    """A run stopped after `steps` (checkpoint at `steps`): the committed truth is its result."""
    return train(tiny_config(), text_examples(), None, out_dir, stop_after_steps=steps)


def resume(out_dir: Path):
    return train(tiny_config(), text_examples(), None, out_dir,
                 resume_from=out_dir / "checkpoints")


def checkpoint_elapsed_s(out_dir: Path, step: int) -> float:
    return float(load_checkpoint(out_dir / "checkpoints" / f"step-{step:07d}.pt")["elapsed_s"])


def test_a_planted_sealed_segment_changes_neither_the_bill_nor_the_replay(tmp_path):
    first = stopped_run(tmp_path)
    truth_lost_s = first.elapsed_s - checkpoint_elapsed_s(tmp_path, 8)  # its run_end's clock
    plant_sealed_segment(tmp_path)
    with pytest.warns(RuntimeWarning, match="not billed"):
        resumed = resume(tmp_path)
    start = run_start_events(tmp_path)[-1]
    assert start["lost_s"] == pytest.approx(truth_lost_s, abs=1e-9)
    assert start["replay_from_step"] is None and start["replay_to_step"] is None
    assert resumed.elapsed_s < 60 and resumed.cost_usd < 0.1  # not 8,500 USD
    assert any("planted" in warning for warning in start["billing_warnings"])


def test_a_killed_process_is_billed_from_the_ledger_whatever_telemetry_says(tmp_path):
    status = train_in_a_process_killed_at_step_20(tmp_path)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    recorded = [e for e in read_run_events(tmp_path / "telemetry" / "tiny") if e["type"] == "step"]
    truth_s = max(e["elapsed_s"] for e in recorded)  # what the trainer committed, pre-plant
    plant_sealed_segment(tmp_path, step=23, elapsed_s=truth_s + 5_000.0)
    with pytest.warns(RuntimeWarning, match="past the"):
        train(tiny_config(checkpoint_every_steps=8), text_examples(), None, tmp_path,
              resume_from=tmp_path / "checkpoints")
    start = run_start_events(tmp_path)[-1]
    assert (start["replay_from_step"], start["replay_to_step"]) == (16, 20)
    assert start["lost_s"] == pytest.approx(truth_s - checkpoint_elapsed_s(tmp_path, 16), abs=1e-9)
    # The clock and the step, each said. A loaded machine may also kill the trainer before it
    # polled the step-16 checkpoint's background write, so the ledger lacks that checkpoint's
    # line: said too, and billed from the ledger's line at that step (the asserts above).
    said = [w for w in start["billing_warnings"] if "becoming durable" not in w]
    assert len(said) == 2, start["billing_warnings"]
    assert any("step 23" in w for w in said)


def test_a_rewritten_marker_declaring_real_lines_torn_is_refused(tmp_path):
    first = stopped_run(tmp_path)
    segment = tmp_path / "telemetry" / "tiny" / "rank0" / "segment-00000.jsonl"
    data = segment.read_bytes()
    keep = data[: data.index(b"\n") + 1]  # the forger keeps one line and declares the rest torn
    import hashlib

    segment.with_suffix(".complete").write_text(json.dumps({
        "lines": 1, "bytes": len(keep), "sha256": hashlib.sha256(keep).hexdigest(),
        "torn_bytes": len(data) - len(keep), "recovered": True}))
    with pytest.raises(TelemetryFormatError, match="complete line") as refused:
        read_run_events(first.telemetry_dir)
    assert str(segment.with_suffix(".complete")) in str(refused.value)
    assert "Delete the marker" in str(refused.value)
    segment.with_suffix(".complete").unlink()  # the fix the error names: every line is back
    assert len(read_run_events(first.telemetry_dir)) == data.count(b"\n")


def test_a_real_torn_line_is_counted_and_warned(tmp_path):
    stopped_run(tmp_path)
    rank0 = tmp_path / "telemetry" / "tiny" / "rank0"
    segment = rank0 / "segment-00000.jsonl"
    segment.with_suffix(".complete").unlink()
    segment.write_bytes(segment.read_bytes() + b'{"type":"step","run_id":"tiny","ra')
    lines = segment.read_bytes().count(b"\n")
    seal_segment(segment, recovered=True)  # what a resumed writer does after a kill -9
    with pytest.warns(TornLineWarning, match="1 torn line"):
        read = read_run(tmp_path / "telemetry" / "tiny")
    assert read.torn_lines == 1 and read.torn_bytes > 0 and read.torn_segments == [str(segment)]
    assert len(read.records) >= lines


def append_forged_line(out_dir: Path, key: bytes, **changes) -> None:
    """A line that chains after the ledger's last one, with a mac made with `key`."""
    path = ledger_path(out_dir, "tiny")
    last = json.loads(path.read_bytes().splitlines()[-1])
    fields = {**{k: v for k, v in last.items() if k != "mac"}, "n": last["n"] + 1,
              "prev": last["mac"], "wall_time_s": time.time(), **changes}
    fields["mac"] = line_mac(key, fields)
    with open(path, "a") as handle:
        handle.write(json.dumps(fields) + "\n")


@pytest.mark.parametrize(("key", "forger_key", "changes", "why"), [
    # A deployment without any key: the forger can make lines that verify; the clock checks
    # stop them.
    (None, b"", {"elapsed_s": HUGE_S}, "wall clock"),
    (None, b"", {"kind": "step", "step": HUGE_STEP}, "does not follow"),
    (None, b"", {"wall_time_s": time.time() + 86_400, "elapsed_s": 5_000.0}, "future"),
    (None, b"", {"kind": "start", "proc": "forged", "elapsed_s": HUGE_S}, "wall clock"),
    # Keyed (the default: derived from the deployment's checkpoint key, or set explicitly):
    # without the key nothing verifies, however plausible.
    ("", b"", {"elapsed_s": 30.0}, "mac does not verify"),
    ("deployment-secret", b"", {"elapsed_s": 30.0}, "mac does not verify"),
    ("deployment-secret", b"guess", {"kind": "step", "step": 9}, "mac does not verify"),
])
def test_forged_ledger_lines_are_not_billed(tmp_path, monkeypatch, key, forger_key, changes, why):
    if key is None:
        monkeypatch.setattr(ledger_module, "_derived_key", lambda: b"")
        monkeypatch.setenv(LEDGER_KEY_ENV, "")
    else:
        monkeypatch.setenv(LEDGER_KEY_ENV, key)
    first = stopped_run(tmp_path)
    truth_lost_s = first.elapsed_s - checkpoint_elapsed_s(tmp_path, 8)
    append_forged_line(tmp_path, forger_key, **changes)
    with pytest.warns(RuntimeWarning, match="resume bill"):
        resume(tmp_path)
    start = run_start_events(tmp_path)[-1]
    assert start["lost_s"] == pytest.approx(truth_lost_s, abs=1e-9)
    assert start["replay_to_step"] is None
    assert any(why in warning for warning in start["billing_warnings"]), start["billing_warnings"]


def test_an_edited_ledger_line_fails_its_mac_and_later_lines_still_verify(tmp_path, monkeypatch):
    monkeypatch.setenv(LEDGER_KEY_ENV, "k")
    stopped_run(tmp_path)
    path = ledger_path(tmp_path, "tiny")
    lines = path.read_bytes().splitlines()
    edited = json.loads(lines[3])
    edited["elapsed_s"] = HUGE_S
    lines[3] = json.dumps(edited).encode()
    path.write_bytes(b"\n".join(lines) + b"\n")
    read = read_ledger(path, run_id="tiny", key=b"k")
    assert len(read.rejected) == 1 and "line 4: mac" in read.rejected[0]
    assert len(read.lines) == len(lines) - 1 and read.gaps == 1
    assert all(line.plausible for line in read.lines)


def test_a_ledger_line_of_another_run_or_a_torn_last_line_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_module, "_derived_key", lambda: b"")  # a forger's best case
    stopped_run(tmp_path)
    path = ledger_path(tmp_path, "tiny")
    good = read_ledger(path, run_id="tiny")
    other = json.loads(path.read_bytes().splitlines()[-1])
    other.update(run_id="other", n=other["n"] + 1, prev=other["mac"], elapsed_s=HUGE_S)
    other["mac"] = line_mac(b"", other)
    path.write_bytes(path.read_bytes() + json.dumps(other).encode() + b"\n" + b'{"v":1,"ru')
    read = read_ledger(path, run_id="tiny")
    assert [line.mac for line in read.lines] == [line.mac for line in good.lines]
    assert "belongs to run 'other'" in read.rejected[0] and read.torn_bytes == 10
    assert read.head == good.head


def test_the_writer_keeps_lines_a_full_disk_refuses_and_writes_them_in_order(tmp_path,
                                                                            monkeypatch):
    """The lines wait in memory, in order and chained, until the disk takes them."""
    real_write = os.write
    refusing = {"on": True}

    def write(fd, data):
        if refusing["on"]:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(ledger_module, "_write_fd", write)
    writer = ledger_module.LedgerWriter(tmp_path, "r1")
    with pytest.warns(RuntimeWarning, match="wait in memory"):
        writer.commit("start", step=0, elapsed_s=0.0)
    writer.commit("step", step=1, elapsed_s=0.5)
    assert ledger_path(tmp_path, "r1").read_bytes() == b""
    refusing["on"] = False
    writer.commit("step", step=2, elapsed_s=1.0)
    writer.close()
    read = read_ledger(ledger_path(tmp_path, "r1"), run_id="r1")
    assert [line.step for line in read.lines] == [0, 1, 2] and read.gaps == 0
    assert read.lines[0].prev == GENESIS and all(line.plausible for line in read.lines)


def test_the_ledger_is_keyed_by_default_from_the_deployment_key(tmp_path, monkeypatch):
    monkeypatch.delenv(LEDGER_KEY_ENV, raising=False)
    stopped_run(tmp_path)
    path = ledger_path(tmp_path, "tiny")
    assert read_ledger(path, run_id="tiny").keyed
    assert not read_ledger(path, run_id="tiny").rejected
    unkeyed = read_ledger(path, run_id="tiny", key=b"")
    assert len(unkeyed.rejected) == len(path.read_bytes().splitlines())  # none verifies


def test_a_resume_bills_from_its_own_checkpoints_line(tmp_path):
    stopped_run(tmp_path)
    path = ledger_path(tmp_path, "tiny")
    read = read_ledger(path, run_id="tiny")
    (line,) = [line for line in read.lines if line.kind == "checkpoint"]
    state = load_checkpoint(tmp_path / "checkpoints" / "step-0000008.pt")
    assert line.checkpoint_step == 8 and line.checkpoint_elapsed_s == state["elapsed_s"]
    bill = ledger_module.committed_bill(read, state_step=8, state_elapsed_s=state["elapsed_s"],
                                        checkpoint_sha256=line.sha256)
    assert bill.warnings == [] and bill.lost_s > 0  # the run_end came after the checkpoint
    other = ledger_module.committed_bill(read, state_step=8, state_elapsed_s=state["elapsed_s"],
                                         checkpoint_sha256="0" * 64)
    assert other.lost_s == bill.lost_s and "no record of checkpoint" in other.warnings[0]
