"""Schedule changes as proposals that go live only with an approval bound to their content.

A schedule is what the runs use (`trainwise.schedule`: both layers' policies, the levers, the
checkpoint-interval rule, the pruning rate and its bounds, the budget). A change is a
*proposal* (`candidate.json`) carrying its content hash, its forecast savings (USD per run,
P50) and the eval-loss change seen in recent runs. A person approves a hash
(`record_approval`: approver, hash, comment, time). The gate
(`audit_and_publish`) passes only when an approval names the candidate's current hash and the
thresholds hold; then the candidate becomes `current.json`. Changing the proposal changes its
hash, so an approval given for an earlier version approves nothing (it is reported as stale).

A rollback is a proposal too (`propose_rollback`: back to the schedule before the current one,
or to any version published earlier); it needs an approval of its hash like any change, while
the savings and eval-loss thresholds, met when that version was first published, are not asked
again (a rollback is how a bad change is undone, and must not wait for new evidence).

Who approved comes from the Dagster run's `user` tag when the run has one (Dagster+ sets it from
the login; an authenticating proxy deployment sets it, docs/operations.md) and a typed name must
then match it; otherwise the typed name, recorded as unverified. `TRAINWISE_APPROVERS` (an
allow-list) refuses anyone else; `TRAINWISE_REQUIRE_VERIFIED_APPROVER=1` refuses typed names.

Files, under `<state>/governance/schedule/`: current.json, candidate.json, approvals.jsonl and
history.jsonl (append-only records of proposals, approvals, rejections and publications).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from training.safe_files import append_bytes
from trainwise import schedule as schedule_lib
from trainwise import settings

FOLDER = schedule_lib.FOLDER
content_hash = schedule_lib.content_hash
# The run tag Dagster+ sets to the launching user's login (dagster._core.storage.tags.USER_TAG).
USER_TAG = "user"
# Runs whose pruning rate is within this of a schedule's rate count as runs at that rate.
RATE_MATCH = 0.025
RECENT_RUNS = 50


class ApprovalError(ValueError):
    """An approval that cannot be recorded; the message names the input and the fix."""


def _write_json(path: Path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(handle, "w") as out:
        json.dump(content, out, indent=2, sort_keys=True)
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _append(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The approval record is what an audit trusts: a link planted at its predictable name is
    # refused, never appended through (issue 31, class 2).
    append_bytes(path, (json.dumps(record, sort_keys=True) + "\n").encode("utf-8"))


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def default_schedule() -> dict[str, Any]:
    """The schedule before any approved change: the settings."""
    return schedule_lib.default_schedule()


def current_schedule(folder: Path) -> dict[str, Any]:
    """The schedule in force, every field filled in (`trainwise.schedule.complete`)."""
    current = schedule_lib.read_current(Path(folder))
    return schedule_lib.complete(current["schedule"]) if current else default_schedule()


def read_candidate(folder: Path) -> dict | None:
    return _read_json(Path(folder) / "candidate.json")


def history(folder: Path) -> list[dict]:
    return _lines(Path(folder) / "history.jsonl")


def approvals(folder: Path) -> list[dict]:
    return _lines(Path(folder) / "approvals.jsonl")


def propose(folder: Path, to: dict[str, Any], *, forecast_savings_usd: float,
            eval_loss_change: float | None, evidence: dict[str, Any], reason: str,
            requested_by: str, rollback_of: str = "") -> dict[str, Any]:
    """Write the candidate (replacing any earlier one) and record the proposal. The hash covers
    the change (from, to), the figures shown to the approver and, for a rollback, the version
    rolled back to. `to` is validated (`trainwise.schedule.validate`)."""
    folder = Path(folder)
    to = schedule_lib.validate(to)
    content = {"from": current_schedule(folder), "to": to,
               "forecast_savings_usd": round(float(forecast_savings_usd), 2),
               "eval_loss_change": None if eval_loss_change is None
               else round(float(eval_loss_change), 4)}
    if rollback_of:
        content["rollback_of"] = rollback_of
    proposal = {**content, "hash": content_hash(content), "evidence": evidence,
                "reason": reason, "requested_by": requested_by, "proposed_at": time.time()}
    _write_json(folder / "candidate.json", proposal)
    _append(folder / "history.jsonl", {"event": "proposed", "hash": proposal["hash"],
                                       "to": to, "requested_by": requested_by, "reason": reason,
                                       "rollback_of": rollback_of,
                                       "time": proposal["proposed_at"]})
    return proposal


def published_versions(folder: Path) -> list[dict[str, Any]]:
    """Every schedule that has been in force, oldest first: the default, then each publication
    ({"version", "schedule", "time"}); a rollback may go back to any of them."""
    first = history(folder)
    published = [r for r in first if r.get("event") == "published"]
    start = published[0]["from"] if published else current_schedule(folder)
    rows = [{"version": schedule_lib.version_of(start), "schedule": schedule_lib.complete(start),
             "time": None}]
    for record in published:
        to = schedule_lib.complete(record["to"])
        rows.append({"version": schedule_lib.version_of(to), "schedule": to,
                     "time": record["time"]})
    return rows


def rollback_target(folder: Path, target: str) -> dict[str, Any]:
    """The schedule a rollback returns to: "previous" (the one before the current), or a
    version (content hash) that has been in force. Refused, naming the versions, otherwise."""
    rows = published_versions(folder)
    now = schedule_lib.version_of(current_schedule(folder))
    if target.strip() == "previous":
        earlier = [r for r in rows if r["version"] != now]
        if not earlier:
            raise ApprovalError("there is no earlier schedule to roll back to (nothing has been "
                                "published yet)")
        return earlier[-1]
    for row in reversed(rows):
        if row["version"] == target.strip():
            if row["version"] == now:
                raise ApprovalError(f"schedule {target} is the one in force; roll back to "
                                    "another version or to 'previous'")
            return row
    raise ApprovalError(f"rollback_to {target!r} is no schedule that has been in force; "
                        f"versions: {', '.join(r['version'] for r in rows)} (or 'previous')")


def approver_identity(typed: str, run_tags: dict[str, str]) -> tuple[str, str]:
    """(who approved, how that is known). The Dagster run's `user` tag wins over a typed name
    (which must then match it); a typed name alone is unverified. The allow-list and the
    verified-only setting refuse by name."""
    tagged = (run_tags or {}).get(USER_TAG, "").strip()
    typed = (typed or "").strip()
    if tagged:
        if typed and typed != tagged:
            raise ApprovalError(f"approver {typed!r} is not the user who launched this run "
                                f"({tagged!r}, the run's {USER_TAG!r} tag); an approval is "
                                "given by the one who gives it: leave approver empty or use "
                                "your own")
        who, source = tagged, f"dagster run tag {USER_TAG!r}"
    elif settings.get("TRAINWISE_REQUIRE_VERIFIED_APPROVER") == "1":
        raise ApprovalError(
            "this deployment takes approvals only from a verified user (TRAINWISE_REQUIRE_"
            f"VERIFIED_APPROVER=1) and the run has no {USER_TAG!r} tag: approve from Dagster+ or "
            "through the authenticating proxy (docs/operations.md, 'Who approves')")
    elif not typed:
        raise ApprovalError("approver is empty; give your name in the approvals run config "
                            "(ops.approvals.config.approver)")
    else:
        who, source = typed, "typed name (unverified: no login in front of this Dagster)"
    allowed = [a.strip() for a in settings.get("TRAINWISE_APPROVERS").split(",") if a.strip()]
    if allowed and who not in allowed:
        raise ApprovalError(f"{who!r} may not approve schedule changes: TRAINWISE_APPROVERS "
                            f"lists {', '.join(allowed)}")
    return who, source


def record_approval(folder: Path, approver: str, approved_hash: str, comment: str = "",
                    now: float | None = None, run_tags: dict[str, str] | None = None
                    ) -> dict[str, Any]:
    """Record a person's approval of the candidate with hash `approved_hash`. Refused when the
    approver is unknown or not allowed (`approver_identity`), there is no candidate, or the hash
    is not the candidate's (an approval of something not on the table would approve nothing)."""
    folder = Path(folder)
    approver, identity_source = approver_identity(approver, run_tags or {})
    candidate = read_candidate(folder)
    if candidate is None:
        raise ApprovalError("there is no schedule_change proposal to approve; materialize "
                            "schedule_change first")
    if approved_hash.strip() != candidate["hash"]:
        raise ApprovalError(
            f"content_hash {approved_hash!r} is not the current proposal's {candidate['hash']!r}"
            f" (to {json.dumps(candidate['to'], sort_keys=True)}); review the proposal shown "
            "on schedule_change and approve its hash")
    record = {"approver": approver, "identity_source": identity_source,
              "hash": candidate["hash"], "comment": comment,
              "time": time.time() if now is None else now}
    _append(folder / "approvals.jsonl", record)
    _append(folder / "history.jsonl", {"event": "approved", **record})
    return record


def gate_report(folder: Path, min_savings_usd: float, max_eval_loss_regression: float
                ) -> dict[str, Any]:
    """Whether the candidate may go live: an approval of its current hash, savings at least
    the minimum, eval-loss change at most the maximum. Failures name the fix."""
    candidate = read_candidate(Path(folder))
    if candidate is None:
        return {"passed": True, "status": "no schedule_change proposal pending",
                "current": current_schedule(folder), "failures": []}
    failures = []
    given = [a for a in approvals(folder) if a["hash"] == candidate["hash"]]
    if not given:
        stale = [a for a in approvals(folder) if a["hash"] != candidate["hash"]]
        note = (f"; the latest approval (by {stale[-1]['approver']}) is for {stale[-1]['hash']}, "
                "an earlier version of the proposal: stale") if stale else ""
        failures.append(f"no approval of {candidate['hash']}{note}; approve it by materializing "
                        "approvals with content_hash set to it")
    savings = candidate["forecast_savings_usd"]
    change = candidate["eval_loss_change"]
    if candidate.get("rollback_of"):
        # The thresholds held when this version was published; a rollback undoes a change and
        # must not wait for new evidence (module docstring). The approval is still required.
        return {"passed": not failures, "hash": candidate["hash"], "to": candidate["to"],
                "rollback_of": candidate["rollback_of"], "forecast_savings_usd": savings,
                "eval_loss_change": change, "approval": given[-1] if given else None,
                "failures": failures,
                "status": (f"rollback to {candidate['rollback_of']} approved (its thresholds held "
                           "when it was published)") if not failures else "; ".join(failures)}
    if savings < min_savings_usd:
        failures.append(f"forecast savings {savings:.2f} USD < TRAINWISE_MIN_FORECAST_SAVINGS_USD"
                        f"={min_savings_usd:g}")
    if change is None:
        failures.append("no eval-loss evidence at both pruning rates (see evidence); train a run "
                        "at the proposed rate, or propose an allocation-only change")
    elif change > max_eval_loss_regression:
        failures.append(f"eval loss rises by {change:.4f} > TRAINWISE_MAX_EVAL_LOSS_REGRESSION="
                        f"{max_eval_loss_regression:g}")
    return {"passed": not failures, "hash": candidate["hash"], "to": candidate["to"],
            "forecast_savings_usd": savings, "eval_loss_change": change,
            "approval": given[-1] if given else None, "failures": failures,
            "status": "approved, thresholds hold" if not failures else "; ".join(failures)}


def audit_and_publish(folder: Path, min_savings_usd: float, max_eval_loss_regression: float,
                      checked_by: str) -> dict[str, Any]:
    """The gate: publish the candidate when `gate_report` passes (it then leaves the table),
    else keep the current schedule and the candidate (waiting for an approval)."""
    folder = Path(folder)
    report = gate_report(folder, min_savings_usd, max_eval_loss_regression)
    candidate = read_candidate(folder)
    if candidate is None or not report["passed"]:
        if candidate is not None:
            report["status"] = (f"proposal {candidate['hash']} blocked, current schedule stays: "
                                + report["status"])
        return report
    version = schedule_lib.version_of(candidate["to"])
    record = {"event": "published", "hash": candidate["hash"], "from": candidate["from"],
              "to": candidate["to"], "version": version,
              "rollback_of": candidate.get("rollback_of", ""), "approval": report["approval"],
              "checked_by": checked_by, "time": time.time()}
    _write_json(folder / "current.json", {"schedule": candidate["to"], "hash": candidate["hash"],
                                          "version": version, "published": record})
    _append(folder / "history.jsonl", record)
    (folder / "candidate.json").unlink()
    report["status"] = f"proposal {candidate['hash']} published: schedule version {version}"
    report["version"] = version
    report["published"] = record
    return report


# ---- evidence: the eval-loss change between two pruning rates in recent runs ------------------

def eval_loss_change(runs: list[dict[str, Any]], from_rate: float, to_rate: float
                     ) -> tuple[float | None, str]:
    """Mean over partitions that have runs at both rates of (mean eval loss at `to_rate` minus
    at `from_rate`); losses of different data sets are never compared. None when no partition
    has both."""
    if abs(to_rate - from_rate) < 1e-12:
        return 0.0, "pruning rate unchanged: the data trained on is the same"
    by_key: dict[tuple[str, str], list[float]] = defaultdict(list)
    for run in runs:
        for side, rate in (("from", from_rate), ("to", to_rate)):
            if abs(run["pruning_rate"] - rate) <= RATE_MATCH:
                by_key[(run["partition"], side)].append(run["eval_loss"])
    diffs = {}
    for partition in {p for p, _ in by_key}:
        if (partition, "from") in by_key and (partition, "to") in by_key:
            to_losses, from_losses = by_key[(partition, "to")], by_key[(partition, "from")]
            diffs[partition] = sum(to_losses) / len(to_losses) - sum(from_losses) / len(from_losses)
    if not diffs:
        return None, (f"no partition has recent runs at both {from_rate:g} and {to_rate:g} "
                      f"({len(runs)} runs looked at)")
    return sum(diffs.values()) / len(diffs), "per partition: " + ", ".join(
        f"{p} {d:+.4f}" for p, d in sorted(diffs.items()))


def mlflow_runs(tracking_uri: str, experiment: str, limit: int = RECENT_RUNS
                ) -> tuple[list[dict[str, Any]], str]:
    """(partition, pruning rate, final eval loss) of recent finished MLflow runs, and a note.
    A sqlite store that does not exist yet has no runs (it is not created here)."""
    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri[10:]).is_file():
        return [], "MLflow store not created yet"
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return [], f"no MLflow experiment {experiment!r}"
        rows = client.search_runs([found.experiment_id], "attributes.status = 'FINISHED'",
                                  max_results=limit, order_by=["attributes.start_time DESC"])
    except Exception as error:  # noqa: BLE001 - evidence is optional; telemetry is the fallback
        return [], f"MLflow not readable ({type(error).__name__}: {error})"
    runs = []
    for row in rows:
        loss = row.data.metrics.get("final/eval_loss")
        rate = row.data.params.get("curriculum/pruning_rate")
        if loss is not None and rate is not None:
            runs.append({"partition": row.data.params.get("data/partition", ""),
                         "pruning_rate": float(rate), "eval_loss": float(loss),
                         "source": f"mlflow:{row.info.run_id}"})
    return runs, f"{len(runs)} MLflow runs"


def telemetry_runs(state_dir: Path, limit: int = RECENT_RUNS) -> tuple[list[dict[str, Any]], str]:
    """The same figures from the run folders' telemetry (when MLflow has none): the last eval
    loss of each run, and the pruning rate of the curriculum version its run_start names."""
    from telemetry.reader import read_run_events
    from training import curriculum as curriculum_lib

    requests = sorted(Path(state_dir).glob("runs/*/request.json"), key=lambda p: p.stat().st_mtime,
                      reverse=True)[:limit]
    runs = []
    for path in requests:
        try:
            partition = json.loads(path.read_text())["partition"]
            events = read_run_events(path.parent / "telemetry" / path.parent.name)
            starts = [e for e in events if e["type"] == "run_start" and e.get("curriculum_version")]
            evals = [e for e in events if e["type"] == "eval" and e.get("eval_loss") is not None]
            if not starts or not evals:
                continue
            built = curriculum_lib.load_curriculum(Path(state_dir) / "curricula" / partition,
                                                   starts[-1]["curriculum_version"])
        except (OSError, ValueError, KeyError):
            continue  # a damaged or foreign run folder is no evidence
        runs.append({"partition": partition, "pruning_rate": float(built.pruning_rate),
                     "eval_loss": float(evals[-1]["eval_loss"]),
                     "source": f"telemetry:{path.parent.name}"})
    return runs, f"{len(runs)} runs from telemetry"
