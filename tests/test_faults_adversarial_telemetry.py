"""The adversarial telemetry cases of the fault suite (issue 31, classes planted_bill and
full_telemetry_disk; benchmarks/faults/adversarial_telemetry.py): every generated case must
pass, with no bill changed by a planted file and no row lost on a full telemetry disk.

Slow (about 30 s: some 50 tiny training runs); tests/test_billing_trust.py and
tests/test_telemetry_full_disk_rows.py cover both classes in the default run."""

from __future__ import annotations

import pytest

from benchmarks.faults import adversarial, adversarial_telemetry


@pytest.mark.slow
def test_every_adversarial_telemetry_case_passes(tmp_path):
    cases = adversarial_telemetry.cases(tmp_path, None)
    classes = {case.defect_class for case in cases}
    assert classes == {"planted_bill", "full_telemetry_disk"}
    assert len(cases) >= 30
    failed = [case.record() for case in cases if not case.passed]
    assert failed == [], failed
    figures = adversarial.figures([case.record() for case in cases])
    assert figures["bills_changed_by_planted_file"] == 0
    assert figures["rows_lost_on_full_telemetry_disk"] == 0
