"""The real Dagster webserver and daemon on loopback: asset graph, jobs, a launched demo run."""

import time

import pytest

from pipelines import ui
from tests import servers
from tests.browser_support import graphql as _graphql
from trainwise import deployment

pytestmark = pytest.mark.integration

LAUNCH = ui.LAUNCH_RUN
GRAPH = """
{ assetNodes { assetKey { path } dependencyKeys { path } }
  repositoriesOrError { ... on RepositoryConnection { nodes { name location { name }
    jobs { name } } } } }"""
STATUS = """
query Status($runId: ID!) { runOrError(runId: $runId) { __typename ... on Run { status } } }"""


@pytest.fixture(scope="module")
def dagster_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("dagster")
    home = root / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(deployment.instance_yaml(postgres=False))  # as `make ui`
    port = servers.free_port()
    env = {"DAGSTER_HOME": str(home), "TRAINWISE_HOME": str(root / "state"),
           "TRAINWISE_MLFLOW_URI": "", "TRAINWISE_S3_BUCKET": "",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    processes = ui.start("127.0.0.1", port, env=env, log_dir=root)
    url = f"http://127.0.0.1:{port}"
    try:
        ui.wait_until_up(url, timeout_s=180, processes=processes)
        yield url, root
    finally:
        ui.stop(processes)
        assert all(p.poll() is not None for p in processes)


def test_asset_graph_and_jobs_are_served(dagster_url):
    url, _ = dagster_url
    data = _graphql(url, GRAPH)
    edges = {tuple(n["assetKey"]["path"]): {tuple(d["path"]) for d in n["dependencyKeys"]}
             for n in data["assetNodes"]}
    assert edges[("difficulty_scores",)] == {("data_shards",)}
    assert edges[("curriculum",)] == {("difficulty_scores",)}
    assert edges[("checkpoint",)] == {("curriculum",)}
    repo = data["repositoriesOrError"]["nodes"][0]
    assert repo["location"]["name"] == "trainwise"
    assert {"demo", "train"} <= {j["name"] for j in repo["jobs"]}


def test_demo_job_launched_through_graphql_succeeds(dagster_url):
    url, root = dagster_url
    params = {
        "selector": {"repositoryLocationName": "trainwise", "repositoryName": "__repository__",
                     "jobName": "demo"},
        "runConfigData": {"ops": {"checkpoint": {"config": {"max_steps": 12,
                                                            "eval_every_steps": 6}}}},
        "executionMetadata": {"tags": [{"key": "dagster/partition", "value": "pystdlib"}]},
    }
    launched = _graphql(url, LAUNCH, {"executionParams": params})["launchPipelineExecution"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]
    deadline = time.monotonic() + 600
    status = None
    while time.monotonic() < deadline:
        status = _graphql(url, STATUS, {"runId": run_id})["runOrError"]["status"]
        if status in {"SUCCESS", "FAILURE", "CANCELED"}:
            break
        time.sleep(2)
    assert status == "SUCCESS", (root / "daemon.log").read_text()[-3000:]
    # The run really trained: its checkpoint sits in the local object store.
    checkpoints = list((root / "state" / "objects" / "checkpoints" / "pystdlib").rglob("*.pt"))
    assert len(checkpoints) == 1
