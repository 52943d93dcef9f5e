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
