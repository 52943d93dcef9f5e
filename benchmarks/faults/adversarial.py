"""The adversarial part of the fault suite: state files that a shared disk, a restored backup or a
careless clean-up leave in a run folder, each with the outcome trainwise must give.

Each defect class has its own module of generated cases (`adversarial_<area>.py`) exposing
`cases(work_dir: Path, suite: trials.Suite) -> list[Case]`; `run_cases` runs them all and
`figures` sums them for `faults.{md,json}`. A case records what was expected and what happened,
so the report can say per class: cases, accepted (silently, where it should not be), crashed
(an error outside the documented one, or a stopped resume where a fallback is documented),
wrong bill, rows lost, writes outside the run folder.

Classes (issue 31):
- `hostile_state_file`: huge, deep, linked or mistyped checkpoints, manifests and policy files.
- `write_outside_folder`: state paths that are symlinks (lock, temp files, markers).
- `foreign_checkpoint`: a checkpoint of another run, or of an earlier step re-labelled.
- `planted_bill`: telemetry segments or markers planted to change the bill or the replay range.
- `full_telemetry_disk`: the failing step's rows must reach the store after the resume.
- `deleted_lock`: the one-trainer lock with its file removed while held.
- `lost_work_bound`: steps lost per kill against the stated bound.
- `small`: names, settings, signals at the edges of a run.
"""

from __future__ import annotations

import importlib
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CLASSES = (
    "hostile_state_file", "write_outside_folder", "foreign_checkpoint", "planted_bill",
    "full_telemetry_disk", "deleted_lock", "lost_work_bound", "small",
)
# outcome: how trainwise answered. "refused" (a clear error naming the file), "fell_back" (the
# documented fallback: previous good checkpoint, heuristic in charge), "warned" (accepted with a
# recorded warning), "accepted" (silently), "crashed" (any other exception, or a stopped resume).
OUTCOMES = ("refused", "fell_back", "warned", "accepted", "crashed")
MODULES = ("adversarial_state_files", "adversarial_folder", "adversarial_telemetry")


@dataclass
class Case:
    defect_class: str
    case: str
    expected: str  # the outcome(s) that pass, e.g. "fell_back" or "refused|fell_back"
    outcome: str
    write_outside: bool = False  # a file outside the run folder was created or changed
    bill_changed: bool = False  # the resumed run's bill differs from what the trainer committed
    rows_lost: int = 0  # telemetry rows of trained steps missing from the store
    detail: str = ""  # the error or the finding, short

    def __post_init__(self) -> None:
        if self.defect_class not in CLASSES:
            raise ValueError(f"defect_class {self.defect_class!r} is not one of {CLASSES}")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome {self.outcome!r} is not one of {OUTCOMES}")

    @property
    def passed(self) -> bool:
        return (self.outcome in self.expected.split("|") and not self.write_outside
                and not self.bill_changed and self.rows_lost == 0)

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "detail": self.detail[:300]}


def run_cases(work_dir: Path, suite: Any, modules: tuple[str, ...] = MODULES) -> list[dict]:
    """Every module's cases, each in its own folder under `work_dir/adversarial`."""
    records: list[dict] = []
    for name in modules:
        module = importlib.import_module(f"benchmarks.faults.{name}")
        folder = Path(work_dir) / "adversarial" / name
        folder.mkdir(parents=True, exist_ok=True)
        records.extend(case.record() for case in module.cases(folder, suite))
    return records


def figures(records: list[dict]) -> dict[str, Any]:
    """Per class and in all: cases, outcomes, failed cases and the four sums the issue names."""
    per_class: dict[str, Counter] = defaultdict(Counter)
    for record in records:
        counts = per_class[record["defect_class"]]
        counts["cases"] += 1
        counts[record["outcome"]] += 1
        counts["failed"] += 0 if record["passed"] else 1
        counts["write_outside"] += int(record["write_outside"])
        counts["bill_changed"] += int(record["bill_changed"])
        counts["rows_lost"] += int(record["rows_lost"])
    foreign_silent = sum(1 for r in records if r["defect_class"] == "foreign_checkpoint"
                         and r["outcome"] == "accepted")
    return {
        "cases": len(records),
        "failed": sum(1 for r in records if not r["passed"]),
        "resumes_crashed_by_hostile_file": sum(
            1 for r in records if r["outcome"] == "crashed"),
        "writes_outside_run_folder": sum(int(r["write_outside"]) for r in records),
        "foreign_checkpoints_accepted_silently": foreign_silent,
        "bills_changed_by_planted_file": sum(int(r["bill_changed"]) for r in records),
        "rows_lost_on_full_telemetry_disk": sum(
            int(r["rows_lost"]) for r in records if r["defect_class"] == "full_telemetry_disk"),
        "per_class": {name: dict(per_class[name]) for name in CLASSES if name in per_class},
    }
