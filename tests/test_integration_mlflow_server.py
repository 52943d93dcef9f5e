"""MLflowResource against a real `mlflow server` on loopback."""

import pytest

from assets.resources import MLflowResource
from tests import servers
from trainwise import tracking

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = servers.free_port()
    log = root / "server.log"
    process = servers.start([
        str(servers.VENV_BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
    ], log)
    url = f"http://127.0.0.1:{port}"
    try:
        servers.wait_http(f"{url}/health", process, log, timeout_s=120)
        yield url
    finally:
        servers.stop(process)
    assert process.poll() is not None


def test_run_logged_through_resource_lands_on_server(mlflow_server, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", mlflow_server)
    resource = MLflowResource()
    assert resource.uri() == mlflow_server
    plot = tmp_path / "plot.png"
    plot.write_bytes(b"\x89PNG fake")
    run_id = tracking.log_run(resource.uri(), tracking.RunRecord(
        experiment="integration", run_name="server-run",
        params={"train/max_steps": 3, "aws_secret_access_key": "must-not-leak"},
        step_metrics=[(0, {"losses/train": 3.0}), (1, {"losses/train": 2.5})],
        final_metrics={"final/cost_usd": 0.002},
        artifacts=[plot],
    ))
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(run_id)
    assert run.data.params == {"train/max_steps": "3"}
    assert run.data.metrics["final/cost_usd"] == pytest.approx(0.002)
    assert [m.value for m in client.get_metric_history(run_id, "losses/train")] == [3.0, 2.5]
    assert [a.path for a in client.list_artifacts(run_id)] == ["plot.png"]
    assert tracking.run_url(mlflow_server, run_id).startswith(mlflow_server)
