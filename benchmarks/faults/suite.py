"""Runs the whole suite (or its quick version) and returns the JSON-ready payload."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.faults import adversarial, environment, harness, hostile, report, trials


def run_suite(work_dir: Path, *, quick: bool, seed: int = 0,
              say: Callable[[str], None] = print) -> dict[str, Any]:
    began = time.monotonic()
    rng = np.random.default_rng(seed)
    say(f"preparing shards and the reference run in {work_dir}")
    suite = trials.Suite.prepare(Path(work_dir))
    records = []
    per_kind: Counter[str] = Counter()
    for kind in trials.plan(quick):
        record = trials.run_trial(suite, kind, per_kind[kind], rng)
        per_kind[kind] += 1
        records.append(record)
        say(f"{record['run_id']}: hit={record['hit']} lost_steps={record.get('lost_steps')} "
            f"resume_failed={record['resume_failed']} corrupt={len(record['corrupt_checkpoints'])} "
            f"rows lost/dup={record.get('rows_lost')}/{record.get('rows_duplicated')} "
            f"({record['wall_s']} s)")
    say("hostile files")
    donor = harness.Run(suite.work_dir / "reference", suite.shards_dir,
                        {**suite.base_config, "run_id": "reference"})
    cases = (hostile.checkpoint_cases(suite.work_dir, donor, suite)
             + hostile.telemetry_cases(suite.work_dir) + hostile.trace_cases(suite.work_dir))
    executed = hostile.executed(cases)
    say("full disk")
    method, disk = environment.disk_full_cases(suite)
    say("concurrent ingestion")
    ingestion = environment.concurrent_ingestion(suite)
    say("adversarial state files (issue 31's classes)")
    adversarial_records = adversarial.run_cases(suite.work_dir, suite)
    figures = report.figures(records, cases, executed, method, disk, ingestion,
                             suite.reference.step_s)
    figures["adversarial"] = adversarial.figures(adversarial_records)
    figures["lost_work_bound_steps"] = 2 * suite.shape.checkpoint_every_steps
    return {
        "mode": "quick" if quick else "full", "seed": seed,
        "partition": suite.shards_dir.name, "run_shape": asdict(suite.shape),
        "checkpoint_format": "2 (payload + commit manifest)" if harness.has_manifests()
        else "1 (embedded checksum)",
        "wall_s": time.monotonic() - began, "figures": figures, "trials": records,
        "hostile": cases, "full_disk": disk, "concurrent_ingestion": ingestion,
        "adversarial": adversarial_records,
    }
