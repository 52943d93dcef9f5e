"""`trainwise explain RUN`: the decision timeline of a run, read from its telemetry files.

Besides the policies' decisions it shows what they caused or answered (checkpoints, preemption
notices, evaluations), so a person can follow a run without opening the raw segments. A run
trained by several torchrun ranks also gets each rank's step time, compute, wait at the gradient
all-reduce and work share, and who was re-balanced, when and why (the per-rank step times the
fast layer saw and its reason).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from controllers.decisions import Decision, format_timeline
from telemetry.events import share_changes
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


def _mean(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.fmean(found) if found else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def rank_table(records: list[dict[str, Any]]) -> str:
    """Per-rank step figures of a torchrun run ("" for a single process)."""
    steps = [r for r in records if r["type"] == "step"]
    world = max((int(r.get("world_size") or 1) for r in steps), default=1)
    if world < 2:
        return ""
    lines = [f"ranks ({world}): mean over the steps each rank wrote",
             f"{'rank':>6} {'steps':>6} {'step_ms':>9} {'compute_ms':>11} {'wait_ms':>9} "
             f"{'share':>7}"]
    for rank in sorted({r["rank"] for r in steps}):
        mine = [r for r in steps if r["rank"] == rank]
        lines.append(
            f"{rank:>6} {len(mine):>6} {_ms(_mean([r.get('step_time_ms') for r in mine])):>9} "
            f"{_ms(_mean([r.get('compute_ms') for r in mine])):>11} "
            f"{_ms(_mean([r.get('allreduce_wait_ms') for r in mine])):>9} "
            f"{float(mine[-1].get('share', 1.0)):>7.3f}"
        )
    return "\n".join(lines)


def rebalances(records: list[dict[str, Any]]) -> list[str]:
    """One line per fast decision that changed some rank's work share: who, from, to, why."""
    world = max((int(r.get("world_size") or 1) for r in records if r["type"] == "step"),
                default=1)
    shares: list[float] = [1.0 / world] * world
    lines = []
    for record in records:
        if record["type"] != "decision" or record.get("layer") != "fast":
            continue
        new = [float(s) for s in (record.get("action") or {}).get("rank_work_shares") or []]
        if len(new) < 2:
            continue
        times = (record.get("observation") or {}).get("rank_step_time_ms") or []
        for rank, old, after in share_changes(shares, new):
            seen = f", its step {times[rank]:.0f} ms" if rank < len(times) else ""
            others = [t for i, t in enumerate(times) if i != rank]
            versus = f" vs {min(others):.0f} ms on the fastest other rank" if others else ""
            lines.append(f"step {record['step']}: rank {rank} share {old:.3f} -> {after:.3f}"
                         f"{seen}{versus}; {record['policy']}: {record['reason']}")
        shares = new
    return lines


def timeline(run: str, runs_root: Path) -> str:
    records = read_run_events(find_run_telemetry(run, runs_root))
    decisions = _as_decisions(records)
    header = f"run {run}: {len(records)} telemetry events, {len(decisions)} decisions\n"
    text = header + format_timeline(decisions)
    table = rank_table(records)
    if table:
        moved = rebalances(records)
        text += "\n\n" + table + "\n\nre-balanced:\n" + (
            "\n".join(moved) if moved else "no rank's share changed")
    return text
