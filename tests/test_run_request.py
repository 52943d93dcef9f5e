"""One run schema from the launchpad to the trainer (issue 25, item 6): `TrainRunConfig` is built
from `TrainRequest`, and `TrainConfig` takes every field the two share, so a value set in the
Dagster launchpad reaches the trainer without a hand copy on the way."""

from __future__ import annotations

import dataclasses

import pytest

from assets.training import TrainRunConfig
from training.loop import TrainConfig
from trainwise import run_request, schedule, settings
from trainwise.run_request import TrainRequest, trainer_config

# Fields that steer the driver, not the trainer (each is read by name in trainwise/runs.py or
# the engines); a new request field must be placed here or be a TrainConfig field.
DRIVER_FIELDS = {"partition", "region", "fast_policy", "data_selection", "market", "zone",
                 "nodes", "lever_guard_reference_run", "allocation_policy",
                 "schedule_override_reason", "replay_steps_per_tick"}


def test_the_launchpad_config_is_the_request_less_the_job_and_schedule_filled_fields():
    request_fields = {f.name: f for f in dataclasses.fields(TrainRequest)}
    assert set(TrainRunConfig.model_fields) == (
        set(request_fields) - set(run_request.JOB_FIELDS) - set(run_request.SCHEDULE_FIELDS))
    for name, info in TrainRunConfig.model_fields.items():
        doc = request_fields[name].metadata["doc"]
        if name in run_request.SCHEDULED_IN_LAUNCHPAD:
            # Empty in the launchpad means the published schedule's value (issue 28).
            assert info.default == run_request.FROM_SCHEDULE, name
            assert info.description.startswith(doc) and "published schedule" in info.description
            continue
        assert info.default == request_fields[name].default, name
        assert info.description and info.description == doc


def test_every_request_field_is_the_trainers_or_the_drivers():
    request_fields = {f.name for f in dataclasses.fields(TrainRequest)}
    shared = run_request.shared_with_trainer()
    assert request_fields - shared == DRIVER_FIELDS
    assert {"checkpoint_every_steps", "checkpoint_autotune", "eval_batches",
            "eval_batch_size", "max_steps", "seed", "run_id"} <= shared


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 3
    if isinstance(value, float):
        return value * 0.5
    return f"{value}-x"


def test_every_shared_field_reaches_the_trainer_as_set():
    base = TrainRequest(partition="pystdlib", run_id="r")
    changes = {name: _changed(getattr(base, name)) for name in run_request.shared_with_trainer()}
    config = trainer_config(dataclasses.replace(base, **changes))
    for name, value in changes.items():
        assert getattr(config, name) == value, name


def test_what_the_driver_derives_wins_over_the_request():
    config = trainer_config(TrainRequest(partition="pystdlib", run_id="r", seed=5),
                            price_usd_per_hour=3.06, seed=9)
    assert (config.price_usd_per_hour, config.seed) == (3.06, 9)


def test_a_launchpad_value_reaches_the_trainer():
    launchpad = TrainRunConfig(checkpoint_every_steps=7, checkpoint_autotune=True,
                               eval_batch_size=16)
    request = schedule.request_from_launchpad(
        launchpad.model_dump(), schedule.published(settings.home_dir()), partition="pystdlib",
        run_id="r")
    config = trainer_config(request)
    assert (config.checkpoint_every_steps, config.checkpoint_autotune,
            config.eval_batch_size) == (7, True, 16)
    assert TrainConfig().checkpoint_every_steps != 7, "the value did not come from a default"


def test_a_launchpad_choice_outside_the_schema_is_refused_by_pydantic():
    with pytest.raises(ValueError, match="fast_policy"):
        TrainRunConfig(fast_policy="fastest")


@pytest.mark.parametrize("field, value", [
    ("eval_batches", 0), ("eval_batch_size", -2), ("checkpoint_every_steps", -1),
    ("checkpoint_every_steps", 2.5), ("checkpoint_autotune", "yes"),
])
def test_the_new_trainer_knobs_are_checked_before_anything_is_written(field, value):
    from trainwise.runs import validate_request

    request = TrainRequest(partition="pystdlib", run_id="r", instance_type="p3.2xlarge")
    validate_request(request)  # the defaults pass
    with pytest.raises(ValueError, match=field):
        validate_request(dataclasses.replace(request, **{field: value}))
