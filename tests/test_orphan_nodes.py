"""Nothing billed runs idle (issue 27 goal): aws nodes that no live run of this deployment holds
are found and terminated, through a recorded Dagster run the sensor asks for; against a real
moto_server on loopback."""

from __future__ import annotations

import json
import os
import time

import boto3
import dagster as dg
import pytest

from cloud.providers.aws import AwsProvider
from pipelines.definitions import defs
from sensors.orphan_nodes import orphan_nodes_sensor
from tests.test_market_view_aws import moto_url  # noqa: F401 - the module's moto_server
from training.run_lock import RunFolderLock
from trainwise import orphan_nodes, settings

REGION, ZONE, TYPE = "us-east-1", "us-east-1a", "g4dn.xlarge"
OLD_S = 2 * orphan_nodes.GRACE_S  # older than the grace: no segment can be in between


@pytest.fixture
def aws(monkeypatch, moto_url):  # noqa: F811
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("TRAINWISE_EC2_ENDPOINT_URL", moto_url)
    monkeypatch.setenv("TRAINWISE_PROVIDER", "aws")
    monkeypatch.setenv("TRAINWISE_REGION", REGION)
    ec2 = boto3.client("ec2", endpoint_url=moto_url, region_name=REGION)
    image = ec2.describe_images()["Images"][0]["ImageId"]
    return ec2, image, moto_url


def _launch(url, image, **agent) -> str:
    provider = (AwsProvider.for_run(TYPE, REGION, endpoint_url=url, image_id=image, **agent)
                if agent else AwsProvider(REGION, endpoint_url=url, image_id=image))
    return provider.launch(ZONE, TYPE, "on_demand")[0].node_id


def _run(run_id: str, node_ids: list[str], *, age_s: float, outcome: str | None = None):
    """A run folder as the in-process engine leaves it: gang.json listing what its provider
    launched, written `age_s` ago; outcome.json when it ended."""
    run_dir = settings.home_dir() / "runs" / run_id
    run_dir.mkdir(parents=True)
    gang = run_dir / "gang.json"
    gang.write_text(json.dumps({"provider": "aws", "zone": ZONE, "nodes": len(node_ids),
                                "launched": [{"node_id": n, "zone": ZONE} for n in node_ids]}))
    at = time.time() - age_s
    os.utime(gang, (at, at))
    if outcome:
        (run_dir / "outcome.json").write_text(json.dumps({"status": outcome}))
    return run_dir


def _state(ec2, instance_id: str) -> str:
    answer = ec2.describe_instances(InstanceIds=[instance_id])
    return answer["Reservations"][0]["Instances"][0]["State"]["Name"]


def test_only_nodes_of_ended_or_dead_runs_are_terminated(aws, tmp_path):
    ec2, image, url = aws
    live, booting, ended, dead, unknown = (_launch(url, image) for _ in range(5))
    agent_node = _launch(url, image, run_id="r-agent", store_root=str(tmp_path / "store"))
    live_dir = _run("r-live", [live], age_s=OLD_S)  # kept live by its trainer's lock alone
    _run("r-booting", [booting], age_s=10.0)  # between segments: gang.json just written
    _run("r-ended", [ended], age_s=10.0, outcome="completed")
    _run("r-dead", [dead], age_s=OLD_S)
    _run("r-agent", [], age_s=OLD_S)  # its node is named by the node's run tag only

    provider = AwsProvider(REGION, endpoint_url=url)
    with RunFolderLock(live_dir):
        orphans = {o.instance_id: o for o in orphan_nodes.find_orphans(
            provider, settings.home_dir())}
    assert {ended, dead, agent_node, unknown} <= set(orphans)
    assert live not in orphans and booting not in orphans
    assert orphans[ended].run_id == "r-ended" and "ended (outcome.json: completed)" in (
        orphans[ended].why)
    assert orphans[dead].run_id == "r-dead" and "no process holds the run folder" in (
        orphans[dead].why)
    assert orphans[agent_node].run_id == "r-agent"
    assert orphans[unknown].unknown and "no run of this deployment launched it" in (
        orphans[unknown].why)

    done, left = orphan_nodes.terminate_orphans(provider, list(orphans.values()))
    assert {o.instance_id for o in done} >= {ended, dead, agent_node}
    assert unknown in {o.instance_id for o in left}
    assert [_state(ec2, n) for n in (ended, dead, agent_node)] == ["terminated"] * 3
    assert [_state(ec2, n) for n in (live, booting, unknown)] == ["running"] * 3

    # Without its trainer's lock and with gang.json old, the live run's node is orphaned too.
    assert live in {o.instance_id for o in orphan_nodes.find_orphans(
        provider, settings.home_dir())}


def test_the_sensor_asks_for_a_recorded_run_that_terminates_them(aws):
    ec2, image, url = aws
    dead, unknown = _launch(url, image), _launch(url, image)
    _run("r-dead-2", [dead], age_s=OLD_S)
    instance = dg.DagsterInstance.ephemeral()
    context = dg.build_sensor_context(instance=instance, definitions=defs)
    result = orphan_nodes_sensor.evaluate_tick(context)
    assert len(result.run_requests) == 1, result.skip_message
    request = result.run_requests[0]
    ids = request.run_config["ops"]["terminate_orphans_op"]["config"]["instance_ids"]
    assert dead in ids and unknown not in ids
    assert "r-dead-2" in request.tags["trainwise/reason"]

    done = defs.resolve_job_def("terminate_orphan_nodes").execute_in_process(
        instance=instance, run_config=request.run_config, tags=request.tags)
    assert done.success
    assert _state(ec2, dead) == "terminated" and _state(ec2, unknown) == "running"
    result = orphan_nodes_sensor.evaluate_tick(dg.build_sensor_context(
        instance=instance, definitions=defs))
    assert not result.run_requests
    assert "no orphaned node of this deployment" in result.skip_message
    assert unknown in result.skip_message  # listed, left alone


def test_without_aws_or_with_ec2_unreadable_the_sensor_skips_with_the_reason(monkeypatch):
    monkeypatch.setenv("TRAINWISE_PROVIDER", "emulated")
    context = dg.build_sensor_context(instance=dg.DagsterInstance.ephemeral(), definitions=defs)
    assert "not aws" in orphan_nodes_sensor.evaluate_tick(context).skip_message
    from tests.servers import free_port

    monkeypatch.setenv("TRAINWISE_PROVIDER", "aws")
    monkeypatch.setenv("TRAINWISE_EC2_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    skipped = orphan_nodes_sensor.evaluate_tick(context).skip_message
    assert skipped.startswith("EC2 could not be read: provider 'aws'"), skipped
