"""The fast-layer benchmark really trains, really gets preempted and resumes to the end."""

import json

from benchmarks import fast_layer


def test_fast_layer_bench_preempts_checkpoints_and_resumes(tmp_path):
    assert fast_layer.main(["--steps", "40", "--preempt-at-step", "15",
                            "--fast-every-steps", "5", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fast_layer.json").read_text())
    p = result["preemption"]
    assert p["status_first_call"] == "preempted" and p["resumed_status"] == "completed"
    assert p["notice_at_step"] >= 15 and p["steps_after_resume"] == 40
    assert p["checkpoint_save_ms"] is not None
    assert result["decisions"] >= 5 and 0 < result["fast_layer_share_of_step_time"] < 1
    assert result["batch_changes"] and result["meta"]["command"].startswith("python -m")
    assert "Preemption notice" in (tmp_path / "fast_layer.md").read_text()
