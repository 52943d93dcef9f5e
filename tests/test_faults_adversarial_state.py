"""The adversarial state-file cases of the fault suite (issue 31, classes `hostile_state_file`
and `foreign_checkpoint`) on small synthetic inputs: every case must give its expected outcome."""

from __future__ import annotations

import time

import torch

from benchmarks.faults import adversarial, adversarial_state_files

torch.set_num_threads(1)


def test_every_adversarial_state_file_case_passes(tmp_path):
    began = time.monotonic()
    records = [case.record() for case in adversarial_state_files.cases(tmp_path, None)]
    failed = [f"{r['defect_class']}/{r['case']}: expected {r['expected']}, got {r['outcome']} "
              f"({r['detail'][:200]})" for r in records if not r["passed"]]
    assert failed == []
    figures = adversarial.figures(records)
    assert set(figures["per_class"]) == {"hostile_state_file", "foreign_checkpoint"}
    assert figures["resumes_crashed_by_hostile_file"] == 0
    assert figures["foreign_checkpoints_accepted_silently"] == 0
    assert figures["writes_outside_run_folder"] == 0
    assert len(records) > 150 and time.monotonic() - began < 120
