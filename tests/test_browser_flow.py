"""The governance flow in a real browser (issue 13, item 8): Chromium (Debian's package) driven
by Playwright against the Dagster webserver and daemon that `make ui` starts.

One UI for the module, steps in order, as a person does them: see the asset graph; launch
`demo` for a partition from the Launchpad and see it succeed; launch `forecast` and see that
partition's job forecast (P50/P90 USD and hours from the demo run's throughput) and its budget
check pass before any launch; open that run in the MLflow UI
(`mlflow server` over the sqlite store the UI's runs wrote) with its eval loss and cost; see its
cost in Prometheus's own graph page (Debian's `prometheus` scraping `telemetry.prometheus`);
propose a schedule change and see its blocking gate `schedule_approved` fail (no approval);
approve the proposal's hash by launching `schedule_approve` (the `approvals` asset) with run
config and see the gate pass and the change go live; launch the next run and see it start on the
approved schedule (its run tag, every decision's version); roll the schedule back through the
same gate (blocked, approved, the previous version in force); publish a second curriculum and roll back
to the first through `curriculum_rollback`; with two fast-policy champions staged by hand (no
PPO), roll the region back to the first through `champion_rollback` and see its gate pass.
Each step leaves a screenshot under test-artifacts/browser/.

Runs are kept small (4 training steps, the embedded-size forecast) so the module runs in
`make test`: about 5 minutes on two busy cores, most of it each run's process importing the
code location. The code location's executor is in-process (pipelines/definitions.py), so the run
configs below are what a person types: no executor setting.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import sys
import time
import types
import urllib.parse
import urllib.request

import pytest
from mlflow.tracking import MlflowClient

from tests import browser_support as bs
from tests import servers
from training import curriculum as curriculum_lib
from trainwise import approvals

pytestmark = pytest.mark.integration

PARTITION = "pystdlib"
NEW_POLICY = "skypilot_failover"
# Small and fast: the embedded-size forecast (as tests/test_approvals.py) and an allocation-only
# change (its eval-loss change is 0 by construction) whose savings clear the minimum.
# The daemon's sensor ticks every 10 s here (300 s by default), so a live switch is seen in minutes.
UI_ENV = {"TRAINWISE_SENSOR_INTERVAL_S": "10",
          "TRAINWISE_FORECAST_WORK_GPU_H": "2", "TRAINWISE_FORECAST_DEADLINE_H": "4",
          "TRAINWISE_FORECAST_SAMPLES": "4", "TRAINWISE_MIN_FORECAST_SAVINGS_USD": "-1000"}
RUN_TIMEOUT_S = 600
HASH = re.compile(r"proposal ([0-9a-f]{16}) blocked")
PUBLISHED_VERSION = re.compile(r"candidate ([0-9a-f]{12}) published")
REGION = "us-west-2"


@contextlib.contextmanager
def _ui_settings(state):
    """This process sees the settings the UI's runs see (its TRAINWISE_HOME, MLflow sqlite)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINWISE_HOME", str(state))
        patch.setenv("TRAINWISE_MLFLOW_URI", "")
        patch.delenv("TRAINWISE_POSTGRES_URL", raising=False)
        yield


def _wait_for_series(port: int, query: str, timeout_s: float = 30.0) -> None:
    """Until Prometheus has scraped the series (the page runs its query once, on load)."""
    deadline = time.monotonic() + timeout_s
    api = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    while time.monotonic() < deadline:
        with urllib.request.urlopen(api, timeout=10) as response:
            if json.loads(response.read())["data"]["result"]:
                return
        time.sleep(0.5)
    raise TimeoutError(f"Prometheus has no {query} after {timeout_s:.0f} s: is the run's "
                       "telemetry under the exporter's --runs-root?")


@pytest.fixture(scope="module")
def browser_ui(tmp_path_factory):
    """(page, url, state folder, shared dict of what earlier steps saw); one UI, one browser."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (pip install playwright)")
    bs.chromium_path()
    root = tmp_path_factory.mktemp("browser_ui")
    url, processes, env = bs.start_ui(root, UI_ENV)
    mlflow_server = None
    playwright = sync_api.sync_playwright().start()
    try:
        # The MLflow UI over the store the UI's runs write, started now so that its slow start
        # (half a minute of imports) overlaps the first steps. The store is created here first:
        # the server and the demo run must not both create its tables at once.
        with _ui_settings(root / "state"):
            from trainwise import settings

            tracking_uri = settings.mlflow_uri()
        MlflowClient(tracking_uri=tracking_uri).search_experiments()
        port = servers.free_port()
        mlflow_server = servers.start(
            [str(servers.VENV_BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port",
             str(port), "--workers", "1", "--backend-store-uri", tracking_uri],
            root / "mlflow-server.log", cwd=bs.ui.PROJECT_ROOT)
        seen = {"mlflow": (mlflow_server, f"http://127.0.0.1:{port}", tracking_uri,
                           root / "mlflow-server.log")}
        browser = bs.launch(playwright)
        page = bs.new_page(browser)
        yield page, url, root / "state", seen
        browser.close()
    finally:
        playwright.stop()
        if mlflow_server is not None:
            servers.stop(mlflow_server)
        bs.ui.stop(processes)


def _needs(seen: dict, key: str, step: str):
    if key not in seen:
        pytest.fail(f"the step '{step}' did not pass earlier in this module; run the whole "
                    "module (tests/test_browser_flow.py), the steps build on each other")
    return seen[key]


def _run(page, url, state, job, config, expected, partition=None, shot=""):
    """Launch from the Launchpad, wait for the end; a run that ends otherwise than `expected`
    fails here with its run page saved and the daemon log named."""
    run_id = bs.launch_from_launchpad(page, url, job, config, partition, shot=f"{shot}-launchpad")
    status = bs.wait_for_run(page, url, run_id, RUN_TIMEOUT_S)
    if status != expected:
        bs.screenshot(page, f"{shot}-unexpected-{status}")
        pytest.fail(f"{job} run {run_id} ended {status}, expected {expected}; see its run page "
                    f"screenshot and {state.parent}/daemon.log")
    return run_id


@pytest.mark.timeout(600)
def test_ui_shows_the_asset_graph(browser_ui):
    page, url, _, _ = browser_ui
    for group, names in (("data", ("data_shards", "difficulty_scores", "curriculum",
                                   "checkpoint")),
                         ("governance", ("schedule_change", "approvals"))):
        page.goto(f"{url}/locations/{bs.LOCATION}/asset-groups/{group}")
        try:
            for name in names:
                page.get_by_text(name, exact=True).filter(visible=True).first.wait_for()
        finally:
            bs.screenshot(page, f"01-asset-graph-{group}")


@pytest.mark.timeout(900)
def test_demo_launched_for_a_partition_from_the_launchpad_succeeds(browser_ui):
    page, url, state, seen = browser_ui
    config = ("ops:\n  checkpoint:\n    config:\n      max_steps: 4\n"
              "      eval_every_steps: 2\n  curriculum:\n    config:\n      pruning_rate: 0.0\n")
    run_id = _run(page, url, state, "demo", config, "SUCCESS", PARTITION, shot="02-demo")
    text = bs.run_page_text(page, "RUN_SUCCESS", "02-demo-run")
    assert f"partition: {PARTITION}" in text
    # The curriculum went through its gate and was published before training read it.
    found = PUBLISHED_VERSION.search(text)
    assert found, f"no 'candidate <version> published' on the run page of {run_id}"
    seen["first_curriculum"] = found.group(1)
    assert list((state / "objects" / "checkpoints" / PARTITION / run_id).rglob("*.pt"))
    seen["demo_run"] = run_id


@pytest.mark.timeout(900)
def test_the_forecast_of_the_partitions_job_is_shown_before_a_launch(browser_ui):
    page, url, state, seen = browser_ui
    _needs(seen, "demo_run", "demo launched for a partition")
    config = ("ops:\n  cost_forecast:\n    config:\n      log_to_mlflow: false\n"
              "      max_steps: 4\n")
    run_id = _run(page, url, state, "forecast", config, "SUCCESS", shot="02b-forecast")
    bs.run_page_text(page, "Check p90_within_budget succeeded", "02b-forecast-check-passes")
    text = bs.run_page_text(page, f"job {PARTITION}: P50", "02b-forecast-of-the-job")
    # Sized from the demo run's measured throughput, before anything is launched.
    found = re.search(rf"job {PARTITION}: P50 ([0-9.]+) USD / ([0-9.]+) h, P90 ([0-9.]+) USD",
                      text)
    assert found, f"no forecast of the {PARTITION} job on the run page of {run_id}"
    saved = json.loads((state / "forecast" / "cost_forecast.json").read_text())
    [job] = [r for r in saved["jobs"] if r["partition"] == PARTITION]
    assert f"{job['p90_usd']:.2f}" == found.group(3) and job["p90_usd"] <= saved["budget_usd"]
    assert "runs" in job["throughput_source"] and seen["demo_run"] in job["throughput_source"]


@pytest.mark.timeout(300)
def test_mlflow_ui_shows_the_demo_run_with_its_eval_loss_and_cost(browser_ui):
    page, _, state, seen = browser_ui
    run_id = _needs(seen, "demo_run", "demo launched for a partition")
    server, server_url, tracking_uri, log = seen["mlflow"]
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("trainwise")
    assert experiment, f"no 'trainwise' experiment in {tracking_uri} after the demo run"
    [run] = client.search_runs([experiment.experiment_id],
                               filter_string=f"tags.dagster_run_id = '{run_id}'")
    metrics = run.data.metrics
    assert {"losses/eval", "cost/usd", "final/cost_usd"} <= set(metrics), sorted(metrics)
    seen["final_cost_usd"] = metrics["final/cost_usd"]
    servers.wait_http(f"{server_url}/health", server, log, timeout_s=180)
    text = bs.page_text_once(
        page, f"{server_url}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}",
        "losses/eval", "06-mlflow-demo-run")
    assert run.info.run_name in text and "Finished" in text
    for name in ("losses/eval", "cost/usd", "final/cost_usd"):
        assert name in text, f"metric {name} is not on the MLflow run page"
    # The metrics table, in view for the screenshot, with the values the run logged.
    for name in ("losses/eval", "final/cost_usd"):
        row = page.get_by_role("row", name=name).first  # "<name>\n<value>"
        row.scroll_into_view_if_needed()
        shown = row.inner_text().split()
        assert shown[0] == name and float(shown[-1]) == pytest.approx(metrics[name]), (
            f"{name} on the MLflow page: {shown}, logged {metrics[name]}")
    bs.screenshot(page, "06-mlflow-demo-metrics")


@pytest.mark.timeout(300)
def test_prometheus_ui_shows_the_demo_run_cost_scraped_from_the_exporter(browser_ui, tmp_path):
    page, _, state, seen = browser_ui
    run_id = _needs(seen, "demo_run", "demo launched for a partition")
    final_cost_usd = _needs(seen, "final_cost_usd", "MLflow UI shows the demo run")
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the `prometheus` binary is missing: `apt-get install prometheus` (Debian); "
                    "`make test` installs it when run as root")
    exporter_port, prometheus_port = servers.free_port(), servers.free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 500ms, evaluation_interval: 1s}\n"
        "scrape_configs:\n  - job_name: trainwise\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{exporter_port}']}}]\n")
    started = []
    try:
        started.append(bs.start_server(
            [sys.executable, "-m", "telemetry.prometheus", "--runs-root", str(state / "runs"),
             "--port", str(exporter_port)], tmp_path / "exporter.log",
            f"http://127.0.0.1:{exporter_port}/metrics"))
        started.append(bs.start_server(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prometheus_port}"], tmp_path / "prometheus.log",
            f"http://127.0.0.1:{prometheus_port}/-/ready"))
        query = f'trainwise_cost_usd{{run_id="{run_id}"}}'
        _wait_for_series(prometheus_port, query)
        text = bs.page_text_once(
            page, f"http://127.0.0.1:{prometheus_port}/graph?"
                  + urllib.parse.urlencode({"g0.expr": query, "g0.tab": "1"}),
            f'run_id="{run_id}"', "07-prometheus-demo-cost")
        row = page.locator("tr", has_text=f'run_id="{run_id}"').first.inner_text()
    finally:
        for process in reversed(started):
            servers.stop(process)
    assert "trainwise_cost_usd" in text and f'partition="{PARTITION}"' in row
    assert float(row.split()[-1]) == pytest.approx(final_cost_usd, rel=1e-6), row


@pytest.mark.timeout(900)
def test_unapproved_schedule_change_is_blocked_by_its_gate(browser_ui):
    page, url, state, seen = browser_ui
    config = (f"ops:\n  schedule_change:\n    config:\n"
              f"      allocation_policy: {NEW_POLICY}\n      reason: cheaper failover\n")
    run_id = _run(page, url, state, "schedule_propose", config, "FAILURE", shot="03-propose")
    text = bs.run_page_text(page, "Check schedule_approved failed", "03-propose-gate-blocks")
    found = HASH.search(text)
    assert found, f"the gate's 'proposal <hash> blocked' is not on the run page of {run_id}"
    assert f"no approval of {found.group(1)}" in text
    schedule = approvals.current_schedule(state / "governance" / "schedule")
    assert schedule["allocation_policy"] != NEW_POLICY  # nothing went live
    seen["proposal_hash"] = found.group(1)


@pytest.mark.timeout(900)
def test_approval_from_the_launchpad_passes_the_gate_and_the_change_goes_live(browser_ui):
    page, url, state, seen = browser_ui
    content_hash = _needs(seen, "proposal_hash", "unapproved schedule change is blocked")
    config = ("ops:\n  approvals:\n    config:\n      approver: ada\n"
              f"      content_hash: '{content_hash}'\n      comment: failover is cheaper\n")
    _run(page, url, state, "schedule_approve", config, "SUCCESS", shot="04-approve")
    text = bs.run_page_text(page, "Check schedule_approved succeeded",
                            "04-approve-gate-passes")
    assert f"proposal {content_hash} published" in text
    folder = state / "governance" / "schedule"
    assert approvals.current_schedule(folder)["allocation_policy"] == NEW_POLICY
    published = approvals.history(folder)[-1]
    assert published["event"] == "published" and published["approval"]["approver"] == "ada"


RUN_TAGS = "query($runId: ID!) { runOrError(runId: $runId) { ... on Run { tags { key value } } } }"


@pytest.mark.timeout(900)
def test_the_next_run_launched_from_the_launchpad_starts_on_the_approved_schedule(browser_ui):
    page, url, state, seen = browser_ui
    _needs(seen, "proposal_hash", "approval passes the gate and the change goes live")
    from trainwise import schedule as schedule_lib

    version = schedule_lib.version_of(approvals.current_schedule(state / "governance" /
                                                                 "schedule"))
    config = ("ops:\n  checkpoint:\n    config:\n      max_steps: 4\n"
              "      eval_every_steps: 2\n")
    run_id = _run(page, url, state, "demo", config, "SUCCESS", PARTITION, shot="04b-next-run")
    bs.run_page_text(page, "RUN_SUCCESS", "04b-next-run-page")
    tags = {t["key"]: t["value"] for t in bs.graphql(url, RUN_TAGS, {"runId": run_id})[
        "runOrError"]["tags"]}
    assert tags.get("trainwise/schedule_version") == version, tags
    # Every decision the run recorded names the schedule it was made under.
    from telemetry.reader import read_run_events

    run_dirs = [p.parent for p in (state / "runs").glob("*/request.json")
                if json.loads(p.read_text()).get("schedule_version") == version]
    assert run_dirs, f"no run folder under {state / 'runs'} started on schedule {version}"
    decisions = [e for e in read_run_events(run_dirs[0] / "telemetry" / run_dirs[0].name)
                 if e["type"] == "decision"]
    assert decisions and {d["schedule_version"] for d in decisions} == {version}
    seen["approved_version"] = version


@pytest.mark.timeout(900)
def test_a_published_schedule_is_rolled_back_through_the_same_gate(browser_ui):
    page, url, state, seen = browser_ui
    approved = _needs(seen, "approved_version", "the next run starts on the approved schedule")
    folder = state / "governance" / "schedule"
    from trainwise import schedule as schedule_lib

    before = [v for v in approvals.published_versions(folder) if v["version"] != approved]
    assert before, "the schedule in force before the approval is not among the published ones"
    config = ("ops:\n  schedule_change:\n    config:\n      rollback_to: previous\n"
              "      reason: failover cost more than forecast\n")
    run_id = _run(page, url, state, "schedule_propose", config, "FAILURE", shot="04c-rollback")
    text = bs.run_page_text(page, "Check schedule_approved failed", "04c-rollback-blocked")
    found = HASH.search(text)
    assert found, f"the gate's 'proposal <hash> blocked' is not on the run page of {run_id}"
    assert schedule_lib.version_of(approvals.current_schedule(folder)) == approved  # not yet
    config = ("ops:\n  approvals:\n    config:\n      approver: ada\n"
              f"      content_hash: '{found.group(1)}'\n      comment: back to the last one\n")
    _run(page, url, state, "schedule_approve", config, "SUCCESS", shot="04c-rollback-approve")
    text = bs.run_page_text(page, "Check schedule_approved succeeded", "04c-rollback-passes")
    assert f"proposal {found.group(1)} published" in text
    current = approvals.current_schedule(folder)
    assert current["allocation_policy"] != NEW_POLICY
    assert schedule_lib.version_of(current) == before[-1]["version"]
    assert approvals.history(folder)[-1]["approval"]["approver"] == "ada"


@pytest.mark.timeout(900)
def test_curriculum_rollback_from_the_launchpad_restores_the_previous_version(browser_ui):
    page, url, state, seen = browser_ui
    first = _needs(seen, "first_curriculum", "demo launched for a partition")
    refresh = ("ops:\n  curriculum:\n    config:\n      pruning_rate: 0.4\n"
               "      reason: prune more\n")
    _run(page, url, state, "curriculum_refresh", refresh, "SUCCESS", PARTITION, shot="05-refresh")
    text = bs.run_page_text(page, "RUN_SUCCESS", "05-refresh-run")
    second = PUBLISHED_VERSION.search(text).group(1)
    assert second != first
    folder = state / "curricula" / PARTITION
    assert curriculum_lib.current_version(folder) == second

    rollback = (f"ops:\n  curriculum:\n    config:\n      restore_version: "
                f"'{first}'\n      reason: eval loss regressed at 0.4\n      requested_by: ada\n")
    _run(page, url, state, "curriculum_rollback", rollback, "SUCCESS", PARTITION,
         shot="05-rollback")
    text = bs.run_page_text(page, "RUN_SUCCESS", "05-rollback-run")
    assert "candidate (rollback)" in text and f"candidate {first} published" in text
    assert curriculum_lib.current_version(folder) == first
    record = curriculum_lib.read_history(folder)[-1]
    assert record["event"] == "rollback" and record["requested_by"] == "ada"


def _stage_two_fast_champions(state) -> None:
    """fast v1 promoted, then v2 promoted over it, in the UI's state folder and MLflow registry:
    what two retrainings leave (v<N>.npz, gate_v<N>.json, registry versions), written by hand as
    tests/test_policy_rollback.py does (no PPO)."""
    from assets.policies import _gate
    from rl import registry
    from rl.gate import decide, record_decision
    from rl.policy_file import save_policy
    from rl.retrain import policy_dir
    from tests.policy_support import tiny_policy

    with _ui_settings(state):
        folder = policy_dir("fast", REGION)
        for version in (1, 2):
            path = folder / f"v{version}.npz"
            save_policy(tiny_policy("fast", version, REGION, "hand-written"), path)
            incumbent = [{"cell": f"c{i}", "cost": 100.0 + i, "missed": False} for i in range(4)]
            decision = decide([{**row, "cost": row["cost"] * 0.9} for row in incumbent],
                              incumbent)
            record_decision(decision, folder / f"gate_v{version}.json", {"candidate": path.name})
            registry.register_retrained("fast", REGION, {"path": str(path),
                                                         "decision": decision.to_dict()})
            assert _gate("fast", types.SimpleNamespace(partition_key=REGION)).passed
    assert _sha256(folder / "champion.npz") == _sha256(folder / "v2.npz")


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.timeout(900)
def test_policy_rollback_from_the_launchpad_restores_the_previous_champion(browser_ui):
    page, url, state, _ = browser_ui
    _stage_two_fast_champions(state)
    folder = state / "policies" / "fast" / REGION
    config = ("ops:\n  policy_rollback:\n    config:\n      kind: fast\n"
              "      restore_version: 1\n      reason: v2 slowed gang jobs\n"
              "      requested_by: ada\n")
    run_id = _run(page, url, state, "champion_rollback", config, "SUCCESS", REGION,
                  shot="08-policy-rollback")
    text = bs.run_page_text(page, "Check policy_rollback_gate succeeded",
                            "08-policy-rollback-gate-passes")
    assert f"partition: {REGION}" in text, f"run {run_id} is not for partition {REGION}"
    assert "restore_version" in text and "current" in text  # the proposal's metadata
    assert _sha256(folder / "champion.npz") == _sha256(folder / "v1.npz")
    with _ui_settings(state):
        from rl import gate as rl_gate

        record = rl_gate.read_history("fast", REGION)[-1]
    assert record["event"] == "rollback" and (record["from"], record["to"]) == ("v2", "v1")
    assert record["requested_by"] == "ada"


SENSOR = {"repositoryLocationName": bs.LOCATION, "repositoryName": "__repository__",
          "sensorName": "slow_policy_sensor"}
START_SENSOR = """mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) { __typename
  ... on Sensor { id } ... on PythonError { message } } }"""
STOP_SENSOR = """mutation($id: String!) { stopSensor(id: $id) { __typename
  ... on PythonError { message } } }"""
TERMINATE = """mutation($runId: String!) { terminateRun(runId: $runId) { __typename } }"""
STEERED = """query($tag: String!) { runsOrError(filter: {tags: [{key: "trainwise/steered_run",
  value: $tag}]}) { ... on Runs { results { runId jobName } } } }"""


def _fast_decisions(state, run_id: str) -> list[dict]:
    from telemetry.reader import read_run_events

    folder = state / "runs" / run_id / "telemetry" / run_id
    if not folder.is_dir():
        return []
    try:
        return [e for e in read_run_events(folder) if e["type"] == "decision"
                and e["layer"] == "fast"]
    except ValueError:  # a segment being sealed right now: read again on the next poll
        return []


def _poll(predicate, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(2)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.mark.timeout(1200)
def test_an_approved_change_switches_the_running_job_at_the_sensors_next_tick(browser_ui):
    """The daemon's sensor (started after the approval, ticking every 10 s) hands an approved
    schedule to a train run that is still training: its fast decisions switch from the heuristic on the old
    version to noop on the new one, through a recorded apply_run_decision run."""
    page, url, state, _ = browser_ui
    from trainwise import schedule as schedule_lib

    folder = state / "governance" / "schedule"
    before = schedule_lib.version_of(approvals.current_schedule(folder))
    # Long enough to be live through the approval; over the budget, so it says why it may run.
    config = ("ops:\n  checkpoint:\n    config:\n      max_steps: 20000\n"
              "      schedule_override_reason: browser test, a run long enough to switch live\n")
    run_id = bs.launch_from_launchpad(page, url, "train", config, PARTITION, shot="09-live-train")
    sensor_id = ""
    try:
        _poll(lambda: [d for d in _fast_decisions(state, run_id)
                       if d["schedule_version"] == before], "the run's first fast decisions", 300)
        propose = ("ops:\n  schedule_change:\n    config:\n      fast_policy: noop\n"
                   "      reason: the heuristic's batch changes are not paying\n")
        _run(page, url, state, "schedule_propose", propose, "FAILURE", shot="09-live-propose")
        text = bs.run_page_text(page, "Check schedule_approved failed", "09-live-blocked")
        content_hash = HASH.search(text).group(1)
        approve = ("ops:\n  approvals:\n    config:\n      approver: ada\n"
                   f"      content_hash: '{content_hash}'\n      comment: switch it live\n")
        _run(page, url, state, "schedule_approve", approve, "SUCCESS", shot="09-live-approve")
        after = schedule_lib.version_of(approvals.current_schedule(folder))
        assert after != before
        # The sensor starts now, as a daemon restarted after an approval: its first tick hands
        # the change over (one apply_run_decision run, not one per tick before the approval
        # competing with the propose and approve runs for the two cores).
        started = bs.graphql(url, START_SENSOR, {"s": SENSOR})["startSensor"]
        assert started["__typename"] == "Sensor", started
        sensor_id = started["id"]
        switched = _poll(lambda: [d for d in _fast_decisions(state, run_id)
                                  if d["schedule_version"] == after], "the live switch", 420)
        assert {d["policy"] for d in switched} == {"noop"}
        assert bs.graphql(url, bs.STATUS, {"runId": run_id})["runOrError"]["status"] == "STARTED"
        # The hand-over is a recorded run the UI lists, tagged with the run it steered (the
        # sensor's curriculum refreshes for the run carry the tag too).
        steered = bs.graphql(url, STEERED, {"tag": run_id})["runsOrError"]["results"]
        handed = [r for r in steered if r["jobName"] == "apply_run_decision"]
        assert handed, f"no apply_run_decision run tagged with {run_id}: {steered}"
        page.goto(f"{url}/runs/{handed[-1]['runId']}")
        bs.screenshot(page, "09-live-handover-run")
    finally:
        if sensor_id:
            bs.graphql(url, STOP_SENSOR, {"id": sensor_id})
        bs.graphql(url, TERMINATE, {"runId": run_id})
        bs.wait_for_run(page, url, run_id, 120)

