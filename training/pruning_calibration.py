"""How much training work a job needs under trainwise's pruning, as measured on real runs.

Since issue 12 the file is re-derived from the time-to-quality runs
(`python -m benchmarks.time_to_quality.calibration`, see its docstring): `work_fraction` is the
pruned run's samples to the fixed schedule's final eval loss over the fixed schedule's own, 1.0
where the lever guard judges pruning off (the default configuration then runs full data), the
largest over a dataset's workloads. The fields below are the older `benchmarks.data` derivation
(judged at the end of the same schedule), which that suite still writes when run:

`benchmarks.data` (`trainwise bench data`) trains the char GPT on tinyshakespeare and the CNN on
MNIST with full data and with trainwise's slow-policy-driven pruning, and writes
`benchmarks/results/pruning_calibration.json`, per dataset (mean over seeds, source runs named):

- `work_fraction`: the sample passes the trainwise run spent over the same epochs as the
  full-data run, as a share of the full-data run's, for seeds that ended at full-data quality
  (final eval loss within 1%, accuracy within 0.3 points); other seeds count 1.0. It is the work
  a job that runs the same schedule needs, which is what `work_fraction(dataset)` returns;
- `first_reach_vs_full`: passes to first reach the full-data final eval loss over the passes the
  full-data run itself needed (noisy when the full-data curve plateaus early).

A simulator multiplies a job's work by `work_fraction(dataset)`, so that savings from pruning in
simulation are the measured ones.

When the file is missing the answer is 1.0 (no saving assumed), with a warning that says how to
produce it. The file is read, never written, here.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

CALIBRATION_PATH = (Path(__file__).resolve().parent.parent / "benchmarks" / "results"
                    / "pruning_calibration.json")
CALIBRATION_FORMAT = "trainwise.pruning_calibration/1"
NO_SAVING = 1.0


def load_calibration(path: str | Path | None = None) -> dict[str, Any] | None:
    """The calibration document, or None (with a warning) when the file is missing."""
    path = Path(path) if path is not None else CALIBRATION_PATH
    if not path.is_file():
        warnings.warn(
            f"no pruning calibration at {path}: assuming pruning saves no work (fraction "
            f"{NO_SAVING}); run `python -m benchmarks.time_to_quality.calibration` (from "
            "time_to_quality.json; `python -m benchmarks.data` wrote the older figure)",
            stacklevel=3)
        return None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"pruning calibration {path} is corrupt ({error}): rerun "
                         "`python -m benchmarks.data`") from error
    if not isinstance(document, dict) or document.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"pruning calibration {path} is not {CALIBRATION_FORMAT!r}: rerun "
                         "`python -m benchmarks.data`")
    return document


def work_fraction(dataset: str, path: str | Path | None = None) -> float:
    """Measured share of full-data work needed to reach the full-data eval loss with trainwise
    pruning, for `dataset` ("tinyshakespeare", "mnist"); 1.0 when no calibration file exists.

    Raises ValueError for a dataset the file does not cover (naming the ones it does) or a value
    outside (0, 1.5].
    """
    document = load_calibration(path)
    if document is None:
        return NO_SAVING
    datasets = document.get("datasets", {})
    if dataset not in datasets:
        raise ValueError(f"pruning calibration has no dataset {dataset!r}; measured: "
                         f"{', '.join(sorted(datasets)) or 'none'} (add it to benchmarks.data)")
    value = datasets[dataset].get("work_fraction")
    if not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.5:
        raise ValueError(f"pruning calibration of {dataset!r} has work_fraction {value!r}, "
                         "expected a number in (0, 1.5]: rerun `python -m benchmarks.data`")
    return float(value)
