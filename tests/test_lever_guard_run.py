"""The lever guard inside a real (tiny) training run: a lever that costs quality is switched off
mid-run with its reason recorded as a decision and stays off on resume; a lever that does no
harm stays on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from controllers.fast_types import FastAction, FastObservation
from telemetry.reader import read_run_events
from tests.test_training_loop import text_examples, tiny_config
from training.consumption import epochs, read_consumption
from training.dynamic_pruning import DynamicPruningConfig
from training.loop import train

torch.set_num_threads(1)

BUDGET_STEPS = 96  # the same schedule for the reference and the levers
BASE_BATCH = 16  # tiny_config: micro 8 x accumulation 2


class ShapePolicy:
    """A batch lever: from `from_step` on, asks for the same batch shape at every tick."""

    name = "shape_lever"

    def __init__(self, from_step: int, micro: int, accum: int) -> None:
        self.from_step, self.micro, self.accum = from_step, micro, accum

    def act(self, observation: FastObservation) -> FastAction:
        wanted = observation.step >= self.from_step
        return FastAction(
            micro_batch_size=self.micro if wanted else observation.micro_batch_size,
            grad_accum_steps=self.accum if wanted else observation.grad_accum_steps,
            learning_rate=observation.learning_rate, rank_work_shares=(1.0,),
            reason=f"test lever: {self.micro}x{self.accum}" if wanted else "keep")


def guard_decisions(result_or_dir) -> list[dict]:
    directory = getattr(result_or_dir, "telemetry_dir", result_or_dir)
    return [e for e in read_run_events(directory)
            if e["type"] == "decision" and e["policy"] == "lever_guard"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[tuple[float, float], ...]:
    """The fixed schedule's (samples, eval loss) curve on this workload (the calibration)."""
    out = tmp_path_factory.mktemp("fixed")
    result = train(tiny_config(max_steps=BUDGET_STEPS, run_id="fixed"), text_examples(), None,
                   out)
    events = read_run_events(result.telemetry_dir)
    samples = {e["step"]: e["samples_seen"] for e in events if e["type"] == "step"}
    return tuple((samples[e["step"]], e["eval_loss"]) for e in events if e["type"] == "eval")


def guarded(reference, **changes):
    return tiny_config(max_steps=BUDGET_STEPS, lever_guard=True,
                       lever_guard_reference=reference, lever_guard_patience=2,
                       lever_guard_warmup_fraction=0.05, **changes)


def test_a_batch_lever_that_costs_quality_is_switched_off_mid_run_and_stays_off(
        tmp_path, reference):
    # 8x the batch from step 4: at the same samples it has taken 8x fewer steps, so its eval
    # loss stays far above the fixed schedule's curve.
    lever = ShapePolicy(from_step=4, micro=64, accum=2)
    config = guarded(reference, run_id="bad-batch")
    result = train(config, text_examples(), None, tmp_path, fast_policy=lever,
                   stop_after_steps=24)
    decisions = guard_decisions(result)
    assert decisions[0]["action"]["guard"] == "start"
    offs = [d for d in decisions if d["action"]["guard"] == "switch_off"]
    assert [d["action"]["lever"] for d in offs] == ["batch"]
    off = offs[0]
    assert off["reason"].startswith("costs quality") and "switched off" in off["reason"]
    assert off["numbers"]["excess"] > 0.02 and off["step"] < 24  # mid-run, not at the end
    steps = [e for e in read_run_events(result.telemetry_dir) if e["type"] == "step"]
    after = [e["micro_batch_size"] * e["grad_accum_steps"] for e in steps
             if e["step"] > off["step"]]
    assert after and set(after) == {BASE_BATCH}  # back to the fixed batch at once
    refused = [d for d in decisions if d["action"]["guard"] == "refuse_batch"]
    assert refused and refused[0]["action"]["refused"] == [64, 2]
    summary = decisions[-1]
    assert summary["action"]["guard"] == "summary"
    assert summary["action"]["levers_off"] == {"batch": off["reason"]}
    assert summary["numbers"]["samples_seen"] > summary["numbers"]["fixed_batch_samples"]

    # Resumed: the lever stays off (RunState.levers_off is in the checkpoint).
    resumed = train(config, text_examples(), None, tmp_path, fast_policy=lever,
                    resume_from=tmp_path / "checkpoints", stop_after_steps=12)
    new_steps = [e for e in read_run_events(resumed.telemetry_dir)
                 if e["type"] == "step" and e["step"] > 24]
    assert new_steps and {e["micro_batch_size"] * e["grad_accum_steps"]
                          for e in new_steps} == {BASE_BATCH}
    restart = [d for d in guard_decisions(resumed) if d["action"]["guard"] == "start"][-1]
    assert restart["action"]["levers_off"] == {"batch": off["reason"]}


def test_a_lever_that_does_no_harm_stays_on(tmp_path, reference):
    # The same global batch in one pass instead of two micro batches: the same samples, the
    # same loss, and no slower per sample.
    lever = ShapePolicy(from_step=4, micro=16, accum=1)
    result = train(guarded(reference, run_id="harmless"), text_examples(), None, tmp_path,
                   fast_policy=lever, stop_after_steps=48)
    decisions = guard_decisions(result)
    assert [d["action"]["guard"] for d in decisions] == ["start", "summary"]
    assert decisions[-1]["action"]["levers_on"] == ["batch"]
    assert decisions[-1]["action"]["levers_off"] == {}
    steps = [e for e in read_run_events(result.telemetry_dir) if e["type"] == "step"]
    assert steps[-1]["micro_batch_size"] == 16 and steps[-1]["grad_accum_steps"] == 1


def test_pruning_that_costs_quality_gets_rate_zero_from_the_next_epoch(tmp_path, reference):
    # Rate 0.9 of the well-learned examples left out (weighted 10x): at the same samples its
    # eval loss falls behind the fixed schedule's.
    result = train(guarded(reference, run_id="bad-pruning"), text_examples(), None, tmp_path,
                   pruning=DynamicPruningConfig(pruning_rate=0.9))
    offs = [d for d in guard_decisions(result) if d["action"]["guard"] == "switch_off"]
    assert [d["action"]["lever"] for d in offs] == ["pruning"]
    assert offs[0]["reason"].startswith("costs quality")
    records = read_consumption(result.telemetry_dir)
    rate_changes = [r for r in records if r["type"] == "rate"]
    assert [(r["source"], r["rate"]) for r in rate_changes] == [("lever_guard", 0.0)]
    assert rate_changes[0]["reason"] == offs[0]["reason"]
    later = [e for e in epochs(records) if e["epoch"] >= rate_changes[0]["applies_from_epoch"]]
    assert later and all(e["skipped_count"] == 0 for e in later)
    # Switched off, its budget is the fixed schedule's samples: what it skipped is given back.
    assert BUDGET_STEPS * BASE_BATCH <= result.samples_seen < (BUDGET_STEPS + 1) * BASE_BATCH


def test_without_the_guard_the_same_bad_lever_keeps_running(tmp_path, reference):
    config = dataclasses.replace(guarded(reference, run_id="unguarded"), lever_guard=False)
    result = train(config, text_examples(), None, tmp_path,
                   fast_policy=ShapePolicy(from_step=4, micro=64, accum=2), stop_after_steps=24)
    assert guard_decisions(result) == []
    steps = [e for e in read_run_events(result.telemetry_dir) if e["type"] == "step"]
    assert steps[-1]["micro_batch_size"] == 64


def test_a_bad_reference_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"\(samples, eval loss\) pairs"):
        tiny_config(lever_guard_reference=((1.0, float("nan")),))
