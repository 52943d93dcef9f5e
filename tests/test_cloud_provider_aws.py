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
from tests.test_run_path_faults import (  # noqa: F401 - fixtures used by name
    built_state,
    state,
)

pytestmark = pytest.mark.integration
REGION, ZONE = "us-east-1", "us-east-1a"
SECRET = "testing-secret-never-logged"


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    with servers.moto(tmp_path_factory.mktemp("moto")) as url:
        yield url


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


# --- issue 27 item 2: what a run's node boots with ----------------------------------------------
LAUNCH_SETTINGS = ("TRAINWISE_EC2_IMAGE_ID", "TRAINWISE_EC2_IMAGE_PARAMETER",
                   "TRAINWISE_EC2_INSTANCE_PROFILE", "TRAINWISE_EC2_SUBNET_IDS",
                   "TRAINWISE_EC2_SECURITY_GROUP_IDS", "TRAINWISE_EC2_TAGS",
                   "TRAINWISE_EC2_AGENT_COMMAND")
ACCESS_KEY_ID = "AKIATESTNEVERINUSERDATA"
STATE_KEY = "ab" * 32


def _no_launch_settings(monkeypatch):
    for name in LAUNCH_SETTINGS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def network(moto_url):
    """A VPC with a subnet in ZONE and one in us-east-1b, a security group and an instance
    profile, made in moto for this test (unique names: the server is shared by the module)."""
    import uuid

    ec2 = boto3.client("ec2", endpoint_url=moto_url, region_name=REGION)
    iam = boto3.client("iam", endpoint_url=moto_url, region_name=REGION)
    vpc = ec2.create_vpc(CidrBlock="10.7.0.0/16")["Vpc"]["VpcId"]
    subnets = {zone: ec2.create_subnet(VpcId=vpc, CidrBlock=cidr,
                                       AvailabilityZone=zone)["Subnet"]["SubnetId"]
               for zone, cidr in ((ZONE, "10.7.1.0/24"), ("us-east-1b", "10.7.2.0/24"))}
    group = ec2.create_security_group(GroupName=f"trainwise-{uuid.uuid4().hex[:8]}",
                                      Description="trainwise gang", VpcId=vpc)["GroupId"]
    profile = iam.create_instance_profile(
        InstanceProfileName=f"trainwise-node-{uuid.uuid4().hex[:8]}")["InstanceProfile"]
    image = ec2.describe_images()["Images"][0]["ImageId"]
    return {"subnets": subnets, "group": group, "profile": profile, "image": image}


def _set_launch_settings(monkeypatch, network, moto_url):
    monkeypatch.setenv("TRAINWISE_EC2_ENDPOINT_URL", moto_url)
    monkeypatch.setenv("TRAINWISE_EC2_IMAGE_ID", network["image"])
    monkeypatch.delenv("TRAINWISE_EC2_IMAGE_PARAMETER", raising=False)
    monkeypatch.setenv("TRAINWISE_EC2_INSTANCE_PROFILE", network["profile"]["InstanceProfileName"])
    monkeypatch.setenv("TRAINWISE_EC2_SUBNET_IDS", ",".join(network["subnets"].values()))
    monkeypatch.setenv("TRAINWISE_EC2_SECURITY_GROUP_IDS", network["group"])
    monkeypatch.setenv("TRAINWISE_EC2_TAGS", "team=vision, cost-center=ml 42")
    monkeypatch.delenv("TRAINWISE_EC2_AGENT_COMMAND", raising=False)


class Recording:
    """The moto client, keeping the arguments of each run_instances call."""

    def __init__(self, client) -> None:
        self.client, self.run_requests = client, []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def run_instances(self, **kwargs):
        self.run_requests.append(kwargs)
        return self.client.run_instances(**kwargs)


def _user_data(url, instance_id) -> str:
    import base64

    ec2 = boto3.client("ec2", endpoint_url=url, region_name=REGION)
    answer = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return base64.b64decode(answer["UserData"].get("Value", "")).decode("utf-8")


def _live_instance_ids(url) -> set[str]:
    ec2 = boto3.client("ec2", endpoint_url=url, region_name=REGION)
    return {i["InstanceId"] for r in ec2.describe_instances()["Reservations"]
            for i in r["Instances"] if i["State"]["Name"] in ("pending", "running")}


def _bash_syntax_ok(script: str, tmp_path) -> None:
    import subprocess

    path = tmp_path / "user-data.sh"
    path.write_text(script)
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_a_run_node_boots_the_agent_in_its_subnet_with_the_profile_and_groups(
        moto_url, aws_env, network, monkeypatch, tmp_path):
    import shlex

    from trainwise import gang

    _set_launch_settings(monkeypatch, network, moto_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("TRAINWISE_STATE_KEY", STATE_KEY)
    client = Recording(boto3.client("ec2", endpoint_url=moto_url, region_name=REGION))
    provider = gang.provider_for_run("p3.2xlarge", REGION, "aws", run_id="run-7",
                                     store_root="/mnt/trainwise store", job="blobs",
                                     client=client)
    # Runs go only to zones with a subnet: the session's default zone is one of them.
    assert provider.zones == (ZONE, "us-east-1b")
    nodes = provider.launch("us-east-1b", "p3.2xlarge", "spot", 2)
    # One request for the gang, every node with the profile. moto associates a profile with the
    # first instance of a reservation only (its responses/instances.py), EC2 with each.
    [request] = client.run_requests
    assert request["IamInstanceProfile"] == {"Name": network["profile"]["InstanceProfileName"]}
    assert _ec2_instance(moto_url, nodes[0].node_id)["IamInstanceProfile"]["Arn"] == \
        network["profile"]["Arn"]
    for node in nodes:
        ec2 = _ec2_instance(moto_url, node.node_id)
        assert ec2["SubnetId"] == network["subnets"]["us-east-1b"]
        assert [g["GroupId"] for g in ec2["SecurityGroups"]] == [network["group"]]
        tags = {t["Key"]: t["Value"] for t in ec2["Tags"]}
        assert tags == {"trainwise:node": "1", "trainwise:run": "run-7", "team": "vision",
                        "cost-center": "ml 42"}
        script = _user_data(moto_url, node.node_id)
        assert script.startswith("#!/bin/bash\n")
        _bash_syntax_ok(script, tmp_path)
        assert "export TRAINWISE_AGENT_METADATA=ec2\n" in script
        [exec_line] = [line for line in script.splitlines() if line.startswith("exec ")]
        assert shlex.split(exec_line)[1:12] == [
            "python3", "-m", "trainwise.agent", "--store", "/mnt/trainwise store",
            "--run-id", "run-7", "--job", "blobs", "--run-dir",
            "/var/lib/trainwise/agent_runs/run-7"]
        assert exec_line.endswith(">>/var/log/trainwise/agent-run-7.log 2>&1")
        # Credentials come from the instance profile: none in the user-data, whatever the
        # launching process holds.
        for secret in (SECRET, ACCESS_KEY_ID, STATE_KEY):
            assert secret not in script
    # A zone without a subnet is refused before run_instances: nothing more is launched.
    before = _live_instance_ids(moto_url)
    with pytest.raises(ValueError, match=r"TRAINWISE_EC2_SUBNET_IDS has no subnet in zone "
                                         r"us-east-1c.*us-east-1a, us-east-1b"):
        provider.launch("us-east-1c", "p3.2xlarge", "on_demand", 1)
    assert _live_instance_ids(moto_url) == before
    for node in nodes:
        provider.terminate(node)


def test_a_bare_provider_sends_no_user_data(moto_url, aws_env):
    provider = _provider(moto_url)
    (node,) = provider.launch(ZONE, "p3.2xlarge", "on_demand", 1)
    assert _user_data(moto_url, node.node_id) == ""
    tags = {t["Key"]: t["Value"] for t in _ec2_instance(moto_url, node.node_id)["Tags"]}
    assert tags == {"trainwise:node": "1"}
    provider.terminate(node)


def test_the_ami_can_come_from_an_ssm_parameter(moto_url, aws_env):
    import uuid

    ec2 = boto3.client("ec2", endpoint_url=moto_url, region_name=REGION)
    ssm = boto3.client("ssm", endpoint_url=moto_url, region_name=REGION)
    image = ec2.describe_images()["Images"][-1]["ImageId"]
    name = f"/trainwise/node-ami-{uuid.uuid4().hex[:8]}"
    ssm.put_parameter(Name=name, Value=image, Type="String")
    provider = make_provider("aws", region=REGION, endpoint_url=moto_url, image_parameter=name)
    (node,) = provider.launch(ZONE, "p3.2xlarge", "on_demand", 1)
    assert _ec2_instance(moto_url, node.node_id)["ImageId"] == image
    provider.terminate(node)
    before = _live_instance_ids(moto_url)
    missing = make_provider("aws", region=REGION, endpoint_url=moto_url,
                            image_parameter=f"{name}-gone")
    with pytest.raises(ValueError, match=r"TRAINWISE_EC2_IMAGE_PARAMETER=.*-gone.*ParameterNotFound"):
        missing.launch(ZONE, "p3.2xlarge", "on_demand", 1)
    assert _live_instance_ids(moto_url) == before and missing.nodes() == []


def test_preflight_names_every_missing_launch_setting_at_once(monkeypatch):
    _no_launch_settings(monkeypatch)
    monkeypatch.delenv("TRAINWISE_EC2_ENDPOINT_URL", raising=False)
    with pytest.raises(ValueError) as caught:
        AwsProvider.preflight()
    text = str(caught.value)
    assert "4 settings to fix (nothing was launched)" in text
    for setting, use in (("TRAINWISE_EC2_IMAGE_ID", "the AMI the nodes boot"),
                         ("TRAINWISE_EC2_INSTANCE_PROFILE", "IAM instance profile"),
                         ("TRAINWISE_EC2_SUBNET_IDS", "subnets the nodes are launched in"),
                         ("TRAINWISE_EC2_SECURITY_GROUP_IDS", "security groups of the nodes")):
        [line] = [line for line in text.splitlines() if f"- {setting} is empty" in line]
        assert use in line
    # Malformed values are named with the form they must have, all at once too.
    monkeypatch.setenv("TRAINWISE_EC2_IMAGE_ID", "ami-0abc1234")
    monkeypatch.setenv("TRAINWISE_EC2_IMAGE_PARAMETER", "/trainwise/ami")
    monkeypatch.setenv("TRAINWISE_EC2_INSTANCE_PROFILE", "node role")
    monkeypatch.setenv("TRAINWISE_EC2_SUBNET_IDS", "subnet-0123456789abcdef0,subnet-XYZ")
    monkeypatch.setenv("TRAINWISE_EC2_SECURITY_GROUP_IDS", "default")
    monkeypatch.setenv("TRAINWISE_EC2_TAGS", "aws:owner=me")
    monkeypatch.setenv("TRAINWISE_EC2_AGENT_COMMAND", "python3 -m 'trainwise.agent")
    with pytest.raises(ValueError) as caught:
        AwsProvider.preflight()
    text = str(caught.value)
    assert "6 settings to fix" in text
    for named in ("TRAINWISE_EC2_IMAGE_ID and TRAINWISE_EC2_IMAGE_PARAMETER are both set",
                  "TRAINWISE_EC2_INSTANCE_PROFILE='node role'", "'subnet-XYZ'",
                  "TRAINWISE_EC2_SECURITY_GROUP_IDS has 'default'", "key 'aws:owner' is reserved",
                  "TRAINWISE_EC2_AGENT_COMMAND="):
        assert named in text
    assert "subnet-0123456789abcdef0" not in text, "only the bad subnet is named"


def test_the_run_path_refuses_missing_settings_before_any_node_is_launched(
        moto_url, aws_env, network, monkeypatch, state):  # noqa: F811 - the fixture
    """Through the train job's driver: the AMI is given (a launch could happen), the rest is
    not; the preflight refuses the run and EC2 holds no new instance."""
    from tests.test_run_path_faults import request, run
    from trainwise import preflight

    _no_launch_settings(monkeypatch)
    monkeypatch.setenv("TRAINWISE_PROVIDER", "aws")
    monkeypatch.setenv("TRAINWISE_EC2_ENDPOINT_URL", moto_url)
    monkeypatch.setenv("TRAINWISE_EC2_IMAGE_ID", network["image"])
    before = _live_instance_ids(moto_url)
    with pytest.raises(preflight.PreflightError) as caught:
        run(state, request(zone=ZONE))
    [problem] = caught.value.problems
    assert problem.startswith("compute provider: TRAINWISE_PROVIDER='aws' cannot launch a node")
    for setting in ("TRAINWISE_EC2_INSTANCE_PROFILE", "TRAINWISE_EC2_SUBNET_IDS",
                    "TRAINWISE_EC2_SECURITY_GROUP_IDS"):
        assert setting in problem
    assert "TRAINWISE_EC2_IMAGE_ID" not in problem
    assert _live_instance_ids(moto_url) == before, "nothing was launched"
    assert not (state / "runs" / "run-a" / "telemetry").exists(), "nothing trained"


def test_for_run_refuses_half_an_agent_and_a_bad_run_before_any_launch(monkeypatch):
    _no_launch_settings(monkeypatch)
    with pytest.raises(ValueError, match="both run_id and store_root"):
        AwsProvider.for_run("p3.2xlarge", REGION, run_id="run-7", client=object())
    with pytest.raises(ValueError, match="the run id"):
        AwsProvider.for_run("p3.2xlarge", REGION, run_id="run-7; reboot", store_root="/mnt/s",
                            client=object())
    with pytest.raises(ValueError, match="not an S3 location"):
        AwsProvider.for_run("p3.2xlarge", REGION, run_id="run-7", store_root="s3://B/x",
                            client=object())


# --- the user-data script on its own ------------------------------------------------------------
HOSTILE_STORE = "/mnt/a b'; touch PWNED; echo '$(touch PWNED2) `touch PWNED3` \"; touch PWNED4"


def test_the_script_runs_the_agent_command_with_exactly_its_arguments(tmp_path, monkeypatch):
    """Run the generated script under bash, with a stand-in for the agent that records its
    argv and environment: hostile characters in the store path reach it as one argument and
    run nothing."""
    import json
    import shlex
    import subprocess
    import sys

    from cloud.providers.aws_user_data import agent_user_data

    dump = tmp_path / "agent_standin.py"
    dump.write_text("import json, os, sys\n"
                    "json.dump({'argv': sys.argv[1:], 'metadata': os.environ.get("
                    "'TRAINWISE_AGENT_METADATA'), 'home': os.environ.get('TRAINWISE_HOME'), "
                    "'from_env_file': os.environ.get('FROM_ENV_FILE')}, "
                    "open(os.environ['STANDIN_OUT'], 'w'))\n")
    env_file = tmp_path / "etc" / "agent.env"
    env_file.parent.mkdir()
    env_file.write_text("FROM_ENV_FILE=yes\nTRAINWISE_AGENT_METADATA=none\n")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    script = agent_user_data("run-7", HOSTILE_STORE, "blobs",
                             agent_command=shlex.join([sys.executable, str(dump)]),
                             node_home=str(tmp_path / "home"), log_dir=str(tmp_path / "log"),
                             env_file=str(env_file))
    assert SECRET not in script
    _bash_syntax_ok(script, tmp_path)
    work = tmp_path / "cwd"
    work.mkdir()
    out = tmp_path / "standin.json"
    ran = subprocess.run(["bash", str(tmp_path / "user-data.sh")], cwd=work, text=True,
                         capture_output=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "STANDIN_OUT": str(out)})
    assert ran.returncode == 0, (ran.stdout, ran.stderr)
    seen = json.loads(out.read_text())
    assert seen["argv"] == ["--store", HOSTILE_STORE, "--run-id", "run-7", "--job", "blobs",
                            "--run-dir", f"{tmp_path}/home/agent_runs/run-7"]
    assert seen["metadata"] == "ec2", "the IMDS watcher, whatever the env file says"
    assert seen["home"] == str(tmp_path / "home") and seen["from_env_file"] == "yes"
    assert (tmp_path / "log" / "agent-run-7.log").exists()
    assert (tmp_path / "home" / "agent_runs" / "run-7").is_dir()
    assert not [p for p in tmp_path.rglob("PWNED*")], "a quoted value ran a command"


@pytest.mark.parametrize(("field", "value", "named"), [
    ("run_id", "run-7; touch PWNED", "the run id"),
    ("run_id", "$(touch PWNED)", "the run id"),
    ("run_id", "run-7\ntouch PWNED", "newline"),
    ("run_id", "", "the run id is empty"),
    ("job", "blobs\nreboot", "newline"),
    ("job", "blobs && reboot", "the job name"),
    ("store_root", "/mnt/store\nrm -rf /", "newline"),
    ("store_root", "s3://UPPER/runs", "not an S3 location"),
    ("store_root", "s3://bucket/runs; touch PWNED", "not an S3 location"),
    ("store_root", "gs://bucket/runs", "absolute folder"),
    ("store_root", "relative/store", "absolute"),
    ("agent_command", "python3 -m trainwise.agent\ntouch PWNED", "TRAINWISE_EC2_AGENT_COMMAND"),
    ("agent_command", "python3 -m 'trainwise.agent", "TRAINWISE_EC2_AGENT_COMMAND"),
])
def test_the_script_builder_refuses_what_it_cannot_carry(field, value, named):
    from cloud.providers.aws_user_data import agent_user_data

    args = {"run_id": "run-7", "store_root": "/mnt/store", "job": "blobs",
            "agent_command": "python3 -m trainwise.agent", field: value}
    with pytest.raises(ValueError, match=named):
        agent_user_data(args.pop("run_id"), args.pop("store_root"), args.pop("job"), **args)


def test_an_s3_store_reaches_the_agent_as_one_quoted_word():
    from cloud.providers.aws_user_data import agent_user_data

    script = agent_user_data("run-7", "s3://trainwise-runs/deploy-a", "blobs")
    assert "--store s3://trainwise-runs/deploy-a --run-id run-7 --job blobs" in script


def test_the_builder_accepts_the_names_the_agent_accepts():
    from cloud.providers.aws_user_data import NAME_PATTERN
    from trainwise.agent.task import _JOB_NAME

    assert NAME_PATTERN.pattern == _JOB_NAME.pattern


def test_extra_tags_parse_and_refuse_reserved_or_malformed_pairs():
    from cloud.providers.aws_launch import parse_tags

    assert parse_tags(" team=vision , owner=a@b.c ,") == {"team": "vision", "owner": "a@b.c"}
    assert parse_tags("") == {}
    for bad, named in (("team", "not a KEY=VALUE"), ("trainwise:node=0", "reserved"),
                       ("a=1,a=2", "given twice"), ("k=v;rm", "not a KEY=VALUE")):
        with pytest.raises(ValueError, match=f"TRAINWISE_EC2_TAGS.*{named}"):
            parse_tags(bad)
