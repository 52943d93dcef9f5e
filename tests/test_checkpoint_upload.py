"""Checkpoints uploaded as they are written, against a real moto_server that goes away (defect 15).

The store's endpoint is stopped before a checkpoint is submitted and restarted on the same port
inside the uploader's retry window: the upload must complete and be committed. With the endpoint
gone for good, the report must say so clearly (and nothing half-committed may be trusted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path
from types import SimpleNamespace

import boto3
import pytest
from botocore.config import Config

from tests import servers
from trainwise.object_store import CheckpointUploader, S3ObjectStore, latest_committed_checkpoint
from trainwise.services import Backoff, ServiceUnreachableError

pytestmark = pytest.mark.integration
BUCKET = "trainwise-ckpt"


class Moto:
    """One moto_server on a fixed loopback port that can be stopped and started again."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = servers.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = self.root / f"moto-{self.starts}.log"
        self.process = servers.start([str(servers.VENV_BIN / "moto_server"), "-H", "127.0.0.1",
                                      "-p", str(self.port)], log)
        servers.wait_http(f"{self.url}/moto-api/", self.process, log, timeout_s=60)
        self.client().create_bucket(Bucket=BUCKET)  # moto keeps state in memory only

    def stop(self) -> None:
        if self.process is not None:
            servers.stop(self.process)
            self.process = None

    def client(self):
        # One try per call, short timeouts: the uploader's backoff is what is under test.
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            config=Config(retries={"max_attempts": 1, "mode": "standard"},
                                          connect_timeout=1, read_timeout=10))


@pytest.fixture
def moto(tmp_path, monkeypatch):
    # moto accepts any credentials; these are test values, never real ones.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = Moto(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def write_checkpoint(folder: Path, step: int) -> SimpleNamespace:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:07d}.pt"
    path.write_bytes(bytes(range(256)) * 2048 + step.to_bytes(4, "little"))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest = path.with_name(path.name + ".manifest.json")
    manifest.write_text(json.dumps({"step": step, "sha256": digest,
                                    "bytes": path.stat().st_size}))
    return SimpleNamespace(path=path, manifest_path=manifest, step=step, sha256=digest,
                           reason="interval")


def test_upload_survives_the_endpoint_going_away(moto, tmp_path, caplog):
    store = S3ObjectStore(moto.client(), BUCKET)
    store.check_reachable()
    # ~40 s of retry window: enough for moto to restart on a busy machine.
    backoff = Backoff(tries=12, first_delay_s=0.5, factor=2.0, max_delay_s=4.0)
    uploader = CheckpointUploader(store, "checkpoints/pystdlib/run1", backoff=backoff)
    uploader.submit(write_checkpoint(tmp_path / "local", 10))
    assert uploader.drain(timeout_s=60).uploaded  # wait: step 10 is in before the outage

    uploader = CheckpointUploader(store, "checkpoints/pystdlib/run1", backoff=backoff)
    caplog.set_level(logging.WARNING, logger="trainwise.upload")
    failed_try = threading.Event()  # set by the uploader's first "failed ..., retrying" warning

    class OnRetry(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retrying" in record.getMessage():
                failed_try.set()

    on_retry = OnRetry(logging.WARNING)
    logging.getLogger("trainwise.upload").addHandler(on_retry)
    moto.stop()
    with pytest.raises(ServiceUnreachableError, match=BUCKET):
        store.check_reachable()
    uploader.submit(write_checkpoint(tmp_path / "local", 20))
    try:  # the endpoint comes back only after a try failed against it (the bound: a hang)
        assert failed_try.wait(timeout=120), "the upload never tried the stopped endpoint"
    finally:
        logging.getLogger("trainwise.upload").removeHandler(on_retry)
    # moto keeps its buckets in memory: between the new server answering and the bucket being
    # made again, a try would meet NoSuchBucket (rightly not transient). Real S3 never loses a
    # bucket, so tries wait until the restart (and its bucket) is complete.
    back = threading.Event()
    client = store.client

    class AfterRestart:  # the store's client, each call held until the restart is complete
        def __getattr__(self, name):
            assert back.wait(timeout=120), "the endpoint never came back"
            return getattr(client, name)

    store.client = AfterRestart()

    def restart() -> None:
        moto.start()
        back.set()

    restarted = threading.Thread(target=restart)
    restarted.start()
    report = uploader.drain(timeout_s=90)
    restarted.join()
    assert report.ok, report.summary()
    assert "retrying" in caplog.text  # it did fail while the endpoint was down
    assert report.uploaded == [f"s3://{BUCKET}/trainwise/checkpoints/pystdlib/run1/step-0000020.pt"]

    found = latest_committed_checkpoint(store, "checkpoints/pystdlib/run1", tmp_path / "restore")
    assert found is not None and found.step == 20  # (moto lost step 10 with its memory)
    assert hashlib.sha256(found.path.read_bytes()).hexdigest() == found.sha256


def test_upload_fails_clearly_when_the_endpoint_stays_down(moto, tmp_path):
    store = S3ObjectStore(moto.client(), BUCKET)
    moto.stop()
    uploader = CheckpointUploader(store, "ckpt",
                                  backoff=Backoff(tries=3, first_delay_s=0.1, max_delay_s=0.2))
    uploader.submit(write_checkpoint(tmp_path / "local", 10))
    report = uploader.drain(timeout_s=60)
    assert report.uploaded == []
    [(key, why)] = report.failed
    assert key == "ckpt/step-0000010.pt"
    assert "3 tries" in why and "TRAINWISE_S3_ENDPOINT_URL" in why


def test_half_uploaded_checkpoint_is_not_trusted(moto, tmp_path):
    store = S3ObjectStore(moto.client(), BUCKET)
    first = write_checkpoint(tmp_path / "local", 10)
    store.put_checkpoint(first.path, first.manifest_path, "ckpt/step-0000010.pt")
    second = write_checkpoint(tmp_path / "local", 20)
    # the node died between the payload/manifest and the commit marker
    store.put_file(second.path, "ckpt/step-0000020.pt")
    store.put_file(second.manifest_path, "ckpt/step-0000020.pt.manifest.json")
    found = latest_committed_checkpoint(store, "ckpt", tmp_path / "restore")
    assert found is not None and found.step == 10
