"""Issue 13 item 10: Dagster's instance storage and MLflow's backend store on PostgreSQL.

The unit tests check the setting, the written dagster.yaml and the deploy/ example (validated
against Dagster's own config schemas). The integration tests start a real PostgreSQL on
loopback (initdb + postgres as an unprivileged user when we are root, which they refuse), run
a Dagster job and an MLflow run against it, and read both back from the database.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.servers import free_port
from trainwise import deployment, settings, tracking

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "deploy" / "dagster.yaml"
URL = "postgresql+psycopg2://trainwise@db.internal:5432/trainwise"


# --- the setting and the written dagster.yaml (no server) --------------------------------------
def test_embedded_sqlite_stays_the_default(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINWISE_POSTGRES_URL", raising=False)
    assert settings.postgres_url() == ""
    assert settings.mlflow_uri().startswith("sqlite:///")
    assert "storage" not in deployment.instance_config()
    assert deployment.write_instance_yaml(tmp_path)
    assert yaml.safe_load((tmp_path / "dagster.yaml").read_text()) == {
        "telemetry": {"enabled": False}, "run_coordinator": deployment.RUN_QUEUE}


def test_the_written_instance_drains_its_run_queue_every_second(monkeypatch, tmp_path):
    import dagster as dg

    monkeypatch.delenv("TRAINWISE_POSTGRES_URL", raising=False)
    deployment.write_instance_yaml(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    with dg.DagsterInstance.get() as instance:  # Dagster's own reading of the file
        coordinator = instance.run_coordinator
        assert type(coordinator).__name__ == "QueuedRunCoordinator"
        assert coordinator.dequeue_interval_seconds == 1


def test_postgres_url_moves_dagster_storage_and_mlflow(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINWISE_POSTGRES_URL", URL + "?sslmode=require")
    assert settings.mlflow_uri() == (
        "postgresql+psycopg2://trainwise@db.internal:5432/trainwise_mlflow?sslmode=require")
    deployment.write_instance_yaml(tmp_path)
    text = (tmp_path / "dagster.yaml").read_text()
    assert yaml.safe_load(text)["storage"] == {
        "postgres": {"postgres_url": {"env": "TRAINWISE_POSTGRES_URL"}}}
    assert "db.internal" not in text  # the file names the variable, not its value
    # An explicit MLflow URI (a tracking server) still wins over the derived database.
    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", "http://127.0.0.1:5000")
    assert settings.mlflow_uri() == "http://127.0.0.1:5000"


def test_the_cli_writes_the_instance_file_the_setting_asks_for(monkeypatch):
    """`trainwise demo`/`ui` prepare DAGSTER_HOME through the deployment module."""
    from trainwise import cli

    monkeypatch.setenv("TRAINWISE_POSTGRES_URL", URL)
    # The CLI fills these with setdefault; set them here so the test leaves the environment as it was.
    home = settings.home_dir()
    for name, value in (("DAGSTER_HOME", str(home / "dagster")), ("HF_HUB_OFFLINE", "1"),
                        ("HF_DATASETS_OFFLINE", "1"), ("HF_HOME", str(home / "hf"))):
        monkeypatch.setenv(name, value)
    assert cli._prepare_environment() == home
    config = yaml.safe_load((home / "dagster" / "dagster.yaml").read_text())
    assert config["storage"] == {"postgres": {"postgres_url": {"env": "TRAINWISE_POSTGRES_URL"}}}


def test_password_in_the_url_is_refused_and_never_echoed(monkeypatch):
    monkeypatch.setenv("TRAINWISE_POSTGRES_URL", "postgresql+psycopg2://trainwise:hunter2@db:5432/tw")
    with pytest.raises(settings.SettingError, match="PGPASSWORD") as caught:
        settings.postgres_url()
    assert "hunter2" not in str(caught.value)
    with pytest.raises(settings.SettingError):
        settings.check_all()  # the CLI refuses it before any slow work


@pytest.mark.parametrize("value", [
    "postgres://trainwise@db/tw",  # SQLAlchemy refuses the short scheme
    "postgresql://trainwise@db/tw",  # SQLAlchemy 2.1 would read it with psycopg 3
    "mysql://trainwise@db/tw",
    "postgresql+psycopg2://db:5432/tw",  # no user
    "postgresql+psycopg2://trainwise@db:5432/",  # no database
    "postgresql+psycopg2://trainwise@db:port/tw",
    "postgresql+psycopg2://trainwise@db/a/b",
])
def test_bad_postgres_url_names_the_setting_and_the_form(monkeypatch, value):
    monkeypatch.setenv("TRAINWISE_POSTGRES_URL", value)
    with pytest.raises(settings.SettingError,
                       match=r"TRAINWISE_POSTGRES_URL=.*postgresql\+psycopg2://USER@HOST:PORT/DB"):
        settings.postgres_url()


def test_a_users_own_dagster_yaml_is_kept_and_ours_follows_the_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINWISE_POSTGRES_URL", URL)
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")  # older trainwise
    assert deployment.write_instance_yaml(tmp_path)
    assert "storage" in yaml.safe_load((tmp_path / "dagster.yaml").read_text())
    monkeypatch.setenv("TRAINWISE_POSTGRES_URL", "")
    assert deployment.write_instance_yaml(tmp_path)  # back to sqlite: the storage goes
    assert "storage" not in yaml.safe_load((tmp_path / "dagster.yaml").read_text())
    own = "run_monitoring:\n  enabled: true\n"
    (tmp_path / "dagster.yaml").write_text(own)
    assert not deployment.write_instance_yaml(tmp_path, postgres=True)
    assert (tmp_path / "dagster.yaml").read_text() == own


def test_mlflow_artifacts_of_a_database_store_stay_under_the_state_folder(monkeypatch):
    # MLflow's own default for a database store is <cwd>/mlruns.
    root = tracking.default_artifact_root("postgresql+psycopg2://trainwise@db:5432/tw_mlflow")
    assert root == settings.home_dir() / "mlflow-artifacts"
    assert tracking.default_artifact_root("http://127.0.0.1:5000") is None


# --- the deploy/ example: the storage trainwise writes, every section valid -------------------
def test_deploy_example_uses_our_storage_and_validates(monkeypatch, tmp_path):
    from dagster._config import process_config, resolve_to_config_type
    from dagster._core.instance.config import dagster_instance_config

    example = yaml.safe_load(EXAMPLE.read_text())
    assert example["storage"] == deployment.storage_config()
    assert example["run_launcher"]["module"] in ("dagster_aws.ecs", "dagster_k8s")
    for name, value in {"TRAINWISE_POSTGRES_URL": URL, "TRAINWISE_S3_BUCKET": "tw-bucket"}.items():
        monkeypatch.setenv(name, value)
    shutil.copy(EXAMPLE, tmp_path / "dagster.yaml")
    config, _ = dagster_instance_config(str(tmp_path))  # the instance schema (storage selector)
    for section in ("run_launcher", "run_coordinator", "compute_logs"):
        module = __import__(config[section]["module"], fromlist=[config[section]["class"]])
        klass = getattr(module, config[section]["class"])
        result = process_config(resolve_to_config_type(klass.config_type()),
                                config[section].get("config") or {})
        assert result.success, f"deploy/dagster.yaml {section}: {result.errors}"


# --- a real PostgreSQL on loopback ---------------------------------------------------------------
def _postgres_bin() -> Path | None:
    """The folder with initdb and postgres: /usr/local/bin, else Debian's newest version."""
    folders = ["/usr/local/bin", *sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for folder in folders:
        if all(os.access(Path(folder) / name, os.X_OK) for name in ("initdb", "postgres")):
            return Path(folder)
    return None


def _server_account() -> pwd.struct_passwd | None:
    """Who runs the server: initdb and postgres refuse root, so as root an unprivileged
    account (Debian's `postgres`, else `nobody`); otherwise ourselves (None)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    pytest.skip("running as root and neither a `postgres` nor a `nobody` account exists to run "
                "PostgreSQL as (it refuses root)")


@dataclass(frozen=True)
class Server:
    url: str  # postgresql+psycopg2://trainwise@127.0.0.1:PORT/trainwise (no password)
    password: str


def _wait_ready(url: str, password: str, process: subprocess.Popen, log: Path,
                timeout_s: float = 30) -> None:
    import psycopg2

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"postgres exited with {process.returncode}: "
                               f"{log.read_text()[-2000:]}")
        try:
            psycopg2.connect(deployment.libpq_url(url.rsplit("/", 1)[0] + "/postgres"),
                             password=password,
                             connect_timeout=2).close()
            return
        except psycopg2.OperationalError:
            time.sleep(0.2)
    raise TimeoutError(f"postgres did not accept connections in {timeout_s} s: "
                       f"{log.read_text()[-2000:]}")


def _stop(process: subprocess.Popen) -> None:
    """SIGINT is PostgreSQL's fast shutdown (SIGTERM waits for every pooled client to leave);
    sent to the server's own process group, by id."""
    for signum, wait_s in ((signal.SIGINT, 20), (signal.SIGKILL, 5)):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signum)
            process.wait(timeout=wait_s)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def postgres():
    binaries = _postgres_bin()
    if binaries is None:
        pytest.skip("no PostgreSQL server binaries (initdb, postgres) in /usr/local/bin or "
                    "/usr/lib/postgresql/*/bin: `apt-get install postgresql` (Debian)")
    account = _server_account()
    as_user = {} if account is None else {
        "user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    # Under /tmp (world-traversable), not pytest's root-only tmp folder, so the account can
    # reach its data folder.
    folder = Path(tempfile.mkdtemp(prefix="trainwise-pg-"))
    process = None
    try:
        if account is not None:
            os.chown(folder, account.pw_uid, account.pw_gid)
        password = secrets.token_urlsafe(24)  # never printed: the fixture's logs omit it
        password_file = folder / "password"
        password_file.write_text(password)
        password_file.chmod(0o600)
        if account is not None:
            os.chown(password_file, account.pw_uid, account.pw_gid)
        initdb = subprocess.run(
            [str(binaries / "initdb"), "-D", str(folder / "data"), "-U", "trainwise",
             "--auth=scram-sha-256", f"--pwfile={password_file}", "-E", "UTF8", "--no-sync",
             "--no-instructions"],
            cwd=folder, capture_output=True, text=True, timeout=120, **as_user)
        password_file.unlink()
        assert initdb.returncode == 0, f"initdb failed: {initdb.stderr[-2000:]}"
        port = free_port()
        log = folder / "postgres.log"
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                [str(binaries / "postgres"), "-D", str(folder / "data"), "-p", str(port),
                 "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
                 "-c", "fsync=off"],
                cwd=folder, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                **as_user)
        url = f"postgresql+psycopg2://trainwise@127.0.0.1:{port}/trainwise"
        _wait_ready(url, password, process, log)
        yield Server(url, password)
    finally:
        if process is not None:
            _stop(process)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def on_postgres(postgres, monkeypatch):
    """The deployment setting pointed at the server; the password only in PGPASSWORD."""
    monkeypatch.setenv("TRAINWISE_POSTGRES_URL", postgres.url)
    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", "")
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    deployment.ensure_databases()
    return postgres


def _rows(url: str, query: str, args: tuple = ()) -> list[tuple]:
    import psycopg2

    connection = psycopg2.connect(deployment.libpq_url(url))
    try:
        with connection.cursor() as cursor:
            cursor.execute(query, args)
            return cursor.fetchall()
    finally:
        connection.close()


@pytest.mark.integration
def test_databases_are_created_once(on_postgres):
    assert deployment.ensure_databases() == []  # the fixture created both
    names = {row[0] for row in _rows(on_postgres.url, "SELECT datname FROM pg_database")}
    assert {"trainwise", "trainwise_mlflow"} <= names


@pytest.mark.integration
def test_check_names_the_setting_and_the_fix_never_the_password(on_postgres, monkeypatch):
    from trainwise.services import ServiceUnreachableError

    deployment.check_postgres()  # both databases answer
    monkeypatch.setenv("PGPASSWORD", "wrong-" + on_postgres.password)
    with pytest.raises(ServiceUnreachableError, match="TRAINWISE_POSTGRES_URL.*PGPASSWORD") as bad:
        deployment.check_postgres()
    assert on_postgres.password not in str(bad.value)
    monkeypatch.setenv("PGPASSWORD", on_postgres.password)
    with pytest.raises(ServiceUnreachableError, match="'nothere'.*ensure_databases"):
        deployment.check_postgres(on_postgres.url.rsplit("/", 1)[0] + "/nothere")
    closed = f"postgresql+psycopg2://trainwise@127.0.0.1:{free_port()}/trainwise"
    with pytest.raises(ServiceUnreachableError, match="start the server"):
        deployment.check_postgres(closed, timeout_s=2)


@pytest.mark.integration
def test_dagster_job_runs_with_its_storage_on_postgres(on_postgres, tmp_path):
    import dagster as dg

    dagster_home = tmp_path / "dagster"
    deployment.write_instance_yaml(dagster_home)
    written = yaml.safe_load((dagster_home / "dagster.yaml").read_text())
    assert written["storage"] == yaml.safe_load(EXAMPLE.read_text())["storage"]
    assert on_postgres.password not in (dagster_home / "dagster.yaml").read_text()

    @dg.asset
    def tokens_seen() -> int:
        return 42

    instance = dg.DagsterInstance.from_config(str(dagster_home))
    try:
        result = dg.materialize([tokens_seen], instance=instance)
        assert result.success
        run_id = result.run_id
    finally:
        instance.dispose()
    # Another process (a second instance object) finds the run and the materialization.
    fresh = dg.DagsterInstance.from_config(str(dagster_home))
    try:
        assert fresh.get_run_by_id(run_id).is_success
        event = fresh.get_latest_materialization_event(dg.AssetKey("tokens_seen"))
        assert event is not None and event.run_id == run_id
    finally:
        fresh.dispose()
    assert _rows(on_postgres.url, "SELECT status FROM runs WHERE run_id = %s",
                 (run_id,)) == [("SUCCESS",)]
    assert not (dagster_home / "history").exists()  # no embedded sqlite run storage


@pytest.mark.integration
def test_mlflow_run_lands_in_the_postgres_backend_store(on_postgres):
    uri = settings.mlflow_uri()
    assert uri == on_postgres.url + "_mlflow"
    tracking.check_reachable(uri)
    record = tracking.RunRecord(
        experiment="trainwise-postgres-test", run_name="pg-run",
        params={"pruning_rate": 0.3, "store": uri},
        step_metrics=[(1, {"losses/eval": 2.5}), (2, {"losses/eval": 2.1})],
        final_metrics={"cost/usd": 0.04}, tags={"partition": "pystdlib"})
    run_id = tracking.log_run(uri, record)

    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.data.metrics["cost/usd"] == pytest.approx(0.04)
    assert run.info.artifact_uri.startswith((settings.home_dir() / "mlflow-artifacts").as_uri())
    mlflow_db = on_postgres.url + "_mlflow"
    assert _rows(mlflow_db, "SELECT name FROM runs WHERE run_uuid = %s", (run_id,)) == [
        ("pg-run",)]
    assert not _rows(mlflow_db, "SELECT key FROM params WHERE value LIKE %s",
                     (f"%{on_postgres.password}%",))
