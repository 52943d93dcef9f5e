"""Every decision the controllers make reaches the live trainer (issue 10, item 2), one test per
kind showing the run changed: the checkpoint interval (live file, and the trainer's own Young/Daly
retune), the preemption risk in the fast policy's observation, and the fast policy's answer to a
notice (checkpoint when the save fits, migrate otherwise), plus a bad live file refused."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time

import pytest

from controllers.checkpointing import daly_interval_s
from controllers.fast_heuristic import FastHeuristicConfig, HeuristicFastPolicy
from controllers.fast_types import FastAction, FastObservation, PreemptionResponse
from tests.test_training_loop import ScriptedPolicy, events, step_losses, text_examples, tiny_config
from training import _loop_fast
from training import _loop_run as loop_run
from training.checkpoint import load_checkpoint
from training.live_control import (
    LIVE_CONTROL_FILE,
    read_live_control,
    write_live_control,
)
from training.loop import train


def saved(result) -> dict[int, str]:
    return {e["step"]: e["reason"] for e in events(result, "checkpoint")}


def live_decisions(result) -> list[dict]:
    return [d for d in events(result, "decision") if d["layer"] != "fast"
            or d["policy"] == "checkpoint_autotune"]


class Notified:
    """Wraps a policy: sends SIGTERM to this process at `sigterm_at` (a preemption notice), writes
    a live-control file at `write_at`, and keeps every observation."""

    def __init__(self, inner, *, sigterm_at: int | None = None, write_at: int | None = None,
                 live_path=None, live: dict | None = None) -> None:
        self.inner, self.sigterm_at, self.write_at = inner, sigterm_at, write_at
        self.live_path, self.live = live_path, live or {}
        self.name = getattr(inner, "name", "wrapped")
        self.seen: list[FastObservation] = []

    def act(self, observation: FastObservation) -> FastAction:
        self.seen.append(observation)
        if observation.step == self.write_at:
            write_live_control(self.live_path, **self.live)
        action = self.inner.act(observation)
        if observation.step == self.sigterm_at and observation.preemption_notice_s is None:
            os.kill(os.getpid(), signal.SIGTERM)
        return action


# -- the file ------------------------------------------------------------------------------------
def test_live_control_round_trip_and_refusals(tmp_path):
    path = write_live_control(tmp_path / LIVE_CONTROL_FILE, checkpoint_interval_s=30.0,
                              preemption_risk=0.25, reason="hazard up", source="slow_policy")
    control = read_live_control(path)
    assert (control.checkpoint_interval_s, control.preemption_risk) == (30.0, 0.25)
    assert (control.reason, control.source) == ("hazard up", "slow_policy")
    again = read_live_control(write_live_control(path, checkpoint_interval_s=30.0,
                                                 preemption_risk=0.25, reason="hazard up"))
    assert again.digest != control.digest  # a rewrite is a new decision, applied again
    with pytest.raises(ValueError, match="empty control"):
        write_live_control(path)
    with pytest.raises(ValueError, match="checkpoint_interval_s=0.0 must be"):
        write_live_control(path, checkpoint_interval_s=0.0)
    with pytest.raises(ValueError, match=r"preemption_risk=1.5 must be a probability"):
        write_live_control(path, preemption_risk=1.5)
    assert read_live_control(path).digest == again.digest  # refused writes left the file alone
    path.write_text(json.dumps({"format": "trainwise.live_control/1", "preemption_risk": -1}))
    with pytest.raises(ValueError, match=rf"{path}.*preemption_risk=-1.*write_live_control"):
        read_live_control(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=rf"{path} is unreadable.*write_live_control"):
        read_live_control(path)


def test_interval_seconds_become_steps_with_the_measured_step_time(tmp_path):
    live = _loop_fast.LiveDecisions(path=tmp_path / LIVE_CONTROL_FILE)
    write_live_control(live.path, checkpoint_interval_s=0.5)
    live.measure(step=10, elapsed_s=1.0, last_step_time_s=0.1)
    assert live.poll().checkpoint_interval_s == 0.5 and live.interval_steps() == 5
    live.measure(step=20, elapsed_s=1.6, last_step_time_s=0.06)  # 0.06 s/step: EMA 0.08
    assert live.interval_steps() == 6
    assert live.poll() is None  # unchanged file: applied once


# -- the checkpoint interval ---------------------------------------------------------------------
def test_a_live_interval_changes_where_checkpoints_land(tmp_path):
    examples = text_examples()
    base = train(tiny_config(), examples, None, tmp_path / "base")
    assert saved(base) == {24: "final"}  # checkpoint_every_steps=0: the end only
    out = tmp_path / "live"
    policy = Notified(ScriptedPolicy({}), write_at=8, live_path=out / LIVE_CONTROL_FILE,
                      live={"checkpoint_interval_s": 1e-6, "reason": "hazard up: save often",
                            "source": "slow_policy"})
    result = train(tiny_config(), examples, None, out, fast_policy=policy)
    # Written during the tick at step 8, read at the next tick (12): a checkpoint every step.
    assert saved(result) == {**{s: "interval" for s in range(12, 24)}, 24: "final"}
    (decision,) = live_decisions(result)
    assert decision["step"] == 12 and decision["policy"] == "slow_policy"
    assert decision["reason"] == "hazard up: save often"
    assert decision["action"]["checkpoint_interval_s"] == 1e-6
    assert decision["action"]["checkpoint_every_steps"] == 1
    assert step_losses(result) == step_losses(base)  # saving more changes no number trained


def test_the_trainer_retunes_its_interval_by_young_daly(tmp_path):
    examples = text_examples()
    config = tiny_config(checkpoint_autotune=True, checkpoint_min_interval_s=1e-6)
    result = train(config, examples, None, tmp_path / "calm")
    tuned = [d for d in events(result, "decision") if d["policy"] == "checkpoint_autotune"]
    # Before a save is measured: the floor (save early, then measure, as CheckFreq profiles).
    assert tuned[0]["step"] == 4 and tuned[0]["action"]["checkpoint_interval_s"] == 1e-6
    assert saved(result)[4] == "interval"
    # Then Daly's interval from the measured save cost and the MTBF (the save fits the notice:
    # node faults alone set it).
    second = tuned[1]
    cost, mtbf = second["numbers"]["checkpoint_cost_s"], second["numbers"]["mtbf_s"]
    assert second["action"]["checkpoint_interval_s"] == pytest.approx(daly_interval_s(cost, mtbf))
    assert "Young/Daly" in second["reason"] and mtbf > 3600
    # One step apart until the tick at 8 re-tunes, then seconds apart: no more in 24 steps.
    assert saved(result) == {4: "interval", 5: "interval", 6: "interval", 7: "interval",
                             24: "final"}

    # The live risk (the hazard model's) shortens the MTBF, so the tuned interval, when a
    # reclaim loses work: here the notice is unknown (0 s), so no save fits in it.
    unnoticed = dataclasses.replace(config, preemption_notice_s=0.0)
    calm = train(unnoticed, examples, None, tmp_path / "calm-unnoticed")
    calm_tuned = [d for d in events(calm, "decision") if d["policy"] == "checkpoint_autotune"]
    out = tmp_path / "risky"
    write_live_control(out / LIVE_CONTROL_FILE, preemption_risk=0.99, reason="reclaims")
    risky = train(unnoticed, examples, None, out)
    risky_tuned = [d for d in events(risky, "decision") if d["policy"] == "checkpoint_autotune"]
    assert risky_tuned[1]["numbers"]["mtbf_s"] < calm_tuned[1]["numbers"]["mtbf_s"] / 10
    assert (risky_tuned[1]["action"]["checkpoint_interval_s"]
            < calm_tuned[1]["action"]["checkpoint_interval_s"])
    # With the notice the trainer really gets and a save that fits in it, a reclaim loses
    # nothing: the same risk leaves the interval to node faults (the one chooser's rule).
    noticed_out = tmp_path / "risky-noticed"
    write_live_control(noticed_out / LIVE_CONTROL_FILE, preemption_risk=0.99, reason="reclaims")
    noticed = train(config, examples, None, noticed_out)
    noticed_tuned = [d for d in events(noticed, "decision")
                     if d["policy"] == "checkpoint_autotune"]
    assert noticed_tuned[1]["numbers"]["mtbf_s"] == pytest.approx(mtbf, rel=1e-6)


def test_an_observed_preemption_shortens_the_tuned_mtbf(tmp_path):
    examples = text_examples()
    config = tiny_config(checkpoint_autotune=True, checkpoint_min_interval_s=1e-6)
    cut = train(config, examples, None, tmp_path, fast_policy=ScriptedPolicy({}, sigterm_at=8))
    assert cut.status == "preempted"
    before = [d for d in events(cut, "decision") if d["policy"] == "checkpoint_autotune"]
    resumed = train(config, examples, None, tmp_path, resume_from=tmp_path / "checkpoints")
    after = [d for d in events(resumed, "decision") if d["policy"] == "checkpoint_autotune"
             and d["step"] > 8]
    # Gamma-Poisson: one interruption besides the 4 h prior's pseudo-event halves the MTBF.
    assert before[0]["numbers"]["mtbf_s"] == pytest.approx(4 * 3600, rel=1e-3)
    assert after[0]["numbers"]["mtbf_s"] == pytest.approx(2 * 3600, rel=1e-3)


# -- the preemption risk -------------------------------------------------------------------------
def test_the_live_risk_reaches_the_observation(tmp_path):
    examples = text_examples()
    out = tmp_path / "run"
    write_live_control(out / LIVE_CONTROL_FILE, preemption_risk=0.7, reason="zone a hazard")
    policy = ScriptedPolicy({})
    result = train(tiny_config(max_steps=8), examples, None, out, fast_policy=policy)
    assert [o.preemption_risk for o in policy.seen] == [0.7, 0.7]
    recorded = [d["observation"]["preemption_risk"] for d in events(result, "decision")
                if d["layer"] == "fast"]
    assert recorded == [0.7, 0.7]
    (decision,) = live_decisions(result)
    assert decision["action"]["preemption_risk"] == 0.7 and decision["reason"] == "zone a hazard"
    plain = ScriptedPolicy({})
    train(tiny_config(max_steps=8), examples, None, tmp_path / "plain", fast_policy=plain)
    assert [o.preemption_risk for o in plain.seen] == [0.0, 0.0]


def test_risk_changes_the_fast_heuristics_answer():
    policy = HeuristicFastPolicy()
    observation = FastObservation(
        step=100, elapsed_s=1000.0, train_loss=1.0, grad_norm=1.0, grad_noise_scale=math.nan,
        micro_batch_size=8, grad_accum_steps=2, learning_rate=1e-3, rank_step_time_ms=(50.0,),
        dataloader_queue_depth=0, preemption_notice_s=None, preemption_risk=0.001,
        seconds_since_checkpoint=600.0, checkpoint_cost_s=10.0)
    calm = policy.act(observation)
    assert calm.preemption_response is PreemptionResponse.CONTINUE
    # Risk 0.9 in 600 s: MTBF 261 s, Young's interval sqrt(2 * 10 * 261) = 72 s < 600 s.
    risky = policy.act(dataclasses.replace(observation, preemption_risk=0.9))
    assert risky.preemption_response is PreemptionResponse.CHECKPOINT_NOW
    assert "risk 0.90" in risky.reason
    assert risky.numbers["risk_checkpoint_interval_s"] == pytest.approx(72.2, abs=0.5)


def test_the_live_risk_makes_the_heuristic_checkpoint_in_the_run(tmp_path):
    examples = text_examples()
    config = FastHeuristicConfig(risk_horizon_s=1e-6)  # a hazard no checkpoint age survives
    calm = train(tiny_config(), examples, None, tmp_path / "calm",
                 fast_policy=HeuristicFastPolicy(config))
    assert saved(calm) == {24: "final"}
    out = tmp_path / "risky"
    write_live_control(out / LIVE_CONTROL_FILE, preemption_risk=0.99, reason="reclaims")
    risky = train(tiny_config(), examples, None, out, fast_policy=HeuristicFastPolicy(config))
    # At every tick (the one at the last step saves the end too).
    assert saved(risky) == {4: "fast_policy", 8: "fast_policy", 12: "fast_policy",
                            16: "fast_policy", 20: "fast_policy", 24: "fast_policy"}
    assert all(d["observation"]["preemption_risk"] == 0.99 for d in events(risky, "decision")
               if d["layer"] == "fast")


# -- the answer to a notice ----------------------------------------------------------------------
def unsaved_work_outweighs_a_save(monkeypatch, after_step: int, seconds: float = 1.0) -> None:
    """Steps past `after_step` (the loop's 0-based step argument) take `seconds` more, so the work
    since the last checkpoint is worth more than a save of the tiny model costs however loaded the
    machine is: on a busy box one save's fsync can outlast three unpadded tiny steps, and the
    heuristic then rightly says the last checkpoint covers the notice."""
    real_step = loop_run.train_step

    def padded_step(**kwargs):
        outcome = real_step(**kwargs)
        if kwargs["step"] >= after_step:
            time.sleep(seconds / 3)
        return outcome

    monkeypatch.setattr(loop_run, "train_step", padded_step)


def test_a_long_notice_gets_the_policys_checkpoint_at_the_notice_step(tmp_path, monkeypatch):
    examples = text_examples()
    unsaved_work_outweighs_a_save(monkeypatch, after_step=5)
    policy = Notified(HeuristicFastPolicy(), sigterm_at=8)
    result = train(tiny_config(checkpoint_every_steps=5), examples, None, tmp_path,
                   fast_policy=policy)
    assert result.status == "preempted" and result.steps == 8
    assert saved(result) == {5: "interval", 8: "preemption"}
    assert load_checkpoint(result.checkpoint_path)["step"] == 8
    answer = events(result, "decision")[-1]
    assert answer["observation"]["preemption_notice_s"] > 100
    assert answer["action"]["preemption_response"] == "checkpoint_now"  # the policy's own answer
    (preemption,) = events(result, "preemption")
    assert preemption["response"].startswith("checkpoint_and_exit (policy said checkpoint_now)")


def test_a_notice_during_a_step_is_answered_at_the_periodic_tick(tmp_path, monkeypatch):
    examples = text_examples()
    real_step = loop_run.train_step

    def step_with_notice(**kwargs):
        outcome = real_step(**kwargs)
        if kwargs["step"] == 9:  # the notice lands while step 10 is computed
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # unsaved work worth more than a save on a loaded box (see above)
        return outcome

    monkeypatch.setattr(loop_run, "train_step", step_with_notice)
    policy = Notified(HeuristicFastPolicy())
    result = train(tiny_config(fast_every_steps=5, checkpoint_every_steps=3), examples, None,
                   tmp_path, fast_policy=policy)
    assert result.status == "preempted" and result.steps == 10
    ticks = [d for d in events(result, "decision") if d["layer"] == "fast"]
    assert [d["step"] for d in ticks] == [5, 10]  # asked once at the tick, not again
    assert 100 < ticks[-1]["observation"]["preemption_notice_s"] <= 120
    assert ticks[-1]["action"]["preemption_response"] == "checkpoint_now"
    assert saved(result) == {3: "interval", 6: "interval", 9: "interval", 10: "preemption"}


def test_a_notice_shorter_than_the_save_migrates_with_the_last_good_checkpoint(tmp_path):
    examples = text_examples()
    config = tiny_config(checkpoint_every_steps=5, preemption_notice_s=1.0)
    policy = Notified(HeuristicFastPolicy(), sigterm_at=8)
    result = train(config, examples, None, tmp_path, fast_policy=policy)
    assert result.status == "migrated"
    assert saved(result) == {5: "interval"}  # no save started within the 1 s notice
    assert load_checkpoint(result.checkpoint_path)["step"] == 5
    assert events(result, "decision")[-1]["action"]["preemption_response"] == "migrate"
    (preemption,) = events(result, "preemption")
    assert preemption["response"].startswith("migrate (policy said migrate)")
    assert "last good checkpoint (step 5" in preemption["response"]
    assert "steps 6..8 to replay" in preemption["response"]
    assert events(result, "run_end")[-1]["status"] == "migrated"
    # The replacement resumes from the last good checkpoint and finishes the run.
    resumed = train(tiny_config(checkpoint_every_steps=5), examples, None, tmp_path,
                    resume_from=tmp_path / "checkpoints")
    assert resumed.status == "completed" and resumed.steps == 24
    assert events(resumed, "run_start")[-1]["resumed_from"].endswith("step-0000005.pt")


def test_without_a_policy_answer_the_measured_save_decides(tmp_path):
    examples = text_examples()
    # The scripted policy answers "continue" (no preference): the loop saves if the measured
    # save fits in the notice; here no notice is left, so it migrates.
    policy = ScriptedPolicy({}, sigterm_at=8)
    config = tiny_config(checkpoint_every_steps=5, preemption_notice_s=0.0)
    result = train(config, examples, None, tmp_path / "short", fast_policy=policy)
    assert result.status == "migrated" and saved(result) == {5: "interval"}
    (preemption,) = events(result, "preemption")
    assert "does not fit the notice of 0.000s" in preemption["response"]
    # Nothing measured and no preference: the save is tried (there is nothing to migrate to).
    result = train(tiny_config(preemption_notice_s=0.0), examples, None, tmp_path / "unmeasured",
                   fast_policy=ScriptedPolicy({}, sigterm_at=8))
    assert result.status == "preempted" and saved(result) == {8: "preemption"}


def test_a_migrate_with_no_checkpoint_yet_is_a_recorded_fallback(tmp_path):
    examples = text_examples()
    # The heuristic migrates (its assumed 30 s save cannot fit in 1 s), but no checkpoint exists:
    # the fallback saves anyway, so nothing trained is lost, and the run still says migrated.
    policy = Notified(HeuristicFastPolicy(), sigterm_at=8)
    result = train(tiny_config(preemption_notice_s=1.0), examples, None, tmp_path,
                   fast_policy=policy)
    assert events(result, "decision")[-1]["action"]["preemption_response"] == "migrate"
    assert result.status == "migrated" and saved(result) == {8: "migrate_fallback"}
    assert "no good checkpoint yet, so it saves anyway" in events(result, "preemption")[0][
        "response"]


# -- bad input -----------------------------------------------------------------------------------
def test_a_bad_live_file_is_refused_recorded_and_changes_nothing(tmp_path):
    examples = text_examples()
    base_policy = ScriptedPolicy({})
    base = train(tiny_config(checkpoint_every_steps=10), examples, None, tmp_path / "base",
                 fast_policy=base_policy)
    out = tmp_path / "bad"
    out.mkdir()
    (out / LIVE_CONTROL_FILE).write_text(json.dumps({
        "format": "trainwise.live_control/1", "checkpoint_interval_s": -5,
        "preemption_risk": 0.9, "reason": "typo", "source": "slow_policy"}))
    policy = ScriptedPolicy({})
    result = train(tiny_config(checkpoint_every_steps=10), examples, None, out,
                   fast_policy=policy)
    assert result.status == "completed"
    assert saved(result) == saved(base) == {10: "interval", 20: "interval", 24: "final"}
    assert [o.preemption_risk for o in policy.seen] == [0.0] * 6  # the risk was not half-applied
    (refusal,) = live_decisions(result)  # recorded once, not at every tick
    assert refusal["action"] == {"refused": True}
    assert "refused, nothing changed" in refusal["reason"]
    assert "checkpoint_interval_s=-5" in refusal["reason"] and "write_live_control" in refusal[
        "reason"]
    assert step_losses(result) == step_losses(base)
