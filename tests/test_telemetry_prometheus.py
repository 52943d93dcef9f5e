"""Prometheus exporter: real HTTP scrapes of a synthetic run, incremental reads, torn lines."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.events import (
    BillEvent,
    CheckpointEvent,
    DecisionEvent,
    EvalEvent,
    PreemptionEvent,
    RunEndEvent,
    RunStartEvent,
    StepEvent,
    to_record,
)
from telemetry.prometheus import TelemetryCollector, serve
from telemetry.writer import SegmentWriter

RUN_ID = "run-prom-1"


def _step(step: int, *, micro_batch_size: int = 8, run_id: str = RUN_ID) -> StepEvent:
    return StepEvent(
        run_id=run_id, step=step, wall_time_s=1000.0 + step, train_loss=4.0 / step,
        learning_rate=1e-3, grad_norm=0.5, grad_noise_scale=float("nan"),
        micro_batch_size=micro_batch_size, grad_accum_steps=1, step_time_ms=250.0 * step,
        samples_seen=8 * step, tokens_seen=512 * step, elapsed_s=float(step),
        cost_usd=0.01 * step,
    )


def _decision(step: int, layer: str) -> DecisionEvent:
    return DecisionEvent(run_id=RUN_ID, step=step, wall_time_s=1000.0 + step, layer=layer,
                         policy="heuristic", action={"micro_batch_size": 16}, reason="test",
                         numbers={"gns": 1.0}, observation={})


def _checkpoint(step: int, reason: str) -> CheckpointEvent:
    return CheckpointEvent(run_id=RUN_ID, step=step, wall_time_s=1000.0 + step, path="c.pt",
                           sha256="0" * 64, size_bytes=10, save_ms=1.0, reason=reason)


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from a real HTTP scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode("utf-8")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"run_id": RUN_ID, "partition": "pystdlib", **labels}.items())))
    assert key in samples, f"{key} not scraped; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    run_folder = tmp_path / "runs" / RUN_ID
    run_folder.mkdir(parents=True)
    (run_folder / "request.json").write_text(json.dumps({"partition": "pystdlib"}))
    return tmp_path / "runs"


@pytest.fixture
def exporter(runs_root: Path):
    server, thread = serve(runs_root, 0)  # port 0: the OS picks a free loopback port
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_scrapes_show_figures_and_read_only_new_lines(runs_root, exporter):
    port = exporter.server_port
    assert exporter.server_address[0] == "127.0.0.1"
    writer = SegmentWriter(runs_root / RUN_ID / "telemetry", RUN_ID, events_per_segment=4)
    writer.write(RunStartEvent(
        run_id=RUN_ID, step=0, wall_time_s=1000.0, model_kind="gpt", model_config={},
        model_fingerprint="m", train_config={}, data_fingerprint="d", curriculum_version=None,
        instance_type="g5.xlarge", price_usd_per_hour=1.0))
    for step in (1, 2, 3):
        writer.write(_step(step))
    writer.write(_decision(3, "fast"))
    writer.write(EvalEvent(run_id=RUN_ID, step=3, wall_time_s=1003.5, eval_loss=1.25,
                           eval_accuracy=None, eval_examples=32, eval_ms=2.0))
    writer.write(_checkpoint(3, "interval"))

    first = _scrape(port)
    assert _value(first, "trainwise_step") == 3
    assert _value(first, "trainwise_train_loss") == pytest.approx(4.0 / 3)
    assert _value(first, "trainwise_eval_loss") == 1.25
    # The trainer's wall time x list price is exported as what it is; with no bill written yet
    # there is no cost sample rather than the estimate passed off as one.
    assert _value(first, "trainwise_compute_estimate_usd") == pytest.approx(0.03)
    assert not any(name == "trainwise_cost_usd" for name, _ in first)
    assert _value(first, "trainwise_tokens_seen_total") == 1536
    assert _value(first, "trainwise_samples_seen_total") == 24
    assert _value(first, "trainwise_step_time_seconds") == pytest.approx(0.75)
    assert _value(first, "trainwise_micro_batch_size") == 8
    assert _value(first, "trainwise_decisions_total", layer="fast") == 1
    assert _value(first, "trainwise_checkpoints_total", reason="interval") == 1
    assert _value(first, "trainwise_preemptions_total") == 0
    assert _value(first, "trainwise_run_finished") == 0
    assert ("trainwise_decisions_total", (("layer", "slow"), ("partition", "pystdlib"),
                                          ("run_id", RUN_ID))) not in first

    # More events, across a segment roll (4 events per segment): only they are read now.
    writer.write(_step(4, micro_batch_size=16))
    writer.write(_decision(4, "fast"))
    writer.write(_decision(4, "slow"))
    writer.write(PreemptionEvent(run_id=RUN_ID, step=4, wall_time_s=1004.2,
                                 signal_name="SIGTERM", notice_s=120.0,
                                 received_wall_time_s=1004.2, response="checkpoint_and_exit"))
    writer.write(_checkpoint(4, "preemption"))
    # The provider's bill, written by the nodes' holder under rank 1000: the run's cost.
    provider = SegmentWriter(runs_root / RUN_ID / "telemetry", RUN_ID, rank=1000)
    for wall_s, usd in ((1004.5, 2.5), (1003.9, 1.0)):  # an older line read later must not win
        provider.write(BillEvent(run_id=RUN_ID, rank=1000, step=4, wall_time_s=wall_s,
                                 bill_usd=usd, provider="emulated", provider_time_s=900.0,
                                 spot_share=0.75, nodes_held=1))
    second = _scrape(port)
    assert _value(second, "trainwise_cost_usd") == pytest.approx(2.5)
    assert _value(second, "trainwise_spot_share") == pytest.approx(0.75)
    assert _value(second, "trainwise_step") == 4
    assert _value(second, "trainwise_micro_batch_size") == 16
    assert _value(second, "trainwise_tokens_seen_total") == 2048
    assert _value(second, "trainwise_decisions_total", layer="fast") == 2
    assert _value(second, "trainwise_decisions_total", layer="slow") == 1
    assert _value(second, "trainwise_checkpoints_total", reason="interval") == 1
    assert _value(second, "trainwise_checkpoints_total", reason="preemption") == 1
    assert _value(second, "trainwise_preemptions_total") == 1
    # A third scrape with nothing new must not count anything twice.
    assert _scrape(port) == second

    writer.write(RunEndEvent(
        run_id=RUN_ID, step=4, wall_time_s=1005.0, status="completed", elapsed_s=5.0,
        cost_usd=0.05, samples_seen=32, tokens_seen=2048, final_eval_loss=1.1,
        final_eval_accuracy=None, checkpoint_path="c.pt", checkpoint_sha256="0" * 64))
    writer.close()
    provider.write(BillEvent(run_id=RUN_ID, rank=1000, step=4, wall_time_s=1005.5, bill_usd=3.25,
                             provider="emulated", provider_time_s=1000.0, spot_share=0.7,
                             nodes_held=0, final=True))
    provider.close()
    final = _scrape(port)
    assert _value(final, "trainwise_run_finished") == 1
    assert _value(final, "trainwise_compute_estimate_usd") == pytest.approx(0.05)
    assert _value(final, "trainwise_cost_usd") == pytest.approx(3.25)  # the final bill
    assert _value(final, "trainwise_decisions_total", layer="fast") == 2


def test_torn_last_line_is_skipped_then_read_once_complete(runs_root, exporter):
    port = exporter.server_port
    writer = SegmentWriter(runs_root / RUN_ID / "telemetry", RUN_ID)
    writer.write(_step(1))
    text = json.dumps(to_record(_step(2)), separators=(",", ":"))
    half = len(text) // 2
    with open(writer.segment_path, "a", encoding="utf-8") as handle:
        handle.write(text[:half])  # a line being written right now
    torn = _scrape(port)
    assert _value(torn, "trainwise_step") == 1
    assert _value(torn, "trainwise_telemetry_bad_lines_total") == 0
    with open(writer.segment_path, "a", encoding="utf-8") as handle:
        handle.write(text[half:] + "\n")
    whole = _scrape(port)
    assert _value(whole, "trainwise_step") == 2
    assert _value(whole, "trainwise_samples_seen_total") == 16
    assert _value(whole, "trainwise_telemetry_bad_lines_total") == 0
    writer.close()


def test_collector_reads_each_byte_once_and_stops_at_sealed_segments(tmp_path):
    # A bare telemetry folder (<telemetry_dir>/<run_id>) also works; partition is then "".
    with SegmentWriter(tmp_path, "bare-run", events_per_segment=2) as writer:
        for step in (1, 2, 3):
            writer.write(_step(step, run_id="bare-run"))
    collector = TelemetryCollector(tmp_path)
    collector.refresh()
    (figures,) = collector._runs.values()
    assert (figures.run_id, figures.partition, figures.step) == ("bare-run", "", 3)
    cursors = sorted(figures.cursors.values(), key=lambda c: c.path.name)
    assert [c.done for c in cursors] == [True, True]
    assert [c.offset_bytes for c in cursors] == [c.path.stat().st_size for c in cursors]
    # A line that is not JSON in a later segment is counted, not raised, and read only once.
    extra = tmp_path / "bare-run" / "rank0" / "segment-00002.jsonl"
    extra.write_text("not json\n")
    collector.refresh()
    collector.refresh()
    assert figures.bad_lines == 1
    samples = {s.name: s.value for family in collector.collect() for s in family.samples
               if s.labels.get("run_id") == "bare-run"}
    assert samples["trainwise_step"] == 3
    assert samples["trainwise_telemetry_bad_lines_total"] == 1


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="port"):
        serve(tmp_path, 70000)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(ValueError, match="runs_root"):
        serve(not_a_folder, 0)


def test_the_schedule_in_force_is_exported_for_joining(runs_root, exporter):
    """The run's request names the schedule it started on; a decision made under a switched
    schedule (trainwise.schedule: every decision carries its version) moves the label."""
    (runs_root / RUN_ID / "request.json").write_text(
        json.dumps({"partition": "pystdlib", "schedule_version": "v-start"}))
    port = exporter.server_port
    writer = SegmentWriter(runs_root / RUN_ID / "telemetry", RUN_ID)
    writer.write(_step(1))
    assert _value(_scrape(port), "trainwise_run_schedule_info", schedule_version="v-start") == 1
    writer.write(DecisionEvent(run_id=RUN_ID, step=1, wall_time_s=1001.5, layer="fast",
                               policy="noop", action={}, reason="switched", numbers={},
                               observation={}, schedule_version="v-next"))
    writer.write(DecisionEvent(run_id=RUN_ID, step=1, wall_time_s=1000.5, layer="fast",
                               policy="noop", action={}, reason="older line, read later",
                               numbers={}, observation={}, schedule_version="v-start"))
    writer.close()
    samples = _scrape(port)
    assert _value(samples, "trainwise_run_schedule_info", schedule_version="v-next") == 1
    assert not [k for k in samples if k[0] == "trainwise_run_schedule_info"
                and ("schedule_version", "v-start") in k[1]]
