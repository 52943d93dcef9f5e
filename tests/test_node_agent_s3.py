# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""The node agent and the SDK on an S3 store, as a remote node reaches it (issue 27, item 5: the
store reachable from remote nodes): `moto_server` on loopback stands for S3. The task is read
from the bucket, a SIGTERM's checkpoint is committed there, a node with an empty disk resumes
from it and ends with the weights of an uninterrupted run, and the agent's status and the job's
telemetry land in the bucket."""

from __future__ import annotations

import json
import signal

import boto3
import pytest

from tests import servers
from tests.test_node_agent import (  # noqa: F401 - the fixture is used by name
    MAX_STEPS,
    Agent,
    _assert_same,
    _env,
    _final,
    _task,
    reference,
)
from trainwise.agent.agent import committed_steps
from trainwise.agent.task import put_task
from trainwise.object_store import S3ObjectStore, StoreUnavailableError, store_at

pytestmark = pytest.mark.integration

BUCKET, PREFIX = "trainwise-runs", "deploy-a"
# moto accepts any credentials; these are test values, never real ones.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    with servers.moto(tmp_path_factory.mktemp("moto")) as url:
        boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(
            Bucket=BUCKET)
        yield url


@pytest.fixture
def s3_env(moto_url, monkeypatch) -> dict[str, str]:
    for name, value in {**CREDENTIALS, "TRAINWISE_S3_ENDPOINT_URL": moto_url}.items():
        monkeypatch.setenv(name, value)
    return _env(**CREDENTIALS, TRAINWISE_S3_ENDPOINT_URL=moto_url)


def test_a_location_names_its_store_and_a_bad_one_the_fix(s3_env):
    store = store_at(f"s3://{BUCKET}/{PREFIX}/")
    assert isinstance(store, S3ObjectStore) and (store.bucket, store.prefix) == (BUCKET, PREFIX)
    assert store.uri("runs/a/task.json") == f"s3://{BUCKET}/{PREFIX}/runs/a/task.json"
    with pytest.raises(FileNotFoundError, match="no such object"):
        store.get_bytes("runs/none/task.json")
    with pytest.raises(StoreUnavailableError, match="no-such-bucket"):
        store_at("s3://no-such-bucket/x").put_bytes(b"{}", "runs/a/task.json")
    with pytest.raises(ValueError, match="not an S3 bucket name.*s3://bucket/prefix"):
        store_at("s3://A_B/x")


def test_a_sigterm_commits_to_s3_and_an_empty_disk_resumes_from_it(tmp_path, s3_env,
                                                                     reference):
    location, run_id = f"s3://{BUCKET}/{PREFIX}", "agent-s3"
    store = store_at(location)
    put_task(store, _task(run_id, sleep_s=0.1))
    first = Agent(location, run_id, tmp_path / "node-1", s3_env, "--job", "blobs-classifier")
    first.wait_for_step(12)
    first.process.send_signal(signal.SIGTERM)
    assert first.wait() == 143, first.log[-3000:] + first.job_log[-3000:]
    status = first.status
    stopped_at = status["last_committed_step"]
    assert status["state"] == "preempted" and stopped_at >= 12
    assert status["notice"]["source"] == "SIGTERM"
    commits = committed_steps(store, f"runs/{run_id}/checkpoints/rank0")
    assert stopped_at in commits and commits[stopped_at]["step"] == stopped_at

    second = Agent(location, run_id, tmp_path / "node-2", s3_env)  # an empty disk
    assert second.wait() == 0, second.log[-3000:] + second.job_log[-3000:]
    assert f"resumed True at step {stopped_at}" in second.job_log
    assert second.status["resumed_from_step"] == stopped_at
    _assert_same(_final(tmp_path / "node-2"), reference)
    assert MAX_STEPS in committed_steps(store, f"runs/{run_id}/checkpoints/rank0")
    # Both starts' status records and the job's telemetry are in the bucket.
    starts = store.list_keys(f"runs/{run_id}/agent/starts")
    records = [json.loads(store.get_bytes(k)) for k in starts if k.endswith("/status.json")]
    assert sorted(r["state"] for r in records) == ["completed", "preempted"]
    assert any("/telemetry/" in k and k.endswith(".jsonl") for k in starts)


def test_an_agent_whose_bucket_is_not_there_stops_before_the_job(tmp_path, s3_env):
    agent = Agent("s3://no-such-bucket/x", "agent-nobucket", tmp_path / "node", s3_env)
    assert agent.wait() != 0
    assert "no-such-bucket" in agent.log and "the bucket does not exist" in agent.log
    assert not (tmp_path / "node" / "agent" / "job.log").exists()
