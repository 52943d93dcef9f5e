"""The suite's figures (`faults.json`) and their markdown (`faults.md`) from the trial records."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "mean": None, "max": None}
    return {"n": len(values), "p50": statistics.median(values),
            "mean": statistics.fmean(values), "max": max(values)}


def _mismatch(trial: dict[str, Any]) -> bool:
    return not trial.get("resume_failed") and "params_identical" in trial and not (
        trial["params_identical"] and trial["eval_loss_identical"]
        and trial["step_losses_differing"] == 0)


def figures(trials: list[dict], hostile: list[dict], executed: int, disk_method: str,
            disk: list[dict], ingestion: dict, step_s: float) -> dict[str, Any]:
    """The headline figures of the issue (trials, corrupt checkpoints, failed resumes, rows lost
    or duplicated, notice-to-durable p50/max, lost work, code executed from files)."""
    kinds = Counter(t["kind"] for t in trials)
    hits = Counter(t["kind"] for t in trials if t["hit"])
    kills = [t for t in trials if t["hit"] and t["kind"].startswith("kill9")]
    sigterms = [t for t in trials if t["hit"] and t["kind"] == "sigterm_random"]
    durable = [t["notice_to_durable_s"] for t in sigterms if t.get("notice_to_durable_s") is not None]
    lost_kill = [float(t["lost_steps"]) for t in kills if "lost_steps" in t]
    lost_term = [float(t["lost_steps"]) for t in sigterms if "lost_steps" in t]
    disk_corrupt = sum(len(c.get("corrupt_checkpoints", [])) for c in disk)
    return {
        "trials": dict(kinds), "trials_with_fault_hit": dict(hits),
        "kill9_trials": sum(v for k, v in kinds.items() if k.startswith("kill9")),
        "sigterm_trials": kinds.get("sigterm_random", 0),
        "corrupt_checkpoints": sum(len(t["corrupt_checkpoints"]) for t in trials) + disk_corrupt,
        "failed_resumes": sum(bool(t.get("resume_failed")) for t in trials)
        + sum(bool(c.get("resume_failed")) for c in disk),
        "resumes_not_bit_identical": sum(_mismatch(t) for t in trials)
        + sum(_mismatch(c) for c in disk),
        "rows_lost": sum(t.get("rows_lost", 0) for t in trials) + ingestion["rows_lost"],
        "rows_duplicated": sum(t.get("rows_duplicated", 0) for t in trials)
        + ingestion["rows_duplicated"],
        "telemetry_errors": sum(bool(t.get("telemetry_error") or t.get("telemetry_read_error"))
                                for t in trials),
        "notices_unanswered": sum(not t.get("answered") for t in sigterms),
        "notice_to_durable_s": _quantiles(durable),
        "lost_steps_per_kill9": _quantiles(lost_kill),
        "lost_steps_per_sigterm": _quantiles(lost_term),
        "lost_s_per_kill9": _quantiles([s * step_s for s in lost_kill]),
        "step_s": step_s,
        "temp_files_left_after_resume": sum(t.get("temp_files_after_resume", 0) for t in trials),
        "code_executed_from_files": executed,
        "hostile_files": len(hostile),
        "hostile_accepted": sum(c["outcome"] == "accepted" for c in hostile),
        "hostile_errors_not_naming_file": sum(
            c["outcome"] == "refused" and c.get("names_file") is False for c in hostile),
        "full_disk_method": disk_method,
        "concurrent_ingest_failures": ingestion["failed_ingests"],
    }


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(payload: dict[str, Any]) -> str:
    f = payload["figures"]
    q = f["notice_to_durable_s"]
    lk, lt = f["lost_steps_per_kill9"], f["lost_steps_per_sigterm"]
    lines = [
        "# Fault-injection suite", "",
        f"Mode: {payload['mode']}; a {payload['run_shape']['max_steps']}-step GPT "
        f"({payload['run_shape']['n_layer']} layers, {payload['run_shape']['n_embd']} wide) on "
        f"`{payload['partition']}`, checkpoint every {payload['run_shape']['checkpoint_every_steps']}"
        f" steps, one torch thread; checkpoint format {payload['checkpoint_format']}. "
        f"Wall time {payload['wall_s']:.0f} s.", "",
        "| figure | value |", "|---|---|",
        f"| trials (kill -9 / SIGTERM) | {f['kill9_trials']} / {f['sigterm_trials']} |",
        "| trials per kind (fault point hit) | "
        + ", ".join(f"{k} {v} ({f['trials_with_fault_hit'].get(k, 0)})"
                    for k, v in f["trials"].items()) + " |",
        f"| corrupt checkpoints | {f['corrupt_checkpoints']} |",
        f"| failed resumes | {f['failed_resumes']} |",
        f"| resumed runs not bit-identical to the uninterrupted one | "
        f"{f['resumes_not_bit_identical']} |",
        f"| telemetry rows lost / duplicated | {f['rows_lost']} / {f['rows_duplicated']} |",
        f"| telemetry read/ingest errors | {f['telemetry_errors']} |",
        f"| notice-to-durable checkpoint (SIGTERM -> commit on disk) p50 / max | "
        f"{_fmt(q['p50'])} s / {_fmt(q['max'])} s (n={q['n']}) |",
        f"| notices not answered with a checkpoint | {f['notices_unanswered']} |",
        f"| lost work per kill -9 (steps re-run) p50 / mean / max | {_fmt(lk['p50'], 1)} / "
        f"{_fmt(lk['mean'], 1)} / {_fmt(lk['max'], 1)} (~{_fmt(f['step_s'])} s a step) |",
        f"| lost work per SIGTERM (steps re-run) p50 / max | {_fmt(lt['p50'], 1)} / "
        f"{_fmt(lt['max'], 1)} |",
        f"| temp files left after the resume | {f['temp_files_left_after_resume']} |",
        f"| concurrent ingestion (4 processes): failed ingests | "
        f"{f['concurrent_ingest_failures']} |",
        f"| hostile files: cases / accepted / errors not naming the file | {f['hostile_files']}"
        f" / {f['hostile_accepted']} / {f['hostile_errors_not_naming_file']} |",
        f"| **code executed from files** | **{f['code_executed_from_files']}** |",
        f"| full disk method | {f['full_disk_method']} |", "",
        "## Full disk", "",
        "| case | exit | stopped at step (checkpoint) | telemetry readable | corrupt | temp | "
        "resume | error |", "|---|---|---|---|---|---|---|---|",
    ]
    for c in payload["full_disk"]:
        if "skipped" in c:
            lines.append(f"| {c['case']} | skipped: {c['skipped']} | | | | | | |")
            continue
        resume = "failed" if c.get("resume_failed") else (
            "bit-identical" if c.get("params_identical") else "differs")
        error = c.get("error_tail", "").replace("|", "/")[-160:]
        lines.append(f"| {c['case']} | {c['exit_code']} | {c['last_recorded_step']} "
                     f"({c['newest_checkpoint_step']}) | {c['telemetry_readable']} | "
                     f"{len(c['corrupt_checkpoints'])} | {c['temp_files']} | {resume} | {error} |")
    lines += ["", "## Hostile files", "", "| case | outcome | error |", "|---|---|---|"]
    for c in payload["hostile"]:
        error = (c.get("error") or c.get("error_type") or "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {c['case']} | {c['outcome']} | {error[:140]} |")
    lines += _adversarial_lines(payload)
    ing = payload["concurrent_ingestion"]
    lines += ["", "## Concurrent ingestion", "",
              f"{ing['processes']} processes, {ing['lines_per_run']} lines a run: four runs at "
              f"once, exit codes {[o['exit_code'] for o in ing['four_runs']]}; one run four "
              f"times at once, exit codes {[o['exit_code'] for o in ing['same_run']]}; rows lost "
              f"{ing['rows_lost']}, duplicated {ing['rows_duplicated']}."]
    failures = [t for t in payload["trials"] if t.get("resume_failed") or _mismatch(t)
                or t["corrupt_checkpoints"] or t.get("telemetry_error")]
    if failures:
        lines += ["", "## Trials with findings", ""]
        for t in failures:
            lines.append(f"- {t['run_id']}: resume_failed={t.get('resume_failed')}, corrupt="
                         f"{t['corrupt_checkpoints']}, {t.get('resume_error') or ''}"
                         f"{t.get('telemetry_error') or ''}"[:400])
    lines += ["", "Definitions: a checkpoint is corrupt when a committed one (with format 2: "
              "its manifest exists) fails `load_checkpoint`. Rows lost/duplicated: complete "
              "telemetry lines vs stored rows, and steps 1..max_steps among the stored step rows "
              "not marked `is_replay` (missing, or present twice), plus rows a second ingest "
              "added. Lost work: last step the interrupted trainer recorded minus the step the "
              "resume started from. Notice-to-durable: the commit file's mtime minus the time "
              "SIGTERM was sent (0 when the notice fell on a boundary already saved). Code "
              "executed from files: marker files created by crafted pickles."]
    return "\n".join(lines)



def _adversarial_lines(payload: dict[str, Any]) -> list[str]:
    """The adversarial part: the issue's five zeros, the lost-work bound, then per class."""
    a = payload["figures"].get("adversarial")
    if a is None:  # a results file written before the adversarial part existed
        return []
    f = payload["figures"]
    lk = f["lost_steps_per_kill9"]
    lines = ["", "## Adversarial state files", "",
             "Generated variants per defect class (`benchmarks/faults/adversarial_*.py`), each "
             "with the outcome it must give; a case fails when the outcome differs, a file "
             "outside the run folder changed, the bill moved or a row was lost.", "",
             "| figure | value |", "|---|---|",
             f"| cases / failed | {a['cases']} / {a['failed']} |",
             f"| resumes crashed by a hostile file | {a['resumes_crashed_by_hostile_file']} |",
             f"| writes outside the run folder | {a['writes_outside_run_folder']} |",
             f"| foreign checkpoints accepted silently | "
             f"{a['foreign_checkpoints_accepted_silently']} |",
             f"| bills changed by a planted file | {a['bills_changed_by_planted_file']} |",
             f"| rows lost on a full telemetry disk | {a['rows_lost_on_full_telemetry_disk']} |",
             f"| lost work per kill -9, max (steps) against the stated bound | "
             f"{_fmt(lk['max'], 1)} against {f['lost_work_bound_steps']} (two intervals) |",
             "", "| class | cases | refused | fell back | warned | accepted | crashed | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in a["per_class"].items():
        lines.append(f"| {name} | {c.get('cases', 0)} | {c.get('refused', 0)} | "
                     f"{c.get('fell_back', 0)} | {c.get('warned', 0)} | {c.get('accepted', 0)} | "
                     f"{c.get('crashed', 0)} | {c.get('failed', 0)} |")
    failed = [r for r in payload.get("adversarial", []) if not r["passed"]]
    if failed:
        lines += ["", "Failed cases:", ""]
        lines += [f"- {r['defect_class']}/{r['case']}: expected {r['expected']}, got "
                  f"{r['outcome']}; {r['detail'][:200]}" for r in failed]
    return lines
