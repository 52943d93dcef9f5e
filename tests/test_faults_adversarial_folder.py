"""The run-folder cases of the adversarial fault suite (`benchmarks.faults.adversarial_folder`,
issue 31 classes write_outside_folder, deleted_lock, lost_work_bound, small) all pass, on a tmp
folder and without the trained suite (the one case that needs real trainer processes is left
out; about 20 s)."""

from __future__ import annotations

from collections import Counter

import torch

from benchmarks.faults import adversarial_folder

torch.set_num_threads(1)


def test_every_run_folder_case_gives_its_expected_outcome(tmp_path):
    found = adversarial_folder.cases(tmp_path, None)
    failed = [f"{c.defect_class}/{c.case}: expected {c.expected}, got {c.outcome}"
              f"{' (wrote outside)' if c.write_outside else ''}: {c.detail}"
              for c in found if not c.passed]
    assert failed == []
    classes = Counter(c.defect_class for c in found)
    assert set(classes) == {"write_outside_folder", "deleted_lock", "lost_work_bound", "small"}
    assert not any(c.write_outside for c in found)
    assert not any(c.case.endswith("second_trainer_process") for c in found)  # needs the suite
