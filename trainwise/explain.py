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
    folder = find_run_dir(run, runs_root)
    telemetry = folder / "telemetry" / folder.name
    if not telemetry.is_dir():
        raise FileNotFoundError(f"run {folder.name} has no telemetry at {telemetry}")
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
            version = record.get("schedule_version")
            policy = f"{record['policy']} [schedule {version}]" if version else record["policy"]
            rows.append(Decision(time_s=t, step=record["step"], layer=record["layer"],
                                 policy=policy, action=action,
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


def _base_shape(records: list[dict[str, Any]]) -> tuple[int, int]:
    """The configured (micro batch, accumulation) of the run: the fixed schedule's batch."""
    start = next((r for r in records if r["type"] == "run_start"), None)
    # No run start recorded (a partial copy of the telemetry): the first step's shape.
    config = ((start or {}).get("train_config")
              or next((r for r in records if r["type"] == "step"), {}))
    return int(config.get("micro_batch_size") or 1), int(config.get("grad_accum_steps") or 1)


def _rank0_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's step records, one per step (a replayed step after a resume: the last one)."""
    by_step = {r["step"]: r for r in records if r["type"] == "step" and r.get("rank", 0) == 0}
    return [by_step[s] for s in sorted(by_step)]


def lever_effects(records: list[dict[str, Any]],
                  consumption: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What each lever decided in a run and what it saved (< 0) or cost (> 0) against the fixed
    schedule, from its telemetry (and the pruning sampler's consumption record when there is one).

    - batch: the shape changes; over the steps run at another shape than the configured one,
      the samples and seconds beyond what the configured shape takes for the same steps.
      A shape's seconds per step is the fastest of the run's own steps at it (the first two
      left out as warm-up): load from other processes only ever adds time to a step, so the
      fastest step is the shape's own cost, and a loaded stretch during one shape cannot turn
      a dearer shape into a saving (a median of 12 steps did, on a busy 2-core machine);
    - pruning: the samples the full-data schedule would have drawn for the same epochs minus
      those drawn (the lever guard's latest record, else the consumption record's skipped
      counts), and those samples' seconds at the configured shape's measured seconds per sample;
    - guard: each lever it switched off (step, reason) and the batch changes it refused.
    """
    micro, accum = _base_shape(records)
    base_batch = micro * accum
    steps = _rank0_steps(records)
    shape_of = [(int(r.get("micro_batch_size") or micro), int(r.get("grad_accum_steps") or accum))
                for r in steps]
    times_ms: dict[tuple[int, int], list[float]] = {}
    for record, shape in zip(steps[2:], shape_of[2:], strict=True):
        if record.get("step_time_ms") is not None:
            times_ms.setdefault(shape, []).append(float(record["step_time_ms"]))
    base_ms = times_ms.get((micro, accum), [])
    base_step_ms = statistics.median(base_ms) if base_ms else None
    floor_ms = {shape: min(times) for shape, times in times_ms.items()}
    changes, previous = [], (micro, accum)
    extra_samples, extra_ms, other_steps = 0, 0.0, 0
    for record, shape in zip(steps, shape_of, strict=True):
        if shape != previous:
            changes.append({"step": record["step"], "from": list(previous), "to": list(shape)})
            previous = shape
        if shape != (micro, accum):
            other_steps += 1
            extra_samples += shape[0] * shape[1] - base_batch
            if base_ms and shape in floor_ms:
                extra_ms += floor_ms[shape] - floor_ms[(micro, accum)]
    guard = [r for r in records if r["type"] == "decision" and r.get("policy") == "lever_guard"
             and r.get("rank", 0) == 0]
    offs = [{"step": r["step"], "lever": r["action"].get("lever"), "reason": r["reason"]}
            for r in guard if r["action"].get("guard") == "switch_off"]
    refusals = [r for r in guard if r["action"].get("guard") == "refuse_batch"]
    pruning = _pruning_effects(guard, consumption or [], base_batch, base_step_ms)
    return {
        "base_shape": [micro, accum], "base_batch": base_batch, "steps": len(steps),
        "base_step_ms": base_step_ms,
        "batch": {"changes": changes, "steps_at_other_shapes": other_steps,
                  "extra_samples": extra_samples,
                  "extra_s": extra_ms / 1000.0 if base_step_ms is not None else None},
        "pruning": pruning,
        "guard": {"on": bool(guard), "switch_offs": offs, "refused_batch_changes": len(refusals)},
    }


def _pruning_effects(guard: list[dict[str, Any]], consumption: list[dict[str, Any]],
                     base_batch: int, base_step_ms: float | None) -> dict[str, Any]:
    epoch_records = [r for r in consumption if r["type"] == "epoch"]
    rates = [{"step": r["step"], "rate": r["rate"], "source": r.get("source"),
              "reason": r.get("reason", "")} for r in consumption if r["type"] == "rate"]
    skipped: float | None = None
    numbers = [r.get("numbers") or {} for r in guard]
    numbers = [n for n in numbers if "full_data_samples" in n]
    if numbers:
        skipped = max(0.0, numbers[-1]["full_data_samples"] - numbers[-1]["samples_seen"])
    elif epoch_records:
        skipped = float(sum(r.get("skipped_count", 0) for r in epoch_records))
    active = bool(epoch_records) or any("pruning" in (r.get("reason") or "") for r in guard
                                        if r["action"].get("guard") == "start")
    per_sample_s = base_step_ms / 1000.0 / base_batch if base_step_ms else None
    return {
        "active": active, "skipped_samples": skipped if active else 0.0,
        "saved_s": (skipped * per_sample_s if active and skipped is not None
                    and per_sample_s is not None else None),
        "epoch_rates": [r["rate"] for r in epoch_records], "rate_changes": rates,
    }


def lever_metrics(effects: dict[str, Any]) -> dict[str, float]:
    """The per-lever figures as flat metrics (MLflow): < 0 saved, > 0 cost, against the fixed
    schedule (see `lever_effects`); figures that could not be measured are left out."""
    batch, pruning, guard = effects["batch"], effects["pruning"], effects["guard"]
    values = {
        "levers/batch_changes": len(batch["changes"]),
        "levers/batch_extra_samples": batch["extra_samples"],
        "levers/batch_extra_s": batch["extra_s"],
        "levers/pruning_skipped_samples": pruning["skipped_samples"],
        "levers/pruning_saved_s": pruning["saved_s"],
        "levers/guard_switch_offs": len(guard["switch_offs"]),
        "levers/guard_refused_batch_changes": guard["refused_batch_changes"],
    }
    return {k: float(v) for k, v in values.items() if v is not None}


def lever_states(effects: dict[str, Any]) -> dict[str, str]:
    """lever -> "on", "off: <the guard's reason>" or "not used" (MLflow tags, explain)."""
    off = {o["lever"]: o["reason"] for o in effects["guard"]["switch_offs"]}
    used = {"batch": bool(effects["batch"]["changes"]), "pruning": effects["pruning"]["active"]}
    return {lever: (f"off: {off[lever]}" if lever in off else "on" if used[lever]
                    else "not used") for lever in ("batch", "pruning")}


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if not value:
        return f"0 {unit}"
    shown = f"{abs(value):,.0f}" if unit == "samples" else f"{abs(value):,.1f}"
    return f"{shown} {unit} {'cost' if value > 0 else 'saved'}"


def lever_report(effects: dict[str, Any]) -> str:
    """The per-lever section of `trainwise explain`."""
    batch, pruning, guard = effects["batch"], effects["pruning"], effects["guard"]
    # The reason of a switch-off is shown once, on the guard's line.
    states = {lever: "off (by the guard, below)" if state.startswith("off") else state
              for lever, state in lever_states(effects).items()}
    micro, accum = effects["base_shape"]
    lines = [f"levers (against the fixed schedule: batch {micro}x{accum}, full data; guard "
             f"{'on' if guard['on'] else 'off'}):"]
    moves = ", ".join(f"step {c['step']}: {c['from'][0]}x{c['from'][1]} -> "
                      f"{c['to'][0]}x{c['to'][1]}" for c in batch["changes"][:8])
    more = f" (+{len(batch['changes']) - 8} more)" if len(batch["changes"]) > 8 else ""
    lines.append(f"  batch: {states['batch']}; changes: {moves or 'none'}{more}")
    if batch["changes"]:
        lines.append(f"    {batch['steps_at_other_shapes']} steps at other shapes: "
                     f"{_figure(batch['extra_samples'], 'samples')}, "
                     f"{_figure(batch['extra_s'], 's')} (same steps at the fixed batch)")
    rates = ", ".join(f"{r:g}" for r in pruning["epoch_rates"][:12])
    lines.append(f"  pruning: {states['pruning']}"
                 + (f"; epoch rates: {rates}" if rates else ""))
    if pruning["active"]:
        skipped = pruning["skipped_samples"]
        lines.append(f"    {_figure(-skipped if skipped is not None else None, 'samples')}, "
                     f"{_figure(-pruning['saved_s'] if pruning['saved_s'] is not None else None, 's')}"
                     " (skipped against full data for the same epochs)")
        for change in pruning["rate_changes"]:
            lines.append(f"    step {change['step']}: rate -> {change['rate']:g} "
                         f"({change['source']}) {change['reason']}")
    for off in guard["switch_offs"]:
        lines.append(f"  guard: step {off['step']}: {off['lever']} switched off: {off['reason']}")
    if guard["refused_batch_changes"]:
        lines.append(f"  guard: refused {guard['refused_batch_changes']} batch change(s) "
                     "after switching the batch lever off")
    return "\n".join(lines)


def consumption_records(telemetry: Path) -> list[dict[str, Any]]:
    """The pruning sampler's consumption record of a run's telemetry folder ([] when it has none
    or it cannot be read): what `lever_effects` takes, for `trainwise.cost_summary` too."""
    from training.consumption import CONSUMPTION_NAME, read_consumption

    telemetry = Path(telemetry)
    if not (telemetry / CONSUMPTION_NAME).is_file():
        return []
    try:
        return read_consumption(telemetry)
    except (OSError, ValueError):  # the timeline must still print
        return []


def find_run_dir(run: str, runs_root: Path) -> Path:
    """The folder of a run id (or a unique prefix of one) under the state's runs folder; an
    unknown run raises FileNotFoundError naming it, the runs known and the fix."""
    fix = ("give a run id from the list (or a unique prefix of one), or point TRAINWISE_HOME at "
           "the state folder that holds the run")
    if not runs_root.is_dir():
        raise FileNotFoundError(f"no run {run!r}: there are no runs under {runs_root} yet (run "
                                "`make demo` first, or point TRAINWISE_HOME at the state folder "
                                "that holds the run)")
    folders = sorted(p for p in runs_root.iterdir() if p.is_dir())
    matches = [p for p in folders if p.name == run] or [
        p for p in folders if p.name.startswith(run)]
    if not matches:
        known = ", ".join(p.name for p in folders[:20]) or "none"
        raise FileNotFoundError(f"no run {run!r} under {runs_root} (known runs: {known}); {fix}")
    if len(matches) > 1:
        raise ValueError(f"run prefix {run!r} is ambiguous: {[m.name for m in matches]}; give "
                         "more of the run id")
    return matches[0]


def timeline(run: str, runs_root: Path) -> str:
    telemetry = find_run_telemetry(run, runs_root)
    records = read_run_events(telemetry)
    decisions = _as_decisions(records)
    header = f"run {run}: {len(records)} telemetry events, {len(decisions)} decisions\n"
    text = header + format_timeline(decisions)
    text += "\n\n" + lever_report(lever_effects(records, consumption_records(telemetry)))
    table = rank_table(records)
    if table:
        moved = rebalances(records)
        text += "\n\n" + table + "\n\nre-balanced:\n" + (
            "\n".join(moved) if moved else "no rank's share changed")
    return text
