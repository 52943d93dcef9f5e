import hashlib
import uuid

import pytest

from tests import servers
from trainwise import tracking
from trainwise.services import Backoff, ServiceUnreachableError

FAST = Backoff(tries=3, first_delay_s=0.05, factor=2.0, max_delay_s=0.2)


def test_scrub_drops_secret_names_and_stringifies():
    clean = tracking.scrub_params({
        "train/lr": 0.001, "aws_secret_access_key": "x", "MLFLOW_TRACKING_TOKEN": "t",
        "db_password": "p", "cloud/instance_type": "p3.2xlarge",
    })
    assert clean == {"train/lr": "0.001", "cloud/instance_type": "p3.2xlarge"}


@pytest.mark.parametrize("name", [
    "api_key", "OPENAI_API_KEY", "apiKey", "x-api-key", "private_key", "ssh_key", "passwd",
    "db_pwd", "authorization", "Authorization", "bearer", "dsn", "SENTRY_DSN", "auth_token",
    "api_token", "token", "refresh_token", "AWS_SESSION_TOKEN", "client_secret", "cookie",
    "credentials", "GOOGLE_APPLICATION_CREDENTIALS", "access_key", "passphrase",
])
def test_secret_names_are_dropped(name):
    assert tracking.scrub_params({name: "value", "kept": 1}) == {"kept": "1"}


@pytest.mark.parametrize("name", [
    "max_tokens", "tokenizer", "tokens_seen", "train/seed", "train/max_steps", "num_tokens",
    "tokenizer_name", "data/fingerprint", "keyboard_layout", "author", "train/run_id",
])
def test_harmless_names_are_kept(name):
    assert tracking.scrub_params({name: 7}) == {name: "7"}


@pytest.mark.parametrize(("value", "shown"), [
    ("postgresql://bob:hunter2@db:5432/x", "postgresql://bob:***@db:5432/x"),
    ("https://user:p%40ss@mlflow.example/x?token=abc&page=2",
     "https://user:***@mlflow.example/x?token=***&page=2"),
    ("AKIAIOSFODNN7EXAMPLE", "***"),
    ("ghp_" + "a1B2c3" * 6, "***"),
    ("xoxb-1234567890-abcdefghij", "***"),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJl", "***"),
    ("curl -H 'Authorization: Bearer abcdefghijklmnop' x", "curl -H 'Authorization: ***' x"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "***"),
    ("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "***"),  # AWS secret access key shape
    ("hf_" + "abcDEF123" * 4, "***"),
])
def test_secret_values_are_redacted(value, shown):
    assert tracking.scrub_params({"note": value}) == {"note": shown}


@pytest.mark.parametrize("value", [
    # Fixed ids, not uuid4(): every pytest-xdist worker must collect the same test names.
    hashlib.sha256(b"x").hexdigest(), uuid.UUID(int=0x5EED).hex, str(uuid.UUID(int=0xC0FFEE)),
    "p3.2xlarge",
    "/tmp/pytest-of-root/pytest-12/trainwise_home0/runs/abc", "0.001", "tinyshakespeare",
    "https://example.com/path?page=1", "http://127.0.0.1:5000", "sqlite:////tmp/x/mlflow.db",
    "s3://bucket/trainwise/checkpoints/pystdlib/run1/step-0000010.pt",
    "ThisIsAVeryLongCamelCaseIdentifierName2024",
])
def test_harmless_values_are_kept(value):
    assert tracking.scrub_params({"v": value}) == {"v": value}


def _record(**overrides):
    values = dict(
        experiment="t", run_name="r", params={"a": 1, "secret_token": "s"},
        step_metrics=[(1, {"losses/train": 2.0}), (2, {"losses/train": 1.5, "cost/usd": 0.01})],
        final_metrics={"final/eval_loss": 1.4})
    return tracking.RunRecord(**{**values, **overrides})


def test_log_run_to_sqlite(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    artifact = tmp_path / "note.txt"
    artifact.write_text("hello")
    run_id = tracking.log_run(uri, _record(
        artifacts=[artifact],
        params={"a": 1, "secret_token": "s", "data/url": "https://u:pw@host/x"},
        tags={"partition": "p", "api_token": "t", "note": "AKIAIOSFODNN7EXAMPLE"}))
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.data.params == {"a": "1", "data/url": "https://u:***@host/x"}
    assert run.data.tags["partition"] == "p" and run.data.tags["note"] == "***"
    assert "api_token" not in run.data.tags
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "losses/train")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.5)]
    assert run.data.metrics["final/eval_loss"] == 1.4
    assert [a.path for a in client.list_artifacts(run_id)] == ["note.txt"]


def test_artifacts_stay_under_the_state_folder(tmp_path, monkeypatch):
    """Defect 13: artifacts used to land in <cwd>/mlruns, shared by every state folder."""
    from mlflow.tracking import MlflowClient

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    artifact = tmp_path / "plot.png"
    artifact.write_bytes(b"png")
    roots = []
    for name in ("home_a", "home_b"):
        home = tmp_path / name
        home.mkdir()
        uri = f"sqlite:///{home / 'mlflow.db'}"
        run_id = tracking.log_run(uri, _record(experiment="trainwise", artifacts=[artifact]),
                                  artifact_root=home / "mlflow-artifacts")
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name("trainwise")
        assert experiment.tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
        artifact_uri = client.get_run(run_id).info.artifact_uri
        assert artifact_uri.startswith((home / "mlflow-artifacts").as_uri())
        assert list((home / "mlflow-artifacts").rglob("plot.png"))
        roots.append(experiment.artifact_location)
    assert roots[0] != roots[1]
    assert list(cwd.iterdir()) == []  # no mlruns next to the caller


def test_unreachable_server_fails_fast_naming_uri_and_setting(monkeypatch):
    uri = f"http://127.0.0.1:{servers.free_port()}"
    requests = []  # an HTTP request would wait out its timeout: the TCP probe must stop it first
    monkeypatch.setattr(tracking.urllib.request, "urlopen",
                        lambda *args, **kwargs: requests.append(args))
    with pytest.raises(ServiceUnreachableError, match="TRAINWISE_MLFLOW_URI") as caught:
        tracking.check_reachable(uri, timeout_s=1.0)
    assert requests == [], "refused by the TCP probe, before any HTTP request"
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)
    assert uri in str(caught.value)


def test_unreachable_message_hides_url_password():
    uri = f"http://bob:hunter2@127.0.0.1:{servers.free_port()}"
    with pytest.raises(ServiceUnreachableError) as caught:
        tracking.check_reachable(uri, timeout_s=1.0)
    assert "hunter2" not in str(caught.value)


def test_sqlite_uri_checks_its_folder(tmp_path):
    tracking.check_reachable(f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}")
    (tmp_path / "folder.db").mkdir()
    with pytest.raises(ServiceUnreachableError, match="names a folder"):
        tracking.check_reachable(f"sqlite:///{tmp_path / 'folder.db'}")
    (tmp_path / "afile").write_text("")
    with pytest.raises(ServiceUnreachableError, match="TRAINWISE_MLFLOW_URI"):
        tracking.check_reachable(f"sqlite:///{tmp_path / 'afile' / 'mlflow.db'}")
    (tmp_path / "notes.db").write_text("not a database")
    with pytest.raises(ServiceUnreachableError, match="not a SQLite database"):
        tracking.check_reachable(f"sqlite:///{tmp_path / 'notes.db'}")


def test_log_run_gives_up_after_bounded_retries():
    uri = f"http://127.0.0.1:{servers.free_port()}"
    waits = []
    with pytest.raises(ServiceUnreachableError, match="TRAINWISE_MLFLOW_URI") as caught:
        tracking.log_run(uri, _record(), backoff=FAST, sleep=waits.append)
    assert waits == [0.05, 0.1]  # 3 tries, exponential waits between them, then it gives up
    assert "Connection refused" in str(caught.value)  # the last try's error, passed on


def test_retry_passes_non_connection_errors_through_at_once():
    from trainwise.services import retry

    waits = []

    def bad_request():
        raise ValueError("RESOURCE_DOES_NOT_EXIST: run 5031abc not found")

    with pytest.raises(ValueError, match="RESOURCE_DOES_NOT_EXIST"):
        retry(bad_request, what="x", backoff=FAST, sleep=waits.append)
    assert waits == []
