"""MLflowResource against a real `mlflow server` on loopback."""

import socket
import socketserver
import threading
import time
from urllib.parse import urlsplit

import pytest

from assets.resources import MLflowResource
from tests import servers
from trainwise import tracking
from trainwise.services import Backoff

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


def test_server_passes_the_preflight(mlflow_server):
    tracking.check_reachable(mlflow_server, timeout_s=5)


class _Forwarder(socketserver.ThreadingTCPServer):
    """A loopback TCP forwarder to the MLflow server: the server "coming back" on a new port."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.target = target
        super().__init__(("127.0.0.1", port), _Pipe)


class _Pipe(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        upstream = socket.create_connection(self.server.target)

        def pump(source: socket.socket, sink: socket.socket) -> None:
            try:
                while data := source.recv(65536):
                    sink.sendall(data)
            except OSError:
                pass
            finally:
                sink.close()

        other = threading.Thread(target=pump, args=(upstream, self.request), daemon=True)
        other.start()
        pump(self.request, upstream)
        other.join(timeout=5)


def test_log_run_waits_for_a_server_that_comes_back(mlflow_server):
    """Nothing listens at the URI when logging starts; it answers a few seconds later."""
    from mlflow.tracking import MlflowClient

    port = servers.free_port()
    url = f"http://127.0.0.1:{port}"
    outcome: dict = {}
    waits: list[float] = []
    refused = threading.Event()  # log_run's first try was refused: it waits to try again

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        refused.set()
        time.sleep(seconds)

    def log() -> None:
        try:
            outcome["run_id"] = tracking.log_run(url, tracking.RunRecord(
                experiment="late", run_name="r", params={"a": 1}), sleep=sleep,
                backoff=Backoff(tries=8, first_delay_s=0.5, factor=2.0, max_delay_s=4.0))
        except Exception as error:  # reported by the assertion below
            outcome["error"] = error

    logger = threading.Thread(target=log)
    logger.start()
    # The server comes only after a refused try (the timeout only bounds a hang).
    assert refused.wait(timeout=120), f"log_run never waited to retry: {outcome}"
    target = urlsplit(mlflow_server)
    forwarder = _Forwarder(port, (target.hostname, target.port))
    threading.Thread(target=forwarder.serve_forever, daemon=True).start()
    try:
        logger.join(timeout=120)
        assert "error" not in outcome, outcome
        assert waits, "log_run never had to retry"
        run = MlflowClient(tracking_uri=mlflow_server).get_run(outcome["run_id"])
        assert run.data.params == {"a": "1"} and run.info.status == "FINISHED"
    finally:
        forwarder.shutdown()
        forwarder.server_close()
