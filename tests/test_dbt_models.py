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


def test_dbt_build_computes_cost_per_token(tmp_path):
    telemetry_dir = tmp_path / "telemetry"
    with SegmentWriter(telemetry_dir, "run-a") as writer:
        writer.write(_step("run-a", 1, 0.5, 1_000_000))
        writer.write(_step("run-a", 2, 1.0, 2_000_000))
        writer.write(events.CheckpointEvent(run_id="run-a", step=2, path="x", sha256="0",
                                            size_bytes=1, save_ms=50.0, reason="final"))
    db = tmp_path / "t.duckdb"
    assert store.ingest(telemetry_dir / "run-a", db) == 3
    env = {**os.environ, "TRAINWISE_DUCKDB_PATH": str(db)}
    dbt = Path(sys.executable).parent / "dbt"
    result = subprocess.run(
        [str(dbt), "build", "--project-dir", str(DBT_DIR), "--profiles-dir", str(DBT_DIR),
         "--target-path", str(tmp_path / "target"), "--log-path", str(tmp_path / "logs")],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    with duckdb.connect(str(db), read_only=True) as con:
        row = con.execute("select steps, tokens_seen, cost_usd, usd_per_million_tokens "
                          "from cost_per_token where run_id = 'run-a'").fetchone()
        waste = con.execute("select checkpoint_s, step_s from waste_breakdown").fetchone()
    assert row == (2, 2_000_000, 1.0, pytest.approx(0.5))
    assert waste == (pytest.approx(0.05), pytest.approx(0.2))
