"""Per-lever figures of a run (issue 12, item 5): `trainwise explain` and MLflow show what each
lever decided (batch changes, pruning rates and skipped samples, the guard's switch-offs) and
what it saved or cost in samples and seconds against the fixed schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from telemetry.reader import read_run_events
from tests.test_lever_guard_run import ShapePolicy
from tests.test_training_loop import text_examples, tiny_config
from training.consumption import epochs, read_consumption
from training.dynamic_pruning import DynamicPruningConfig
from training.loop import train
from trainwise import explain, mlflow_live

torch.set_num_threads(1)

# A reference no lever can meet: every lever that acts costs quality against it.
UNREACHABLE = ((0.0, 1e-3), (1e6, 1e-3))


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    guarded = tiny_config(max_steps=40, run_id="bad-batch", lever_guard=True,
                          lever_guard_reference=UNREACHABLE, lever_guard_patience=2,
                          lever_guard_warmup_fraction=0.0)
    train(guarded, text_examples(), None, root / "bad-batch",
          fast_policy=ShapePolicy(from_step=4, micro=32, accum=2))
    train(tiny_config(max_steps=56, eval_every_steps=14, run_id="pruned"), text_examples(), None,
          root / "pruned", pruning=DynamicPruningConfig(pruning_rate=0.5))
    return root


def records(runs_root: Path, run: str) -> list[dict]:
    return read_run_events(runs_root / run / "telemetry" / run)


def test_explain_shows_the_batch_changes_their_cost_and_the_guards_switch_off(runs_root):
    events = records(runs_root, "bad-batch")
    effects = explain.lever_effects(events)
    steps = [e for e in events if e["type"] == "step"]
    at_lever = [e for e in steps if (e["micro_batch_size"], e["grad_accum_steps"]) == (32, 2)]
    assert at_lever  # it ran at the lever's shape before the guard put it back
    assert effects["batch"]["steps_at_other_shapes"] == len(at_lever)
    assert effects["batch"]["extra_samples"] == len(at_lever) * (64 - 16)
    assert effects["batch"]["extra_s"] is not None and effects["batch"]["extra_s"] > 0
    assert [c["to"] for c in effects["batch"]["changes"]] == [[32, 2], [8, 2]]
    off = effects["guard"]["switch_offs"]
    assert [o["lever"] for o in off] == ["batch"] and off[0]["reason"].startswith("costs quality")
    assert explain.lever_states(effects)["batch"] == f"off: {off[0]['reason']}"

    text = explain.timeline("bad-batch", runs_root)
    assert "levers (against the fixed schedule: batch 8x2, full data; guard on):" in text
    assert f"step {at_lever[0]['step']}: 8x2 -> 32x2" in text
    assert f"{len(at_lever) * 48:,} samples cost" in text
    assert "batch: off (by the guard, below)" in text
    assert f"guard: step {off[0]['step']}: batch switched off: costs quality" in text
    assert "pruning: not used" in text


def test_explain_shows_what_pruning_skipped_and_the_seconds_it_saved(runs_root):
    telemetry = runs_root / "pruned" / "telemetry" / "pruned"
    consumption = read_consumption(telemetry)
    skipped = sum(e["skipped_count"] for e in epochs(consumption))
    assert skipped > 0
    effects = explain.lever_effects(records(runs_root, "pruned"), consumption)
    assert effects["pruning"]["active"] and effects["pruning"]["skipped_samples"] == skipped
    assert effects["pruning"]["saved_s"] > 0
    assert effects["pruning"]["epoch_rates"][1] == 0.5
    text = explain.timeline("pruned", runs_root)
    assert "guard off" in text and "pruning: on; epoch rates: 0.5" in text
    assert f"{skipped:,} samples saved" in text
    assert "batch: not used; changes: none" in text


def test_mlflow_gets_the_same_per_lever_figures(runs_root, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    telemetry = runs_root / "bad-batch" / "telemetry" / "bad-batch"
    live = mlflow_live.LiveRun(mlflow_live.LiveRunSpec(
        tracking_uri=uri, experiment="levers", run_name="bad-batch", params={}, tags={},
        telemetry_dir=telemetry), interval_s=3600, skip_existing=False).start()
    run_id = live.finish("completed", end_time_s=1_700_000_010.0, final_metrics={})
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    effects = explain.lever_effects(read_run_events(telemetry))
    expected = explain.lever_metrics(effects)
    assert {k: v for k, v in run.data.metrics.items() if k.startswith("levers/")
            and k != "levers/batch_on"} == pytest.approx(expected)
    assert run.data.metrics["levers/batch_extra_samples"] > 0
    assert run.data.metrics["levers/guard_switch_offs"] == 1
    assert run.data.metrics["levers/batch_on"] == 0  # logged live when the guard switched it off
    assert run.data.tags["trainwise/lever_batch"].startswith("off: costs quality")
    assert run.data.tags["trainwise/lever_pruning"] == "not used"


def step_records(shapes_and_ms: list[tuple[tuple[int, int], float]]) -> list[dict]:
    start = {"type": "run_start", "train_config": {"micro_batch_size": 8, "grad_accum_steps": 2}}
    return [start] + [{"type": "step", "step": i + 1, "micro_batch_size": shape[0],
                       "grad_accum_steps": shape[1], "step_time_ms": ms}
                      for i, (shape, ms) in enumerate(shapes_and_ms)]


def test_a_loaded_stretch_at_the_base_shape_does_not_turn_a_dearer_shape_into_a_saving():
    # The base shape's steps ran at 3 ms alone and 9 ms while another process held the core;
    # the lever's shape costs 5.5 ms per step. A median of the base steps (9 ms) would have
    # called 12 steps at the dearer shape a 42 ms saving.
    base, lever = (8, 2), (32, 2)
    events = step_records([(base, 3.0)] * 4 + [(base, 9.0)] * 10 + [(lever, 5.5)] * 12
                          + [(base, 3.0)] * 4)
    effects = explain.lever_effects(events)
    assert effects["batch"]["extra_s"] == pytest.approx(12 * (5.5 - 3.0) / 1000.0)
    # The cheaper shape's saving holds just as well when its own steps ran loaded.
    cheaper = step_records([(base, 3.0)] * 6 + [((4, 2), 1.5)] * 3 + [((4, 2), 8.0)] * 9)
    assert explain.lever_effects(cheaper)["batch"]["extra_s"] == pytest.approx(12 * -1.5 / 1000.0)
