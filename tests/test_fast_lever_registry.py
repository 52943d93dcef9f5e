"""The fast-layer lever registry (controllers.fast_levers): a lever is one registered module.

The worked example (tests/_eval_every_lever.py, a lever for a knob FastAction has no field for)
changes a real tiny training run once its module is imported, and is recorded in the fast
decision; without it the run is what it was. Duplicate names, a lever that raises and extras no
lever applies each fail clearly.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys

import pytest

from controllers.fast_heuristic import HeuristicFastPolicy, safe_fast_action
from controllers.fast_levers import (
    FastLever,
    LeverProposal,
    lever_named,
    register_lever,
    registered_levers,
    unregister_lever,
)
from controllers.fast_types import FastAction, FastObservation, PreemptionResponse
from tests.test_training_loop import events, step_losses, text_examples, tiny_config
from training import _loop_fast
from training.loop import train

EXAMPLE_MODULE = "tests._eval_every_lever"
BUILT_INS = ["batch_scaling", "straggler_shares", "preemption"]

OBS = FastObservation(
    step=100, elapsed_s=60.0, train_loss=2.5, grad_norm=1.2, grad_noise_scale=math.nan,
    micro_batch_size=16, grad_accum_steps=2, learning_rate=1e-3,
    rank_step_time_ms=(100.0, 100.0), dataloader_queue_depth=4, preemption_notice_s=None,
    preemption_risk=0.05, seconds_since_checkpoint=200.0, checkpoint_cost_s=10.0)


@pytest.fixture
def eval_lever():
    """Registers the example lever by importing its module; unregisters it afterwards (the
    registry is process-wide, and other tests expect the built-ins only)."""
    sys.modules.pop(EXAMPLE_MODULE, None)
    module = importlib.import_module(EXAMPLE_MODULE)
    yield module.EvalEveryLever
    if lever_named("eval_every_steps") is not None:  # a test may have unregistered it itself
        unregister_lever("eval_every_steps")
    sys.modules.pop(EXAMPLE_MODULE, None)


@pytest.fixture
def scratch_levers():
    """Names registered by a test are removed after it."""
    names: list[str] = []
    yield names
    for name in names:
        if lever_named(name) is not None:
            unregister_lever(name)


def eval_steps(result) -> list[int]:
    return [e["step"] for e in events(result, "eval")]


def test_the_built_in_levers_are_registered_in_order():
    assert [cls.name for cls in registered_levers()] == BUILT_INS
    assert [lever.name for lever in HeuristicFastPolicy().levers] == BUILT_INS


def test_the_example_lever_changes_a_real_run_and_is_recorded(tmp_path, eval_lever, monkeypatch):
    examples = text_examples()
    config = tiny_config()  # 24 steps, eval every 8, a fast tick every 4
    # Any loss counts as flat: the lever asks at its first full window (the tick at step 12).
    monkeypatch.setattr(eval_lever, "PLATEAU_MIN_RELATIVE_DROP", 1.0)
    policy = HeuristicFastPolicy()
    assert [lever.name for lever in policy.levers] == [*BUILT_INS, "eval_every_steps"]
    with_lever = train(config, examples, None, tmp_path / "with", fast_policy=policy)

    assert eval_steps(with_lever) == [8, 12, 14, 16, 18, 20, 22, 24]
    decisions = {d["step"]: d for d in events(with_lever, "decision") if d["layer"] == "fast"}
    asked = decisions[12]
    assert asked["action"]["extras"] == {"eval_every_steps": 2}
    assert asked["reason"].endswith("evaluate every 2 steps")
    assert asked["numbers"]["eval_every_steps"] == 2.0
    assert "eval_lever_relative_loss_drop" in asked["numbers"]
    # Before the window is full the lever says nothing and the record keeps its old shape.
    assert "extras" not in decisions[4]["action"]
    assert decisions[4]["reason"].endswith("; no notice")  # the preemption lever's, last

    unregister_lever("eval_every_steps")
    without = train(config, examples, None, tmp_path / "without",
                    fast_policy=HeuristicFastPolicy())
    assert eval_steps(without) == [8, 16, 24]
    assert not any("extras" in d["action"] for d in events(without, "decision")
                   if d["layer"] == "fast")
    # Evaluating more often changes nothing of the training itself.
    assert step_losses(without) == step_losses(with_lever)


def test_the_example_lever_waits_for_a_plateau(eval_lever):
    lever = eval_lever()
    falling = [lever.propose(dataclasses.replace(OBS, train_loss=loss), OBS)
               for loss in (3.0, 2.0, 1.0)]
    assert all(not p.changes for p in falling)
    flat = [lever.propose(dataclasses.replace(OBS, train_loss=loss), OBS)
            for loss in (1.0, 0.995)]
    assert flat[-1].changes == {"eval_every_steps": 2}
    assert "train loss flat (1.000->0.995" in flat[-1].reason

    policy = HeuristicFastPolicy()
    actions = [policy.act(dataclasses.replace(OBS, train_loss=1.0)) for _ in range(3)]
    assert [a.extras for a in actions] == [{}, {}, {"eval_every_steps": 2}]
    assert "eval_every_steps" not in vars(actions[-1])  # only in extras, not a stray field
    assert actions[-1].reason.endswith("; no notice; train loss flat (1.000->1.000 over 2 ticks, "
                                       "drop 0.0% < 2%): evaluate every 2 steps")


def test_a_duplicate_lever_name_is_refused_naming_both(scratch_levers):
    @register_lever("dup_knob", order=50)
    class First(FastLever):
        pass

    scratch_levers.append("dup_knob")
    with pytest.raises(ValueError, match=r"'dup_knob' is already registered by .*First; give "
                                         r".*Second another name"):
        @register_lever("dup_knob", order=50)
        class Second(FastLever):
            pass

    with pytest.raises(ValueError, match="is a FastAction field"):
        register_lever("learning_rate", order=50)
    with pytest.raises(TypeError, match="subclass FastLever"):
        register_lever("not_a_lever", order=50)(object)


def test_a_lever_that_raises_gives_the_safe_fallback(scratch_levers):
    @register_lever("boom", order=15)
    class Boom(FastLever):
        def propose(self, observation, draft):
            raise RuntimeError("division by a plateau")

    scratch_levers.append("boom")
    policy = HeuristicFastPolicy()
    for notice, said in ((None, "continue"), (30.0, "checkpoint now (notice up)")):
        observation = dataclasses.replace(OBS, preemption_notice_s=notice)
        action = policy.act(observation)
        expected = safe_fast_action(
            observation, "fallback: lever 'boom' failed (RuntimeError: division by a plateau): "
            f"keep batch, equal shares, {said}", {"lever_failed": 1.0})
        assert action == expected
        _loop_fast.validate_action(action, policy.name, world_size=2)
    unregister_lever("boom")  # the same observation without the bad lever is decided as usual
    assert not HeuristicFastPolicy().act(OBS).reason.startswith("fallback")


def test_a_lever_may_only_turn_its_own_extra_knob(scratch_levers):
    @register_lever("greedy", order=50)
    class Greedy(FastLever):
        def propose(self, observation, draft):
            return LeverProposal({"eval_every_steps": 1})

    scratch_levers.append("greedy")
    action = HeuristicFastPolicy().act(OBS)
    assert action.reason.startswith("fallback: lever 'greedy' failed (ValueError: fast lever "
                                    "'greedy' proposed a change to 'eval_every_steps'")


def test_a_later_lever_sees_the_draft_of_the_earlier_ones(scratch_levers):
    seen: list[FastAction] = []

    @register_lever("watcher", order=35)
    class Watcher(FastLever):
        def propose(self, observation, draft):
            seen.append(draft)
            return LeverProposal(reason="watched",
                                 numbers={"watcher_shares": len(draft.rank_work_shares)})

    scratch_levers.append("watcher")
    action = HeuristicFastPolicy().act(dataclasses.replace(OBS, preemption_notice_s=0.5))
    assert seen[0].preemption_response is PreemptionResponse.MIGRATE  # the preemption lever's
    assert action.reason.endswith("; watched") and action.numbers["watcher_shares"] == 2


def test_the_loop_refuses_extras_no_registered_lever_applies():
    base = FastAction(16, 2, 1e-3, (1.0,))
    _loop_fast.validate_action(base, "p")
    assert "extras" not in _loop_fast.action_record(base)
    for extras, message in (({"warp_drive": 9}, r"'warp_drive' names no registered fast lever"),
                            ({"preemption": 1}, r"defines no apply\(run, value\)"),
                            ({"preemption": [1]}, "is not a float, int or str")):
        with pytest.raises(ValueError, match=message):
            _loop_fast.validate_action(dataclasses.replace(base, extras=extras), "p")
