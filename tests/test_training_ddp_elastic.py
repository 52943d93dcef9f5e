"""Elastic membership under torchrun: `--nnodes=1:1 --max-restarts=1` with c10d rendezvous. A
worker killed outright (SIGKILL: no notice, no checkpoint) makes torch elastic restart the gang;
the restarted ranks resume from the last checkpoint (`resume_from: "auto"`) and finish the run.
Lost work per failure is read from the restarted run's telemetry (benchmarks.stragglers_ddp
measures it on its benchmark job; this test on the tiny test model). Slow: two gang starts."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.stragglers_ddp import elastic_trial
from tests.test_training_ddp import ddp_config, step_records
from tests.test_training_loop import TINY_GPT
from training.ddp_worker import model_spec

MAX_STEPS = 10


@pytest.mark.slow
def test_killed_worker_is_restarted_and_the_run_continues_from_its_checkpoint(tmp_path):
    base = dataclasses.replace(ddp_config(), max_steps=MAX_STEPS, checkpoint_every_steps=3)
    config = {k: v for k, v in dataclasses.asdict(base).items() if k != "model"}
    config["model"] = model_spec(TINY_GPT)
    found = elastic_trial(tmp_path, config=config, examples="tests.test_training_loop:text_examples",
                          kill_rank=1, kill_after_step=5, micro_batch_ms=100.0, timeout_s=300)
    assert found["returncode"] == 0, found["stderr_tail"]
    assert found["status"] == ["completed", "completed"], found["results"]
    assert found["final_steps"] == [MAX_STEPS, MAX_STEPS] and found["restarts"] == 1
    assert found["resumed_from"].endswith("step-0000003.pt")  # the last checkpoint before 5
    assert found["replay_from_step"] == 3 and found["replay_to_step"] >= 5
    assert found["replayed_steps"] >= 2 and found["lost_s"] > 0
    assert found["downtime_s"] is not None and found["downtime_s"] > 0
    # Steps 4..5 were trained twice: the telemetry keeps both (the store flags the replays).
    steps = [r["step"] for r in step_records(tmp_path / "run", 0)]
    assert steps[-1] == MAX_STEPS and steps.count(4) == 2
