"""The emulated trainer process runs the job's fast policy (issue 10, item 2: the fast layer on
real processes): batch decisions and the notice answer come from it, and bad names are refused."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from telemetry.reader import read_run_events
from training.shards import build_shards
from trainwise import emulated_worker

STEPS = 12


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "pystdlib"
    build_shards("pystdlib", Path("/nonexistent-data-dir"), out)  # the stdlib: no data folder
    return out


def job(shards_dir: Path, tmp_path: Path, **extra) -> dict:
    run_dir = tmp_path / "run"
    return {"shards_dir": str(shards_dir), "run_dir": str(run_dir),
            "result_path": str(tmp_path / "result.json"), "resume_from": None,
            "train_config": {"max_steps": STEPS, "micro_batch_size": 4, "grad_accum_steps": 2,
                             "fast_every_steps": 3, "eval_every_steps": STEPS,
                             "eval_batches": 1, "eval_batch_size": 4,
                             "checkpoint_every_steps": 0, "run_id": "worker-test",
                             "model": {"vocab_size": 256, "block_size": 64, "n_layer": 1,
                                       "n_head": 2, "n_embd": 16}},
            **extra}


def fast_decisions(tmp_path: Path) -> list[dict]:
    events = read_run_events(tmp_path / "run" / "telemetry" / "worker-test", rank=0)
    return [e for e in events if e["type"] == "decision" and e["layer"] == "fast"]


def test_a_job_with_the_heuristic_fast_policy_runs_it_and_records_it(shards_dir, tmp_path):
    record = emulated_worker.run_job(job(shards_dir, tmp_path, fast_policy="heuristic",
                                         preemption_risk=0.25))
    assert record["status"] == "completed" and record["fast_policy"] == "heuristic_fast"
    assert json.loads((tmp_path / "result.json").read_text())["fast_policy"] == "heuristic_fast"
    decisions = fast_decisions(tmp_path)
    assert decisions and {d["policy"] for d in decisions} == {"heuristic_fast"}
    # The job's risk reached the fast policy's observation (through the live-control file).
    assert decisions[-1]["observation"]["preemption_risk"] == pytest.approx(0.25)


def test_a_job_without_a_fast_policy_keeps_the_no_op(shards_dir, tmp_path):
    record = emulated_worker.run_job(job(shards_dir, tmp_path))
    assert record["fast_policy"] is None and record["preemption_risk"] is None
    policies = {d["policy"] for d in fast_decisions(tmp_path)}
    assert "heuristic_fast" not in policies and policies <= {"noop"}


@pytest.mark.parametrize("bad", ["fastest", 3, ""])
def test_an_unknown_fast_policy_is_refused_naming_the_key_and_the_valid_names(
        shards_dir, tmp_path, bad):
    with pytest.raises(ValueError, match=r"'fast_policy'.*valid: noop, heuristic"):
        emulated_worker.run_job(job(shards_dir, tmp_path, fast_policy=bad))
    assert not (tmp_path / "result.json").exists() and not (tmp_path / "run").exists()


def test_a_risk_that_is_not_a_probability_is_refused(shards_dir, tmp_path):
    with pytest.raises(ValueError, match=r"'preemption_risk'=1.5"):
        emulated_worker.run_job(job(shards_dir, tmp_path, preemption_risk=1.5))


def test_the_heuristic_answers_the_sigterm_notice_with_a_checkpoint(shards_dir, tmp_path):
    """A real trainer process: SIGTERM mid-run is answered by the heuristic (recorded with the
    notice it saw) and the save, which fits the notice, is made before the process exits."""
    spec = job(shards_dir, tmp_path, fast_policy="heuristic")
    spec["train_config"]["max_steps"] = 100_000  # ends only by the notice
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    process = subprocess.Popen([sys.executable, "-m", "trainwise.emulated_worker", str(path)],
                               cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and process.poll() is None:
            try:  # the handler is up once steps are recorded
                if len(fast_decisions(tmp_path)) >= 1:
                    break
            except (ValueError, OSError):
                pass
            time.sleep(0.1)
        assert process.poll() is None, "the worker ended before the notice"
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    record = json.loads((tmp_path / "result.json").read_text())
    assert record["status"] == "preempted" and record["fast_policy"] == "heuristic_fast"
    answers = [d for d in fast_decisions(tmp_path)
               if d["observation"]["preemption_notice_s"] is not None]
    assert answers and answers[-1]["policy"] == "heuristic_fast"
    said = answers[-1]["action"]["preemption_response"]
    events = read_run_events(tmp_path / "run" / "telemetry" / "worker-test", rank=0)
    # The loop honours the heuristic's answer (a save fits the notice: checkpoint and exit).
    [left] = [e for e in events if e["type"] == "preemption"]
    assert left["response"].startswith(f"checkpoint_and_exit (policy said {said})")
    assert any(e["type"] == "checkpoint" and e["reason"] == "preemption" for e in events)
