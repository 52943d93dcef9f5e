"""The `aws` provider against a real moto_server on loopback: no real AWS call anywhere."""

from __future__ import annotations

import logging

import boto3
import pytest

from cloud import prices
from cloud.providers import (
    LaunchFailedError,
    NodeState,
    ProviderUnreachableError,
    UnknownInstanceTypeError,
    UnknownZoneError,
    make_provider,
    provider_name,
)
from cloud.providers.aws import AwsProvider, node_state
from cloud.providers.base import node_price_usd_per_hour
from tests import servers

pytestmark = pytest.mark.integration
REGION, ZONE = "us-east-1", "us-east-1a"
SECRET = "testing-secret-never-logged"


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    port = servers.free_port()
    process = servers.start(
        [str(servers.VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        servers.wait_http(f"{url}/moto-api/", process, log, timeout_s=60)
        yield url
    finally:
        servers.stop(process)


@pytest.fixture
def aws_env(monkeypatch):
    # moto accepts any credentials; test values only. boto3 reads them from its own chain.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


class Clock:
    def __init__(self, now_s: float = 1_700_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def _provider(url, clock=None) -> AwsProvider:
    ec2 = boto3.client("ec2", endpoint_url=url, region_name=REGION)
    image = ec2.describe_images()["Images"][0]["ImageId"]
    return make_provider("aws", region=REGION, endpoint_url=url, image_id=image,
                         clock=clock or Clock())


def _ec2_instance(url, instance_id):
    ec2 = boto3.client("ec2", endpoint_url=url, region_name=REGION)
    return ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]


def test_on_demand_node_is_launched_running_billed_and_terminated(moto_url, aws_env):
    clock = Clock()
    provider = _provider(moto_url, clock)
    (node,) = provider.launch(ZONE, "p3.2xlarge", "on_demand", 1)
    assert node.node_id.startswith("i-") and node.market == "on_demand"
    assert node.price_usd_per_hour == prices.on_demand_price("p3.2xlarge", REGION)
    assert _ec2_instance(moto_url, node.node_id)["Placement"]["AvailabilityZone"] == ZONE
    assert provider.state(node) == NodeState.RUNNING
    launched = provider.describe(node).launched_at_s
    clock.now_s = launched + 1800.0
    assert provider.node_cost_usd(node) == pytest.approx(0.5 * node.price_usd_per_hour)
    provider.terminate(node)
    clock.now_s += 3600.0  # billing stopped at the termination
    assert provider.state(node) == NodeState.TERMINATED
    assert provider.bill_usd() == pytest.approx(0.5 * node.price_usd_per_hour)
    assert _ec2_instance(moto_url, node.node_id)["State"]["Name"] in ("shutting-down",
                                                                     "terminated")


def test_spot_launch_uses_market_options_and_the_spot_price(moto_url, aws_env):
    provider = _provider(moto_url)
    nodes = provider.launch(ZONE, "p3.2xlarge", "spot", 2)
    assert len(nodes) == 2
    for node in nodes:
        assert _ec2_instance(moto_url, node.node_id)["InstanceLifecycle"] == "spot"
        assert node.price_usd_per_hour == node_price_usd_per_hour("aws", "p3.2xlarge", ZONE,
                                                                  "spot")
        assert node.price_usd_per_hour < prices.on_demand_price("p3.2xlarge", REGION)
    for node in nodes:
        provider.terminate(node)


def test_a_node_terminated_by_the_cloud_is_reported_reclaimed(moto_url, aws_env):
    provider = _provider(moto_url)
    (node,) = provider.launch(ZONE, "p3.2xlarge", "spot", 1)
    assert provider.state(node) == NodeState.RUNNING
    provider.poll_events()
    # The spot market takes it back: not our terminate call.
    boto3.client("ec2", endpoint_url=moto_url, region_name=REGION).terminate_instances(
        InstanceIds=[node.node_id])
    events = provider.poll_events()
    assert [(e.node_id, e.state) for e in events] == [(node.node_id, NodeState.RECLAIMED)]
    assert provider.describe(node).ended_at_s is not None


def test_ec2_states_map_to_ours():
    assert node_state("running", False, "marked-for-termination") == NodeState.NOTICE
    assert node_state("terminated", False, None) == NodeState.RECLAIMED
    assert node_state("shutting-down", True, None) == NodeState.TERMINATED
    assert node_state("pending", False, None) == NodeState.PENDING
    with pytest.raises(ValueError, match="unknown EC2 instance state 'rebooting-ish'"):
        node_state("rebooting-ish", False, None)


def test_unknown_zone_and_instance_type_are_named(moto_url, aws_env):
    provider = _provider(moto_url)
    with pytest.raises(UnknownZoneError, match="'us-east-1z'.*us-east-1a"):
        provider.launch("us-east-1z", "p3.2xlarge", "on_demand", 1)
    with pytest.raises(UnknownInstanceTypeError, match="'zz.huge'.*p3.2xlarge"):
        provider.launch(ZONE, "zz.huge", "on_demand", 1)
    with pytest.raises(ValueError, match="market 'reserved'"):
        provider.launch(ZONE, "p3.2xlarge", "reserved", 1)
    assert provider.nodes() == []


class CapacityRefused:
    """The moto client, except that run_instances answers as EC2 does when a zone has no spot
    capacity (moto itself never runs out)."""

    def __init__(self, client) -> None:
        self.client = client

    def __getattr__(self, name):
        return getattr(self.client, name)

    def run_instances(self, **kwargs):
        from botocore.exceptions import ClientError

        raise ClientError({"Error": {"Code": "InsufficientInstanceCapacity",
                                     "Message": "no spot capacity in us-east-1a"}},
                          "RunInstances")


def test_a_refused_launch_raises_launch_failed_with_the_ec2_code(moto_url, aws_env):
    client = CapacityRefused(boto3.client("ec2", endpoint_url=moto_url, region_name=REGION))
    provider = make_provider("aws", region=REGION, endpoint_url=moto_url, image_id="ami-1",
                             client=client)
    with pytest.raises(LaunchFailedError, match="InsufficientInstanceCapacity") as caught:
        provider.launch(ZONE, "p3.2xlarge", "spot", 1)
    assert caught.value.zone == ZONE and caught.value.market == "spot"
    assert provider.nodes() == [] and provider.bill_usd() == 0.0


def test_launch_without_an_image_names_the_setting(moto_url, aws_env):
    provider = make_provider("aws", region=REGION, endpoint_url=moto_url)
    with pytest.raises(ValueError, match="TRAINWISE_EC2_IMAGE_ID"):
        provider.launch(ZONE, "p3.2xlarge", "on_demand", 1)


def test_spot_price_history_comes_from_ec2(moto_url, aws_env):
    provider = _provider(moto_url)
    points = provider.spot_price_history(ZONE, "g4dn.xlarge", 1.6e9, 1.7e9)
    assert points, "moto serves a spot price for g4dn.xlarge in us-east-1a"
    assert {(p.zone, p.instance_type) for p in points} == {(ZONE, "g4dn.xlarge")}
    assert all(p.usd_per_hour > 0 for p in points)


def test_an_unreachable_endpoint_is_a_clear_error_without_credentials(aws_env, caplog):
    dead = f"http://127.0.0.1:{servers.free_port()}"
    provider = make_provider("aws", region=REGION, endpoint_url=dead, image_id="ami-1",
                             connect_timeout_s=1.0)
    with caplog.at_level(logging.DEBUG), pytest.raises(ProviderUnreachableError) as caught:
        provider.launch(ZONE, "p3.2xlarge", "on_demand", 1)
    assert dead in str(caught.value) and "TRAINWISE_EC2_ENDPOINT_URL" in str(caught.value)
    assert SECRET not in str(caught.value) and SECRET not in caplog.text


def test_the_setting_selects_the_provider(monkeypatch):
    monkeypatch.setenv("TRAINWISE_PROVIDER", "aws")
    assert provider_name() == "aws"
    monkeypatch.delenv("TRAINWISE_PROVIDER")
    assert provider_name() == "emulated"
    with pytest.raises(ValueError, match="TRAINWISE_PROVIDER='gcp'.*emulated, aws"):
        provider_name("gcp")


def test_a_run_session_places_a_launch_without_a_zone_in_the_region(moto_url, aws_env, tmp_path):
    """`provider.zones` is a property on aws as on every provider: a GangSession whose
    allocation names no zone takes the region's first zone from EC2 (it failed before)."""
    from trainwise import gang

    provider = _provider(moto_url)
    assert ZONE in provider.zones and all(z.startswith(REGION) for z in provider.zones)
    session = gang.GangSession(provider, gang.Allocation(market="on_demand", nodes=1,
                                                         reason="test", source="request"),
                               "p3.2xlarge", tmp_path / "run", "aws-zone", region=REGION)
    assert session.allocation.zone == provider.zones[0]
