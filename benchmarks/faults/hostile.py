"""Hostile files: crafted to run code or to break a reader, dropped where trainwise reads files.

Every payload that could run code does one harmless, visible thing when it runs: it creates a
marker file (`open(marker, "w")` through pickle's `__reduce__`). "Code executed from files" is
the number of markers that exist afterwards: it must be 0. Each case also records how the
reader answered: refused with an error naming the file (good), or something else.

Cases:
- checkpoints: a format-1 file (embedded checksum that matches its own pickle); a payload with
  a forged commit manifest (format 2: an attacker who can write both files); each loaded
  directly, and planted as the newest checkpoint of a real run that a trainer then resumes.
- telemetry: a pickle as a segment, invalid UTF-8, a JSON array line, a huge step, a marker
  that lies; each read and ingested.
- spot traces (`cloud.traces.load_trace`): a pickle named `.json`, objects as data, a deeply
  nested document.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

from benchmarks.faults import harness


class _OpensMarker:
    """Pickles to `open(marker, "w")`: unpickling it runs code (creates the marker)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


def _torch_payload(marker: Path) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save({"step": 10_000, "model": {}, "hostile": _OpensMarker(marker)}, buffer)
    return buffer.getvalue()


def _answer(call) -> dict[str, Any]:
    """Runs a reader on a hostile file: how it answered."""
    try:
        value = call()
    except Exception as error:  # noqa: BLE001 - the answer is the finding
        return {"outcome": "refused", "error_type": type(error).__name__,
                "error": str(error)[:300]}
    return {"outcome": "accepted", "value_type": type(value).__name__}


def craft_checkpoint(path: Path, marker: Path, step: int) -> str:
    """Writes a hostile checkpoint at `path` that a loader trusting its digest would unpickle:
    format 2 (payload + forged manifest) when the tree has manifests, else format 1 (header)."""
    payload = _torch_payload(marker)
    digest = hashlib.sha256(payload).hexdigest()
    path.parent.mkdir(parents=True, exist_ok=True)
    if harness.has_manifests():
        module = harness.checkpoint_module()
        path.write_bytes(payload)
        manifest = {"format": getattr(module, "MANIFEST_FORMAT", "trainwise-checkpoint-manifest"),
                    "version": getattr(module, "FORMAT_VERSION", 2), "payload": path.name,
                    "step": step, "sha256": digest, "bytes": len(payload)}
        module.manifest_path(path).write_text(json.dumps(manifest))
        return "payload_with_forged_manifest"
    header = b"TRAINWISE-CHECKPOINT 1 sha256=%s bytes=%d\n" % (digest.encode(), len(payload))
    path.write_bytes(header + payload)
    return "format1_self_checksum"


def checkpoint_cases(work_dir: Path, donor: harness.Run | None, suite=None) -> list[dict]:
    """Direct loads of crafted checkpoints, and a resume of a copy of `donor` (a finished run)
    with one planted as its newest checkpoint."""
    module = harness.checkpoint_module()
    folder = work_dir / "hostile" / "checkpoints"
    cases = []
    # 1. Format-1 file with a checksum that matches its own content (the defect-1 attack).
    marker = folder / "executed-format1"
    path = folder / "format1" / "step-0000999.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = _torch_payload(marker)
    path.write_bytes(b"TRAINWISE-CHECKPOINT 1 sha256=%s bytes=%d\n"
                     % (hashlib.sha256(payload).hexdigest().encode(), len(payload)) + payload)
    cases.append({"case": "checkpoint_format1_direct_load", "marker": str(marker),
                  **_answer(lambda: module.load_checkpoint(path))})
    # 2. The tree's own format, forged consistently (digest/manifest match the pickle).
    marker = folder / "executed-forged"
    path = folder / "forged" / "step-0000999.pt"
    how = craft_checkpoint(path, marker, 999)
    cases.append({"case": f"checkpoint_{how}_direct_load", "marker": str(marker),
                  **_answer(lambda: module.load_checkpoint(path))})
    if hasattr(module, "latest_good_checkpoint"):
        answer = _answer(lambda: module.latest_good_checkpoint(path.parent))
        if answer.get("value_type") == "NoneType":  # the forged file skipped: nothing trusted
            answer = {"outcome": "refused", "error": "latest_good_checkpoint: None (skipped)"}
        cases.append({"case": f"checkpoint_{how}_latest_good", "marker": str(marker), **answer})
    # 3. Planted as the newest checkpoint of a real, interrupted run; the trainer resumes it.
    if donor is not None and suite is not None:
        run = suite.new_run("hostile-planted")
        # The same run id as the donor: a resume under another run id is refused as foreign
        # (training.checkpoint binds a checkpoint to its run), which is not what this case tests.
        run.config["run_id"] = donor.run_id
        shutil.copytree(donor.checkpoints, run.checkpoints)
        marker = folder / "executed-planted"
        newest = max(int(p.stem.split("-")[1]) for p in harness.committed_checkpoints(
            run.checkpoints))
        planted_step = newest + 1
        planted = run.checkpoints / module.checkpoint_name(planted_step)
        craft_checkpoint(planted, marker, planted_step)
        point = harness.resume_point(run.checkpoints)
        if point.resume_from is None:
            point = harness.ResumePoint(str(planted), planted_step)
        code, result = harness.run_to_end(run, point.resume_from)
        cases.append({
            "case": "checkpoint_planted_newest_then_resume", "marker": str(marker),
            "outcome": "refused" if point.step != planted_step else
            ("accepted" if code == 0 else "resume_failed"),
            "resumed_from_step": point.step, "skipped": point.skipped, "exit_code": code,
            "fell_back_and_completed": bool(result and result["status"] == "completed"
                                            and point.step != planted_step),
            "error": run.log_tail(0) if code else ""})
    return cases


def _telemetry_run(root: Path, run_id: str, lines: list[bytes], marker: dict | None = None) -> Path:
    rank0 = root / run_id / "rank0"
    rank0.mkdir(parents=True, exist_ok=True)
    data = b"".join(lines)
    (rank0 / "segment-00000.jsonl").write_bytes(data)
    if marker is not None:
        (rank0 / "segment-00000.complete").write_text(json.dumps(marker))
    return root / run_id


def telemetry_cases(work_dir: Path) -> list[dict]:
    from telemetry.reader import read_run_events
    from telemetry.store import ingest

    root = work_dir / "hostile" / "telemetry"
    marker = root / "executed-telemetry"
    good = json.dumps({"type": "step", "run_id": "r", "rank": 0, "step": 1,
                       "wall_time_s": 1.0}).encode()
    crafted = {
        "pickle_as_segment": [pickle.dumps(_OpensMarker(marker)) + b"\n"],
        "invalid_utf8": [good + b"\n", b'{"type":"step","run_id":"r","rank":0,"step":2,"x":"\xff"}\n'],
        "json_array_line": [good + b"\n", b"[1, 2, 3]\n"],
        "huge_step": [good.replace(b'"step": 1', b'"step": ' + b"9" * 40) + b"\n"],
        "nan_value": [good.replace(b'"wall_time_s": 1.0', b'"wall_time_s": NaN') + b"\n"],
        "deep_nesting": [b'{"type":"step","run_id":"r","rank":0,"step":1,"x":'
                         + b"[" * 100_000 + b"]" * 100_000 + b"}\n"],
    }
    cases = []
    for name, lines in crafted.items():
        run_dir = _telemetry_run(root / name, "r", lines)
        for reader, call in (("read_run_events", lambda d=run_dir: read_run_events(d)),
                             ("ingest", lambda d=run_dir, n=name: ingest(d, root / f"{n}.duckdb"))):
            answer = _answer(call)
            cases.append({"case": f"telemetry_{name}_{reader}", "marker": str(marker), **answer,
                          "names_file": "segment-00000" in answer.get("error", "")})
    lying = {"lines": 5, "bytes": 10**12, "sha256": "0" * 64, "torn_bytes": 0, "recovered": False}
    run_dir = _telemetry_run(root / "lying_marker", "r", [good + b"\n"], lying)
    answer = _answer(lambda: read_run_events(run_dir))
    cases.append({"case": "telemetry_lying_marker_read_run_events", "marker": str(marker),
                  **answer, "names_file": "segment-00000" in answer.get("error", "")})
    return cases


def trace_cases(work_dir: Path) -> list[dict]:
    from cloud.traces import TraceMeaning, load_trace

    folder = work_dir / "hostile" / "spot" / "availability-1node-aws-2023-02"
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder.parent / "executed-trace"
    crafted = {
        "pickle_named_json": pickle.dumps(_OpensMarker(marker)),
        "objects_as_data": json.dumps({"metadata": {"gap_seconds": 195},
                                       "data": [{"__reduce__": "os.system"}]}).encode(),
        "deep_nesting": b'{"metadata":{"gap_seconds":195},"data":' + b"[" * 100_000
                        + b"]" * 100_000 + b"}",
        "float_overflow": b'{"metadata":{"gap_seconds":195},"data":[1e999]}',
    }
    cases = []
    for index, (name, data) in enumerate(crafted.items()):
        path = folder / f"us-east-1{'abcd'[index]}_v100_1.json"
        path.write_bytes(data)
        answer = _answer(lambda p=path: load_trace(p, TraceMeaning.AVAILABLE))
        cases.append({"case": f"trace_{name}", "marker": str(marker), **answer,
                      "names_file": path.name in answer.get("error", "")})
    return cases


def executed(cases: list[dict]) -> int:
    """Markers that exist: files whose content ran code."""
    return len({c["marker"] for c in cases if Path(c["marker"]).exists()})
