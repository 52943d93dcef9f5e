"""`trainwise explain RUN`: the decision timeline of a run, read from its telemetry files.

Besides the policies' decisions it shows what they caused or answered (checkpoints, preemption
notices, evaluations), so a person can follow a run without opening the raw segments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controllers.decisions import Decision, format_timeline
from telemetry.reader import read_run_events


def find_run_telemetry(run: str, runs_root: Path) -> Path:
    """The telemetry folder of a run id (or a unique prefix of one) under the state folder."""
    if not runs_root.is_dir():
        raise FileNotFoundError(
            f"no run {run!r}: there are no runs under {runs_root} yet (run `make demo` first)")
    matches = sorted(p for p in runs_root.iterdir() if p.is_dir() and p.name.startswith(run))
    if not matches:
        known = ", ".join(sorted(p.name[:8] for p in runs_root.iterdir())) or "none"
        raise FileNotFoundError(f"no run {run!r} under {runs_root}; known runs: {known}")
    if len(matches) > 1:
        raise ValueError(f"run prefix {run!r} is ambiguous: {[m.name for m in matches]}")
    telemetry = matches[0] / "telemetry" / matches[0].name
    if not telemetry.is_dir():
        raise FileNotFoundError(f"run {matches[0].name} has no telemetry at {telemetry}")
    return telemetry


def _as_decisions(records: list[dict[str, Any]]) -> list[Decision]:
    start = next((r["wall_time_s"] for r in records if r["type"] == "run_start"),
                 records[0]["wall_time_s"] if records else 0.0)
    rows: list[Decision] = []
    for record in records:
        t = record["wall_time_s"] - start
        kind = record["type"]
        if kind == "decision":
            # The action dict repeats the reason and numbers: show each once.
            action = {k: v for k, v in record["action"].items()
                      if k not in ("reason", "numbers")}
            rows.append(Decision(time_s=t, step=record["step"], layer=record["layer"],
                                 policy=record["policy"], action=action,
                                 reason=record["reason"], numbers=record.get("numbers") or {}))
        elif kind == "checkpoint":
            rows.append(Decision(time_s=t, step=record["step"], layer="fast", policy="trainer",
                                 action={"checkpoint": Path(record["path"]).name},
                                 reason=f"checkpoint written ({record['reason']})",
                                 numbers={"save_ms": record["save_ms"]}))
        elif kind == "preemption":
            rows.append(Decision(time_s=t, step=record["step"], layer="fast", policy="trainer",
                                 action={"response": record["response"]},
                                 reason=f"preemption notice ({record['signal_name']})",
                                 numbers={"notice_s": record["notice_s"]}))
    return rows


def timeline(run: str, runs_root: Path) -> str:
    records = read_run_events(find_run_telemetry(run, runs_root))
    decisions = _as_decisions(records)
    header = f"run {run}: {len(records)} telemetry events, {len(decisions)} decisions\n"
    return header + format_timeline(decisions)
