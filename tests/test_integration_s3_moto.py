"""ObjectStoreResource through dagster-aws against a real moto_server on loopback."""


import boto3
import pytest

from assets.resources import ObjectStoreResource
from tests import servers
from trainwise.object_store import S3ObjectStore, sha256_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    with servers.moto(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture
def aws_env(monkeypatch):
    # moto accepts any credentials; these are test values, never real ones.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def test_checkpoint_roundtrip_through_s3(moto_url, aws_env, tmp_path, monkeypatch):
    boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1").create_bucket(
        Bucket="trainwise-ckpt")
    monkeypatch.setenv("TRAINWISE_S3_BUCKET", "trainwise-ckpt")
    monkeypatch.setenv("TRAINWISE_S3_ENDPOINT_URL", moto_url)
    store = ObjectStoreResource().store()
    assert isinstance(store, S3ObjectStore)

    checkpoint = tmp_path / "step-00010.pt"
    checkpoint.write_bytes(bytes(range(256)) * 4096)
    uri = store.put_file(checkpoint, "checkpoints/pystdlib/run1/step-00010.pt")
    assert uri == "s3://trainwise-ckpt/trainwise/checkpoints/pystdlib/run1/step-00010.pt"
    assert store.exists("checkpoints/pystdlib/run1/step-00010.pt")
    assert not store.exists("checkpoints/pystdlib/run1/missing.pt")

    back = store.get_file("checkpoints/pystdlib/run1/step-00010.pt", tmp_path / "back.pt")
    assert sha256_of(back) == sha256_of(checkpoint)
    head = boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1").head_object(
        Bucket="trainwise-ckpt", Key="trainwise/checkpoints/pystdlib/run1/step-00010.pt")
    assert head["Metadata"]["sha256"] == sha256_of(checkpoint)


def test_no_bucket_means_local_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINWISE_S3_BUCKET", raising=False)
    monkeypatch.setenv("TRAINWISE_HOME", str(tmp_path))
    store = ObjectStoreResource().store()
    assert type(store).__name__ == "LocalObjectStore"
    assert store.root == tmp_path / "objects"


def test_reachability_checks_against_moto(moto_url, aws_env, monkeypatch):
    from trainwise.services import ServiceUnreachableError

    client = boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1")
    client.create_bucket(Bucket="trainwise-reach")
    S3ObjectStore(client, "trainwise-reach").check_reachable()
    with pytest.raises(ServiceUnreachableError, match="does not exist") as caught:
        S3ObjectStore(client, "no-such-bucket").check_reachable()
    assert "no-such-bucket" in str(caught.value) and moto_url in str(caught.value)

    monkeypatch.setenv("TRAINWISE_S3_BUCKET", "trainwise-reach")
    monkeypatch.setenv("TRAINWISE_S3_ENDPOINT_URL", moto_url)
    ObjectStoreResource().store().check_reachable()


def test_closed_endpoint_fails_fast_naming_bucket_endpoint_and_settings(aws_env, monkeypatch):
    from trainwise.services import ServiceUnreachableError

    endpoint = f"http://127.0.0.1:{servers.free_port()}"  # nothing listens there
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    # boto3's own retries (with backoff) start at head_bucket: the TCP probe must stop it first.
    heads = []
    monkeypatch.setattr(client, "head_bucket", lambda **kwargs: heads.append(kwargs))
    with pytest.raises(ServiceUnreachableError) as caught:
        S3ObjectStore(client, "trainwise-ckpt").check_reachable()
    assert heads == [], "refused by the TCP probe, before any S3 request"
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)
    message = str(caught.value)
    for needle in ("trainwise-ckpt", endpoint, "TRAINWISE_S3_BUCKET", "TRAINWISE_S3_ENDPOINT_URL"):
        assert needle in message
