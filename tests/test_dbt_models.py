"""The dbt-duckdb project builds over ingested telemetry and computes cost per token."""

import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from telemetry import events, store
from telemetry.writer import SegmentWriter

DBT_DIR = Path(__file__).resolve().parent.parent / "dbt"
pytestmark = pytest.mark.integration


def _step(run_id: str, step: int, cost_usd: float, tokens: int) -> events.StepEvent:
    return events.StepEvent(
        run_id=run_id, step=step, train_loss=2.0, learning_rate=1e-3, grad_norm=1.0,
        grad_noise_scale=float("nan"), micro_batch_size=8, grad_accum_steps=1,
        step_time_ms=100.0, samples_seen=8 * step, tokens_seen=tokens, elapsed_s=0.1 * step,
        cost_usd=cost_usd)


def _dbt_build(tmp_path: Path, db: Path) -> None:
    env = {**os.environ, "TRAINWISE_DUCKDB_PATH": str(db)}
    dbt = Path(sys.executable).parent / "dbt"
    result = subprocess.run(
        [str(dbt), "build", "--project-dir", str(DBT_DIR), "--profiles-dir", str(DBT_DIR),
         "--target-path", str(tmp_path / "target"), "--log-path", str(tmp_path / "logs")],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]


def _run_start(run_id: str) -> events.RunStartEvent:
    return events.RunStartEvent(
        run_id=run_id, step=0, model_kind="gpt", model_config={}, model_fingerprint="f",
        train_config={}, data_fingerprint="d", curriculum_version=None, instance_type="x",
        price_usd_per_hour=3.6)


def test_dbt_build_computes_cost_per_token_and_replays_as_preemption_waste(tmp_path):
    telemetry_dir = tmp_path / "telemetry"
    with SegmentWriter(telemetry_dir, "run-a") as writer:
        writer.write(_step("run-a", 1, 0.5, 1_000_000))
        writer.write(_step("run-a", 2, 1.0, 2_000_000))
        writer.write(events.CheckpointEvent(run_id="run-a", step=2, path="x", sha256="0",
                                            size_bytes=1, save_ms=50.0, reason="final"))
    db = tmp_path / "t.duckdb"
    assert store.ingest(telemetry_dir / "run-a", db) == 3
    # run-b: killed after step 3 with its checkpoint at step 1; the resume replays steps 2-3.
    with SegmentWriter(telemetry_dir, "run-b") as writer:
        writer.write(_run_start("run-b"))
        for step in (1, 2, 3):
            writer.write(_step("run-b", step, 0.1 * step, 1000 * step))
    with SegmentWriter(telemetry_dir, "run-b") as writer:
        writer.write(_run_start("run-b"))
        for step in (2, 3, 4):
            writer.write(_step("run-b", step, 0.1 * (step + 2), 1000 * step))
    assert store.ingest(telemetry_dir / "run-b", db) == 8
    # Another run that reused the id run-a (another state folder): a row of its own.
    with SegmentWriter(tmp_path / "other", "run-a") as writer:
        writer.write(_step("run-a", 1, 0.25, 500_000))
    assert store.ingest(tmp_path / "other" / "run-a", db) == 1
    _dbt_build(tmp_path, db)
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("select steps, tokens_seen, cost_usd, usd_per_million_tokens "
                           "from cost_per_token where run_id = 'run-a' order by steps").fetchall()
        waste = con.execute("select checkpoint_s, step_s from waste_breakdown "
                            "where run_id = 'run-a' and checkpoint_s > 0").fetchone()
        resumed = con.execute(
            "select steps, tokens_seen, replayed_steps, replay_s, preemption_waste_usd "
            "from cost_per_token where run_id = 'run-b'").fetchone()
        resumed_waste = con.execute(
            "select step_s, preemption_s, replayed_steps, preemption_share from waste_breakdown "
            "where run_id = 'run-b'").fetchone()
    assert rows == [(1, 500_000, 0.25, pytest.approx(0.5)), (2, 2_000_000, 1.0, pytest.approx(0.5))]
    assert waste == (pytest.approx(0.05), pytest.approx(0.2))
    # 4 new steps of 0.1 s train; the 2 replayed ones are waste, priced at 3.6 $/h.
    assert resumed == (4, 4000, 2, pytest.approx(0.2), pytest.approx(0.2 * 3.6 / 3600))
    assert resumed_waste == (pytest.approx(0.4), pytest.approx(0.2), 2, pytest.approx(1 / 3))
