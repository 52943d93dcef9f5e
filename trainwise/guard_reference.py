"""The lever guard's reference curve for a train request, read from an earlier run.

The guard (`controllers.lever_guard`, `TrainConfig.lever_guard`) judges a lever by its eval
loss against the fixed schedule's at the same samples. A person launching a run from the
Dagster UI does not type that curve in: the request names an earlier run
(`TrainRequest.lever_guard_reference_run`) or leaves it empty, and the curve is that run's
(samples seen, eval loss) points from its telemetry (`state/runs/<id>/telemetry/<id>`).

Which run, in order:
1. the named one; it must have completed, on the same partition, with the same schedule
   (global batch, learning rate, max steps: curves of another schedule differ at the same
   samples whatever the lever does);
2. on resume, the one this run already used (its request.json), so a reference does not change
   under a running guard;
3. the newest completed run of the partition with the same schedule whose levers were all off
   (the fixed schedule: static data and one batch shape from start to end).

The model and the data are checked once the shards are loaded (`check_fit`): a reference
trained on other shards or another model says nothing about this run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIN_POINTS = 2  # one point is no curve: the guard interpolates between evaluations
# What must match for two runs' curves to be comparable at the same samples.
SCHEDULE_FIELDS = ("global_batch", "learning_rate", "max_steps")


@dataclass(frozen=True)
class GuardReference:
    run_id: str
    points: tuple[tuple[float, float], ...]  # (samples seen, eval loss), sorted by samples
    how: str  # "named", "resume" or "automatic": how the run was chosen
    fixed_schedule: bool  # its levers were all off
    model_config: dict[str, Any] = field(default_factory=dict)
    data_fingerprint: str = ""
    curriculum_version: str | None = None

    def describe(self) -> str:
        """One line for params, logs and the run's record."""
        kind = "fixed schedule" if self.fixed_schedule else "levers on"
        return (f"run {self.run_id} ({self.how}; {kind}): "
                f"{len(self.points)} points, eval loss {self.points[0][1]:.4f} at "
                f"{self.points[0][0]:.0f} samples to {self.points[-1][1]:.4f} at "
                f"{self.points[-1][0]:.0f}")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def schedule(request: dict[str, Any]) -> dict[str, Any]:
    """The fields of a request (as a dict) that make curves comparable."""
    return {"global_batch": int(request.get("micro_batch_size") or 0)
            * int(request.get("grad_accum_steps") or 0),
            "learning_rate": float(request.get("learning_rate") or 0.0),
            "max_steps": int(request.get("max_steps") or 0)}


def schedule_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    a, b = schedule(mine), schedule(theirs)
    return [f"{name} {b[name]} (this run: {a[name]})" for name in SCHEDULE_FIELDS
            if not math.isclose(a[name], b[name], rel_tol=1e-9)]


def curve_from_events(events: list[dict[str, Any]]) -> tuple[tuple[float, float], ...]:
    """(samples seen, eval loss) at each evaluation of a run's telemetry; a step evaluated twice
    (a resume replayed it) counts once, its last record."""
    samples_at: dict[int, float] = {}
    for event in events:
        if event["type"] == "step" and event.get("rank", 0) == 0:
            samples_at[event["step"]] = float(event["samples_seen"])
    by_step: dict[int, tuple[float, float]] = {}
    for event in events:
        loss = event.get("eval_loss") if event["type"] == "eval" else None
        if loss is None or not math.isfinite(float(loss)):
            continue
        samples = 0.0 if event["step"] == 0 else samples_at.get(event["step"])
        if samples is not None:
            by_step[event["step"]] = (samples, float(loss))
    return tuple(sorted(by_step.values()))


def _levers_off(request: dict[str, Any], events: list[dict[str, Any]]) -> bool:
    """Static data and one batch shape in every step: the fixed schedule, whatever the fast
    policy was (one that never changed the batch left the schedule fixed)."""
    if request.get("data_selection", "static") != "static":
        return False
    shapes = {(e["micro_batch_size"], e["grad_accum_steps"]) for e in events
              if e["type"] == "step"}
    return shapes <= {(request.get("micro_batch_size"), request.get("grad_accum_steps"))}


def _events(run_dir: Path, run_id: str) -> list[dict[str, Any]] | None:
    from telemetry.reader import read_run_events

    try:
        return read_run_events(run_dir / "telemetry" / run_id)
    except (OSError, ValueError):
        return None


def _reference(run_id: str, events: list[dict[str, Any]], how: str, fixed: bool
               ) -> GuardReference:
    start = next((e for e in events if e["type"] == "run_start"), {})
    return GuardReference(run_id=run_id, points=curve_from_events(events), how=how,
                          fixed_schedule=fixed, model_config=dict(start.get("model_config") or {}),
                          data_fingerprint=str(start.get("data_fingerprint") or ""),
                          curriculum_version=start.get("curriculum_version"))


def _named(request: Any, state_dir: Path, run_id: str, how: str) -> GuardReference:
    from telemetry.writer import rank_dir

    field_name = "lever_guard_reference_run"
    try:
        rank_dir(Path("."), run_id, 0)  # one safe path part, never joined otherwise
    except ValueError as error:
        raise ValueError(f"{field_name}: {error}") from error
    runs_root = Path(state_dir) / "runs"
    run_dir = runs_root / run_id
    theirs = _read_json(run_dir / "request.json")
    if theirs is None:
        raise ValueError(
            f"{field_name}={run_id!r}: no such run in {runs_root} (no request.json); name a "
            f"completed run of partition {request.partition!r} (`trainwise explain` lists the "
            "runs), or leave it empty to use the newest fixed-schedule run")
    outcome = _read_json(run_dir / "outcome.json") or {}
    if outcome.get("status") != "completed":
        raise ValueError(
            f"{field_name}={run_id!r} did not complete (status {outcome.get('status')!r}): its "
            "curve is partial; resume it to the end, or name a completed run")
    if theirs.get("partition") != request.partition:
        raise ValueError(
            f"{field_name}={run_id!r} trained partition {theirs.get('partition')!r}, not "
            f"{request.partition!r}: its curve is of other data; name a run of "
            f"{request.partition!r}")
    differences = schedule_differences(dataclasses.asdict(request), theirs)
    if differences:
        raise ValueError(
            f"{field_name}={run_id!r} ran another schedule ({'; '.join(differences)}): its eval "
            "loss at the same samples is not comparable; name a run with this run's micro batch "
            "x accumulation, learning rate and max steps, or run the fixed schedule with them")
    events = _events(run_dir, run_id)
    if events is None:
        raise ValueError(
            f"{field_name}={run_id!r}: its telemetry {run_dir / 'telemetry' / run_id} is missing "
            "or unreadable, so its eval curve cannot be read; name another run")
    reference = _reference(run_id, events, how, _levers_off(theirs, events))
    if len(reference.points) < MIN_POINTS:
        raise ValueError(
            f"{field_name}={run_id!r} has {len(reference.points)} evaluation(s); the guard needs "
            f"a curve of at least {MIN_POINTS}: name a run that evaluated more often (its "
            "eval_every_steps below its max_steps), or run the fixed schedule so")
    return reference


def _automatic(request: Any, state_dir: Path) -> GuardReference:
    runs_root = Path(state_dir) / "runs"
    mine = dataclasses.asdict(request)
    candidates = []
    for run_dir in (runs_root.iterdir() if runs_root.is_dir() else ()):
        if run_dir.name == request.run_id:
            continue
        theirs = _read_json(run_dir / "request.json")
        outcome = _read_json(run_dir / "outcome.json")
        if (theirs is None or outcome is None or outcome.get("status") != "completed"
                or theirs.get("partition") != request.partition
                or theirs.get("data_selection", "static") != "static"
                or schedule_differences(mine, theirs)):
            continue
        candidates.append(((run_dir / "outcome.json").stat().st_mtime, run_dir.name, theirs))
    for _, run_id, theirs in sorted(candidates, reverse=True):  # newest first
        events = _events(runs_root / run_id, run_id)
        if events is None or not _levers_off(theirs, events):
            continue
        reference = _reference(run_id, events, "automatic", True)
        if len(reference.points) >= MIN_POINTS:
            return reference
    wanted = schedule(mine)
    raise ValueError(
        f"lever_guard is on but {runs_root} holds no completed fixed-schedule run of partition "
        f"{request.partition!r} with global batch {wanted['global_batch']}, learning rate "
        f"{wanted['learning_rate']:g} and max steps {wanted['max_steps']} (levers off: "
        "data_selection 'static', one batch shape; at least 2 evaluations) to judge levers "
        "against: run the fixed schedule first (the same config with fast_policy 'noop', "
        "data_selection 'static', lever_guard off), or name a reference run in "
        "lever_guard_reference_run")


def resolve(request: Any, state_dir: Path) -> GuardReference | None:
    """The reference of a request (a `trainwise.runs.TrainRequest`); None when its guard is off.
    Raises ValueError naming the run and the fix; reads files only."""
    if not request.lever_guard:
        return None
    if request.lever_guard_reference_run:
        return _named(request, state_dir, request.lever_guard_reference_run, "named")
    own = _read_json(Path(state_dir) / "runs" / request.run_id / "request.json") or {}
    if own.get("lever_guard_reference_run"):
        return _named(request, state_dir, own["lever_guard_reference_run"], "resume")
    return _automatic(request, state_dir)


def check_fit(reference: GuardReference | None, model: Any, data_fingerprint: str) -> None:
    """Refuses a reference trained on other data or another model (a GPTConfig or CNNConfig)
    than this run's, known once its shards are loaded."""
    if reference is None:
        return
    # As the run_start record holds it (JSON: tuples are lists).
    model_config = json.loads(json.dumps(dataclasses.asdict(model), default=str))
    if reference.data_fingerprint and reference.data_fingerprint != data_fingerprint:
        raise ValueError(
            f"lever guard reference run {reference.run_id!r} trained on shards "
            f"{reference.data_fingerprint[:12]}, this run on {data_fingerprint[:12]} (rebuilt "
            "since): run the fixed schedule again on these shards, or name a run trained on them")
    if reference.model_config and reference.model_config != model_config:
        differing = sorted(k for k in {*reference.model_config, *model_config}
                           if reference.model_config.get(k) != model_config.get(k))
        raise ValueError(
            f"lever guard reference run {reference.run_id!r} trained another model (differs in "
            f"{', '.join(differing)}): name a run of this model, or run the fixed schedule again")


def mlflow_params(reference: GuardReference | None) -> dict[str, Any]:
    """MLflow params of the guard: which run the curve came from instead of the raw points
    (`train/lever_guard_reference` would be a long tuple)."""
    if reference is None:
        return {"guard/reference_run": "none"}
    return {"train/lever_guard_reference": reference.describe(),
            "guard/reference_run": reference.run_id,
            "guard/reference_chosen": reference.how,
            "guard/reference_fixed_schedule": reference.fixed_schedule,
            "guard/reference_points": len(reference.points),
            "guard/reference_final_samples": reference.points[-1][0],
            "guard/reference_final_eval_loss": reference.points[-1][1]}
