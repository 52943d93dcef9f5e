"""The exporter scraped by a real Prometheus server (Debian's `prometheus`) on loopback.

A two-rank run's telemetry (with the provider's bill) is written with the project's writer and a
tiny real run trains
through training.loop (8 steps, one torch thread); `python -m telemetry.prometheus`
(what `make metrics` runs) serves it; Prometheus scrapes it every 0.5 s and answers PromQL for
the cost, waste and per-rank figures. Then every query of dashboards/trainwise.json (panel
targets and template variables) is run against the same server and must return data.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from telemetry.events import (
    BillEvent,
    CheckpointEvent,
    DecisionEvent,
    EvalEvent,
    PreemptionEvent,
    RunEndEvent,
    RunStartEvent,
    StepEvent,
)
from telemetry.reader import read_run_events
from telemetry.writer import SegmentWriter
from tests.servers import free_port, start, stop, wait_http

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "trainwise.json"
RUN_ID = "run-prom-int"
# A run whose run_end (written after the final eval and checkpoint) costs more than its last step.
END_RUN_ID = "run-prom-end"
REAL_RUN_ID = "real-tiny"  # a real (tiny) training run through training.loop
PARTITION = "pystdlib"
T0_S = time.time() - 60.0  # recent wall times, as a live run writes them


def _step(run_id: str, step: int, rank: int, share: float, compute_ms: float,
          wait_ms: float) -> StepEvent:
    return StepEvent(
        run_id=run_id, rank=rank, step=step, wall_time_s=T0_S + step + rank / 10,
        train_loss=4.0 / step, learning_rate=1e-3, grad_norm=0.5, grad_noise_scale=1.0,
        micro_batch_size=8, grad_accum_steps=2, step_time_ms=compute_ms + wait_ms,
        samples_seen=16 * step, tokens_seen=1024 * step, elapsed_s=float(step),
        cost_usd=0.01 * step, world_size=2, share=share, compute_ms=compute_ms,
        allreduce_wait_ms=wait_ms)


def _write_two_rank_run(runs_root: Path, run_id: str, end_cost_usd: float,
                        bill_usd: float) -> dict[str, float]:
    """Writes the run; returns the figures the telemetry says, to compare with PromQL."""
    run_folder = runs_root / run_id
    run_folder.mkdir(parents=True)
    (run_folder / "request.json").write_text(json.dumps({"partition": PARTITION}))
    writers = [SegmentWriter(run_folder / "telemetry", run_id, rank=r, events_per_segment=5)
               for r in (0, 1)]
    writers[0].write(RunStartEvent(
        run_id=run_id, step=0, wall_time_s=T0_S, model_kind="gpt", model_config={},
        model_fingerprint="m", train_config={}, data_fingerprint="d", curriculum_version=None,
        instance_type="g5.xlarge", price_usd_per_hour=1.0))
    for step in (1, 2, 3):  # rank 1 is the straggler: rank 0 waits for it at the all-reduce
        writers[0].write(_step(run_id, step, 0, 0.5, compute_ms=300.0, wait_ms=100.0))
        writers[1].write(_step(run_id, step, 1, 0.5, compute_ms=400.0, wait_ms=0.0))
    writers[0].write(DecisionEvent(
        run_id=run_id, step=3, wall_time_s=T0_S + 3.5, layer="fast", policy="heuristic",
        action={"rank_work_shares": [0.6, 0.4]}, reason="straggler rank 1",
        numbers={"wait_ms": 100.0}, observation={}))
    writers[0].write(_step(run_id, 4, 0, 0.6, compute_ms=350.0, wait_ms=20.0))
    writers[1].write(_step(run_id, 4, 1, 0.4, compute_ms=330.0, wait_ms=40.0))
    writers[0].write(EvalEvent(run_id=run_id, step=4, wall_time_s=T0_S + 4.5, eval_loss=1.25,
                               eval_accuracy=None, eval_examples=32, eval_ms=2.0))
    writers[0].write(PreemptionEvent(
        run_id=run_id, step=4, wall_time_s=T0_S + 4.6, signal_name="SIGTERM", notice_s=120.0,
        received_wall_time_s=T0_S + 4.6, response="checkpoint_and_exit"))
    writers[0].write(CheckpointEvent(
        run_id=run_id, step=4, wall_time_s=T0_S + 4.7, path="c.pt", sha256="0" * 64,
        size_bytes=10, save_ms=5.0, reason="preemption"))
    writers[0].write(RunEndEvent(
        run_id=run_id, step=4, wall_time_s=T0_S + 5.0, status="completed", elapsed_s=5.0,
        cost_usd=end_cost_usd, samples_seen=64, tokens_seen=4096, final_eval_loss=1.25,
        final_eval_accuracy=None, checkpoint_path="c.pt", checkpoint_sha256="0" * 64))
    # The provider's bill (the holder of the nodes writes it under rank 1000): the run's cost.
    provider = SegmentWriter(run_folder / "telemetry", run_id, rank=1000)
    for wall_s, usd, final in ((T0_S + 2.0, bill_usd / 2, False), (T0_S + 5.5, bill_usd, True)):
        provider.write(BillEvent(run_id=run_id, rank=1000, step=4, wall_time_s=wall_s,
                                 bill_usd=usd, provider="emulated", provider_time_s=3600.0,
                                 spot_share=0.5, nodes_held=0 if final else 2, final=final))
    writers.append(provider)
    for writer in writers:
        writer.close()
    return {"cost_usd": bill_usd, "compute_estimate_usd": end_cost_usd, "tokens": 4096,
            "eval_loss": 1.25, "train_loss": 1.0,
            "preemptions": 1, "rank0_step_s": 0.37, "rank1_step_s": 0.37,
            "rank0_wait_s": 0.02, "rank1_wait_s": 0.04, "rank0_share": 0.6, "rank1_share": 0.4}


def _train_tiny_run(out_dir: Path):
    import torch

    from tests.test_training_loop import text_examples, tiny_config
    from training.loop import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared CI machine; the run is a few ms per step anyway
    try:
        return train(tiny_config(max_steps=8, run_id=REAL_RUN_ID), text_examples(), None, out_dir)
    finally:
        torch.set_num_threads(threads)


def _api(port: int, path: str, **params: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:  # a bad query answers 400 with the parser's error
        body = json.load(error)
    assert body["status"] == "success", f"{path} {params}: {body.get('error')}"
    return body["data"]


def _query(port: int, expr: str) -> list[dict]:
    data = _api(port, "query", query=expr)
    assert data["resultType"] == "vector", f"{expr}: result type {data['resultType']}"
    return data["result"]


def _by(port: int, expr: str, label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in _query(port, expr)}


def _wait_for_scrapes(port: int, scrapes: int, timeout_s: float = 30.0) -> None:
    """Until the target is up and `scrapes` scrapes are stored (rate() needs two)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        targets = _api(port, "targets")["activeTargets"]
        up = [t for t in targets if t["health"] == "up"]
        stored = _query(port, 'count_over_time(up{job="trainwise"}[5m])') if up else []
        if stored and float(stored[0]["value"][1]) >= scrapes:
            return
        time.sleep(0.3)
    raise TimeoutError(f"Prometheus did not scrape the exporter {scrapes} times in {timeout_s} s: "
                       f"targets {targets}")


@pytest.fixture(scope="module")  # one exporter and one Prometheus for the module's tests
def prometheus_server(tmp_path_factory: pytest.TempPathFactory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the `prometheus` binary is missing: `apt-get install prometheus` (Debian); "
                    "`make test` installs it when run as root")
    tmp_path = tmp_path_factory.mktemp("prometheus")
    runs_root = tmp_path / "runs"
    expected = _write_two_rank_run(runs_root, RUN_ID, end_cost_usd=0.04,  # = its last step's
                                   bill_usd=1.75)
    _write_two_rank_run(runs_root, END_RUN_ID, end_cost_usd=0.045, bill_usd=2.0)
    real = _train_tiny_run(runs_root / REAL_RUN_ID)
    exporter_port, prometheus_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 500ms, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: trainwise\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{exporter_port}']}}]\n")
    exporter = start([sys.executable, "-m", "telemetry.prometheus", "--runs-root", str(runs_root),
                      "--port", str(exporter_port)], tmp_path / "exporter.log",
                     cwd=Path(__file__).resolve().parents[1])
    prometheus = None
    try:
        wait_http(f"http://127.0.0.1:{exporter_port}/metrics", exporter, tmp_path / "exporter.log",
                  timeout_s=30)
        prometheus = start([binary, f"--config.file={config}",
                            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                            f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                           tmp_path / "prometheus.log")
        wait_http(f"http://127.0.0.1:{prometheus_port}/-/ready", prometheus,
                  tmp_path / "prometheus.log", timeout_s=30)
        _wait_for_scrapes(prometheus_port, scrapes=2)
        yield prometheus_port, {**expected, "real": real}
    finally:
        for process in (prometheus, exporter):
            if process is not None:
                stop(process)


def test_promql_answers_cost_waste_and_rank_figures(prometheus_server):
    port, expected = prometheus_server
    sel = f'run_id="{RUN_ID}", partition="{PARTITION}"'
    assert _by(port, f"trainwise_cost_usd{{{sel}}}", "run_id") == {
        RUN_ID: pytest.approx(expected["cost_usd"])}  # the bill, not the trainer's estimate
    assert _by(port, f"trainwise_compute_estimate_usd{{{sel}}}", "run_id") == {
        RUN_ID: pytest.approx(expected["compute_estimate_usd"])}
    assert _by(port, f"trainwise_tokens_seen_total{{{sel}}}", "run_id")[RUN_ID] == expected["tokens"]
    assert _by(port, f"trainwise_eval_loss{{{sel}}}", "run_id")[RUN_ID] == expected["eval_loss"]
    assert _by(port, f"trainwise_train_loss{{{sel}}}", "run_id")[RUN_ID] == expected["train_loss"]
    assert _by(port, f"trainwise_run_finished{{{sel}}}", "run_id")[RUN_ID] == 1
    # Waste: the preemption and the checkpoint it forced.
    assert _by(port, f"trainwise_preemptions_total{{{sel}}}", "run_id")[RUN_ID] == 1
    assert _by(port, f"trainwise_checkpoints_total{{{sel}}}", "reason") == {"preemption": 1}
    # Per rank, after the fast decision moved work from the straggler (rank 1) to rank 0.
    step_s = _by(port, f"trainwise_rank_step_time_seconds{{{sel}}}", "rank")
    assert step_s == {"0": pytest.approx(expected["rank0_step_s"]),
                      "1": pytest.approx(expected["rank1_step_s"])}
    wait_s = _by(port, f"trainwise_rank_allreduce_wait_seconds{{{sel}}}", "rank")
    assert wait_s == {"0": pytest.approx(expected["rank0_wait_s"]),
                      "1": pytest.approx(expected["rank1_wait_s"])}
    assert _by(port, f"trainwise_rank_share{{{sel}}}", "rank") == {
        "0": pytest.approx(expected["rank0_share"]), "1": pytest.approx(expected["rank1_share"])}
    moved = _query(port, f"trainwise_rank_rebalances_total{{{sel}}}")
    assert {(r["metric"]["rank"], r["metric"]["direction"]): float(r["value"][1])
            for r in moved} == {("0", "up"): 1, ("1", "down"): 1}
    # An aggregate across ranks, as a dashboard would ask it.
    assert _by(port, f"sum by (run_id) (trainwise_rank_share{{{sel}}})", "run_id") == {
        RUN_ID: pytest.approx(1.0)}


def test_a_real_training_run_reads_the_same_in_promql_as_in_its_telemetry(prometheus_server):
    port, expected = prometheus_server
    result = expected["real"]
    records = read_run_events(result.telemetry_dir)
    (end,) = [r for r in records if r["type"] == "run_end"]
    last_eval = max((r for r in records if r["type"] == "eval"), key=lambda r: r["wall_time_s"])
    sel = f'run_id="{REAL_RUN_ID}", partition=""'
    assert result.status == "completed" and result.steps == 8
    # The trainer alone (no provider holds its nodes): its estimate, and no bill made up.
    assert _by(port, f"trainwise_compute_estimate_usd{{{sel}}}", "run_id") == {
        REAL_RUN_ID: pytest.approx(end["cost_usd"])}
    assert _by(port, f"trainwise_cost_usd{{{sel}}}", "run_id") == {}
    assert end["cost_usd"] == pytest.approx(result.cost_usd) and result.cost_usd > 0
    assert _by(port, f"trainwise_tokens_seen_total{{{sel}}}", "run_id")[REAL_RUN_ID] == \
        result.tokens_seen
    assert _by(port, f"trainwise_step{{{sel}}}", "run_id")[REAL_RUN_ID] == 8
    assert _by(port, f"trainwise_eval_loss{{{sel}}}", "run_id")[REAL_RUN_ID] == pytest.approx(
        last_eval["eval_loss"])
    assert _by(port, f"trainwise_rank_step_time_seconds{{{sel}}}", "rank") == {
        "0": pytest.approx(max((r for r in records if r["type"] == "step"),
                               key=lambda r: r["wall_time_s"])["step_time_ms"] / 1000)}
    assert _by(port, f"trainwise_run_finished{{{sel}}}", "run_id")[REAL_RUN_ID] == 1


def _dashboard_queries() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(panel title + refId, expr) of every panel target, and (variable, query) of templating."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    targets = [(f"{panel['title']} {target['refId']}", target["expr"])
               for panel in dashboard["panels"] for target in panel.get("targets", [])]
    variables = [(v["name"], v["query"]["query"]) for v in dashboard["templating"]["list"]
                 if v["type"] == "query"]
    return targets, variables


def test_every_dashboard_query_parses_and_returns_data(prometheus_server):
    port, _ = prometheus_server
    targets, variables = _dashboard_queries()
    assert len(targets) >= 10 and variables, f"{DASHBOARD} lost its panels or variables"
    names = {name for _, expr in targets for name in expr.replace("(", " ").split()
             if name.startswith("trainwise_")}
    exported = set(_api(port, "label/__name__/values"))
    for name in names:  # a renamed metric in the exporter must fail here, by name
        base = name.split("{")[0]
        assert base in exported, f"dashboard uses {base}; the exporter exports {sorted(exported)}"
    for where, expr in targets:
        # Grafana fills the template variables; here with the run the test wrote.
        promql = expr.replace("$run_id", RUN_ID).replace("$partition", PARTITION)
        assert _query(port, promql), f"{DASHBOARD.name} panel '{where}': no data for {promql}"
    for name, query in variables:
        # Grafana's label_values(selector, label): the label's values among matching series.
        inner = query[len("label_values("):-1]
        selector, label = (part.strip() for part in inner.rsplit(",", 1))
        selector = selector.replace("$partition", PARTITION)
        values = _api(port, f"label/{label}/values", **{"match[]": selector})
        assert values, f"{DASHBOARD.name} variable {name}: {query} found no {label} values"


def test_run_end_cost_is_not_overwritten_by_an_earlier_step_of_another_rank(prometheus_server):
    port, _ = prometheus_server
    cost = _by(port, f'trainwise_compute_estimate_usd{{run_id="{END_RUN_ID}"}}', "run_id")
    assert cost == {END_RUN_ID: pytest.approx(0.045)}
