"""The `aws` provider: EC2 through boto3.

- launch: `run_instances` (MinCount = MaxCount = count, so all or none), placed in the zone;
  spot through `InstanceMarketOptions` (one-time, terminate on interruption), tagged
  `trainwise:node=1` (and `trainwise:run`, the user's TRAINWISE_EC2_TAGS). With the launch
  settings (`cloud/providers/aws_launch.py`): the AMI (TRAINWISE_EC2_IMAGE_ID, or the SSM
  parameter TRAINWISE_EC2_IMAGE_PARAMETER read at the first launch), the instance profile, the
  subnet of the zone and the security groups. A provider built for a run (`for_run` with
  `run_id` and `store_root`) sends user-data that starts the node agent for that run
  (`cloud/providers/aws_user_data.py`); one built without them sends none. Refusals (no
  capacity, limits, bad AMI) raise `LaunchFailedError` with EC2's error code.
- terminate: `terminate_instances`; describe: `describe_instances` (pending -> pending, running ->
  running, shutting-down / terminated / stopped -> terminated when we asked, else reclaimed; a
  spot request `marked-for-termination` -> notice).
- tagged_instances / terminate_instances: every pending or running instance any trainwise
  launched in the region (tag `trainwise:node`), and their termination, for the clean-up of
  nodes no live run holds (`trainwise/orphan_nodes.py`).
- spot_price_history: `describe_spot_price_history`, every page; spot_prices_now: the price in
  effect now in every zone of the region, one paged call (the live slow tick's market view).
- zones are checked with `describe_availability_zones`; instance types against the price table
  (billing needs a price: `cloud/prices.py`).

Credentials come only from boto3's default chain (environment, profile, instance role); this
module never reads, logs or passes them, and the nodes' user-data carries none (the nodes get
theirs from the instance profile). `endpoint_url` points the EC2 and SSM clients at another
endpoint (moto_server on loopback in the tests). The clock is Unix seconds (`time.time`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from cloud import prices
from cloud.providers.aws_launch import (
    IMAGE_PARAMETER_SETTING,
    IMAGE_SETTING,
    SETTING_NAMES,
    SUBNETS_SETTING,
    LaunchSettings,
    instance_profile_field,
    parse_tags,
)
from cloud.providers.aws_user_data import AgentBoot
from cloud.providers.base import (
    SPOT,
    ComputeProvider,
    LaunchFailedError,
    NodeEvent,
    NodeHandle,
    NodeState,
    NodeStatus,
    ProviderUnreachableError,
    SpotPricePoint,
    UnknownInstanceTypeError,
    UnknownZoneError,
    check_count,
    check_market,
)
from cloud.providers.registry import register_provider

NAME = "aws"
ENDPOINT_SETTING = "TRAINWISE_EC2_ENDPOINT_URL"
TAG_KEY = "trainwise:node"
RUN_TAG_KEY = "trainwise:run"  # the run whose agent the node starts (absent: a bare launch)
ENDPOINT_FIX = ("check the network, or set TRAINWISE_EC2_ENDPOINT_URL to a reachable EC2 "
                "endpoint (empty for AWS itself)")
# EC2 instance states -> ours, when we did not terminate the instance ourselves.
_EC2_STATES = {"pending": NodeState.PENDING, "running": NodeState.RUNNING,
               "shutting-down": NodeState.RECLAIMED, "terminated": NodeState.RECLAIMED,
               "stopping": NodeState.RECLAIMED, "stopped": NodeState.RECLAIMED}
SPOT_NOTICE_CODES = ("marked-for-termination", "marked-for-stop", "marked-for-hibernation")


def ec2_endpoint_url() -> str | None:
    """TRAINWISE_EC2_ENDPOINT_URL, or None for AWS itself."""
    from trainwise import settings

    return settings.get(ENDPOINT_SETTING).strip() or None


def check_endpoint_url(url: str | None) -> None:
    """An EC2 endpoint override is an http(s) URL with a host (None: AWS itself)."""
    if url is None:
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{ENDPOINT_SETTING}={url!r} is not an http(s) URL with a host; set it "
                         "to an EC2 endpoint such as http://127.0.0.1:5000 (moto_server), or "
                         "leave it empty for AWS itself")


def node_state(ec2_state: str, terminated_by_us: bool, spot_status_code: str | None) -> NodeState:
    """Our state of an instance from EC2's state name, who ended it, and its spot request."""
    if ec2_state not in _EC2_STATES:
        raise ValueError(f"unknown EC2 instance state {ec2_state!r}; known: "
                         f"{', '.join(_EC2_STATES)}")
    state = _EC2_STATES[ec2_state]
    if state == NodeState.RECLAIMED and terminated_by_us:
        return NodeState.TERMINATED
    if state == NodeState.RUNNING and spot_status_code in SPOT_NOTICE_CODES:
        return NodeState.NOTICE
    return state


@dataclass(frozen=True)
class TaggedInstance:
    """An instance trainwise launched (tag `trainwise:node`), as EC2 describes it."""

    instance_id: str
    zone: str
    instance_type: str
    state: str  # EC2's: pending or running
    launched_at_s: float  # Unix seconds
    run_id: str  # the `trainwise:run` tag; "" for a node the in-process engine launched


@dataclass
class _Node:
    handle: NodeHandle
    launched_at_s: float
    spot_request_id: str | None = None
    terminated_at_s: float | None = None
    terminate_reason: str = ""
    state: NodeState = NodeState.PENDING
    notice_at_s: float | None = None
    ended_at_s: float | None = None


@register_provider(NAME)
class AwsProvider(ComputeProvider):
    name = NAME
    setting_names = (ENDPOINT_SETTING, *SETTING_NAMES)
    boots_node_agent = True

    @classmethod
    def for_run(cls, instance_type: str, region: str, *, run_id: str | None = None,
                store_root: str | None = None, job: str | None = None,
                **options: Any) -> AwsProvider:
        """A training run's provider: EC2 in `region` at TRAINWISE_EC2_ENDPOINT_URL, launching
        with the launch settings (TRAINWISE_EC2_*), each unless given in `options` (which go to
        `AwsProvider`). With `run_id` and `store_root` (and optionally `job`) its nodes boot
        the node agent for that run; a bad value raises ValueError here, before any launch."""
        launch = LaunchSettings.from_settings()
        options.setdefault("endpoint_url", ec2_endpoint_url())
        for key, value in (("image_id", launch.image_id or None),
                           ("image_parameter", launch.image_parameter or None),
                           ("instance_profile", launch.instance_profile or None),
                           ("subnet_ids", launch.subnet_ids),
                           ("security_group_ids", launch.security_group_ids),
                           ("tags", parse_tags(launch.tags))):
            options.setdefault(key, value)
        if (run_id, store_root, job) != (None, None, None):
            if run_id is None or store_root is None:
                raise ValueError("the aws provider starts a node agent only with both run_id "
                                 "and store_root; give both, or neither for bare nodes")
            options["agent"] = AgentBoot(run_id, store_root, job, launch.agent_command)
        return cls(region, **options)

    @classmethod
    def preflight(cls) -> None:
        """boto3 is installed, the endpoint override, if any, is a URL, and every launch
        setting a node needs is given and well formed: one ValueError lists all that are not,
        so a user fixes them in one go, before any node is billed (no AWS call: an unreachable
        endpoint or an id that does not exist is found at the first launch, still before any
        step)."""
        problems = []
        try:
            check_endpoint_url(ec2_endpoint_url())
        except ValueError as error:
            problems.append(str(error))
        try:
            import boto3  # noqa: F401
        except ImportError as error:
            problems.append(f"TRAINWISE_PROVIDER='aws' needs boto3 ({error}); install it or "
                            "choose another provider")
        problems += LaunchSettings.from_settings().problems()
        if len(problems) == 1:
            raise ValueError(problems[0])
        if problems:
            listed = "\n".join(f"    - {p}" for p in problems)
            raise ValueError(f"TRAINWISE_PROVIDER='aws' cannot launch a node: {len(problems)} "
                             f"settings to fix (nothing was launched):\n{listed}")

    def __init__(self, region: str, *, endpoint_url: str | None = None,
                 image_id: str | None = None, image_parameter: str | None = None,
                 instance_profile: str | None = None, subnet_ids: tuple[str, ...] = (),
                 security_group_ids: tuple[str, ...] = (), tags: dict[str, str] | None = None,
                 agent: AgentBoot | None = None, client: Any = None, ssm_client: Any = None,
                 clock: Callable[[], float] = time.time, connect_timeout_s: float = 5.0) -> None:
        from botocore.config import Config

        self.region = region
        self.endpoint_url = endpoint_url
        self.image_id = image_id
        self.image_parameter = image_parameter
        self.instance_profile = instance_profile
        self.subnet_ids = tuple(subnet_ids)
        self.security_group_ids = tuple(security_group_ids)
        self.tags = dict(tags or {})
        self.agent = agent
        self.clock = clock
        self._config = Config(connect_timeout=connect_timeout_s, read_timeout=30,
                              retries={"max_attempts": 2, "mode": "standard"})
        self.client = client or self._boto_client("ec2")
        self._ssm_client = ssm_client
        self._nodes: dict[str, _Node] = {}
        self._zones: tuple[str, ...] | None = None
        self._subnet_by_zone: dict[str, str] | None = None

    # -- plumbing -----------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return self.endpoint_url or f"EC2 {self.region}"

    def _boto_client(self, service: str) -> Any:
        import boto3

        return boto3.client(service, region_name=self.region, endpoint_url=self.endpoint_url,
                            config=self._config)

    def _call(self, operation: str, **kwargs: Any) -> Any:
        """One EC2 call; a connection failure becomes ProviderUnreachableError."""
        return self._call_on(self.client, operation, **kwargs)

    def _call_on(self, client: Any, operation: str, **kwargs: Any) -> Any:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import NoCredentialsError

        try:
            return getattr(client, operation)(**kwargs)
        except BotoConnectionError as error:
            raise ProviderUnreachableError(self.name, self.endpoint, error, ENDPOINT_FIX) from None
        except NoCredentialsError as error:
            raise ProviderUnreachableError(
                self.name, self.endpoint, error,
                "give credentials through boto3's chain (AWS_PROFILE, environment, or an "
                "instance role)") from None

    def now_s(self) -> float:
        return float(self.clock())

    @property
    def zones(self) -> tuple[str, ...]:
        """The zones a node can be launched in: the region's (asked of EC2 once), only those
        with a subnet when subnets are given. A property, as on every provider: the run's
        session reads `provider.zones` to place a launch without a zone (it called this method's
        bound object a list of zones before, and the train job could not launch on aws)."""
        if not self.subnet_ids:
            return self._region_zones()
        return tuple(z for z in self._region_zones() if z in self._subnets())

    def _region_zones(self) -> tuple[str, ...]:
        if self._zones is None:
            answer = self._call("describe_availability_zones")
            self._zones = tuple(z["ZoneName"] for z in answer["AvailabilityZones"])
        return self._zones

    def _check(self, zone: str, instance_type: str) -> None:
        if zone not in self._region_zones():
            raise UnknownZoneError(self.name, zone, self._region_zones())
        if instance_type not in prices.INSTANCE_TYPES:
            raise UnknownInstanceTypeError(self.name, instance_type, tuple(prices.INSTANCE_TYPES),
                                           "the price table (cloud/prices.py)")

    def _node(self, node: NodeHandle) -> _Node:
        if node.node_id not in self._nodes:
            raise KeyError(f"instance {node.node_id!r} was not launched by this aws provider")
        return self._nodes[node.node_id]

    # -- the interface ------------------------------------------------------------------------
    def launch(self, zone: str, instance_type: str, market: str, count: int = 1
               ) -> list[NodeHandle]:
        from botocore.exceptions import ClientError

        check_market(market)
        check_count(count)
        self._check(zone, instance_type)
        # Each of these raises before run_instances: nothing is billed for a bad setting.
        image_id, subnet_id = self._image(), self._subnet_for(zone)
        price = self.price_usd_per_hour(instance_type, zone, market)
        request = self._run_request(image_id, instance_type, zone, count, subnet_id)
        if market == SPOT:
            request["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time",
                                "InstanceInterruptionBehavior": "terminate"}}
        try:
            answer = self._call("run_instances", **request)
        except ClientError as error:
            info = error.response.get("Error", {})
            raise LaunchFailedError(self.name, zone, instance_type, market, count,
                                    f"{info.get('Code')}: {info.get('Message')}") from None
        handles = []
        for instance in answer["Instances"]:
            launched = instance.get("LaunchTime")
            handle = NodeHandle(instance["InstanceId"], self.name, zone, instance_type, market,
                                price)
            self._nodes[handle.node_id] = _Node(
                handle, launched.timestamp() if launched is not None else self.now_s(),
                instance.get("SpotInstanceRequestId"))
            handles.append(handle)
        return handles

    def _run_request(self, image_id: str, instance_type: str, zone: str, count: int,
                     subnet_id: str | None) -> dict[str, Any]:
        """run_instances' arguments, less the market: the launch settings given, and the agent's
        user-data for a run's provider (boto3 base64-encodes it)."""
        tags = [{"Key": TAG_KEY, "Value": "1"}, *({"Key": k, "Value": v}
                                                   for k, v in self.tags.items())]
        request: dict[str, Any] = {
            "ImageId": image_id, "InstanceType": instance_type, "MinCount": count,
            "MaxCount": count, "Placement": {"AvailabilityZone": zone}}
        if self.agent is not None:
            tags.append({"Key": RUN_TAG_KEY, "Value": self.agent.run_id})
            request["UserData"] = self.agent.user_data()
        request["TagSpecifications"] = [{"ResourceType": "instance", "Tags": tags}]
        if self.instance_profile:
            request["IamInstanceProfile"] = instance_profile_field(self.instance_profile)
        if subnet_id:
            request["SubnetId"] = subnet_id
        if self.security_group_ids:
            request["SecurityGroupIds"] = list(self.security_group_ids)
        return request

    def _image(self) -> str:
        """The AMI: image_id, else the value of the SSM parameter (read once)."""
        if not self.image_id and self.image_parameter:
            self.image_id = self._image_from_parameter(self.image_parameter)
        if not self.image_id:
            raise ValueError(f"no AMI to launch: set {IMAGE_SETTING} to the AMI (with trainwise "
                             f"installed) of region {self.region}, or {IMAGE_PARAMETER_SETTING} "
                             "to an SSM parameter that holds its id")
        return self.image_id

    def _image_from_parameter(self, name: str) -> str:
        from botocore.exceptions import ClientError

        if self._ssm_client is None:
            self._ssm_client = self._boto_client("ssm")
        try:
            answer = self._call_on(self._ssm_client, "get_parameter", Name=name)
        except ClientError as error:
            info = error.response.get("Error", {})
            raise ValueError(f"{IMAGE_PARAMETER_SETTING}={name!r} cannot be read from SSM in "
                             f"{self.region} ({info.get('Code')}: {info.get('Message')}); name "
                             "a parameter that exists there and that the caller may read") from None
        value = str(answer["Parameter"]["Value"]).strip()
        if not value.startswith("ami-"):
            raise ValueError(f"{IMAGE_PARAMETER_SETTING}={name!r} holds {value[:40]!r}, not an "
                             "AMI id (ami-...); name a parameter whose value is an AMI id")
        return value

    def _subnets(self) -> dict[str, str]:
        """zone -> subnet of `subnet_ids`, asked of EC2 once; an unknown subnet or two in one
        zone raise ValueError naming the setting."""
        from botocore.exceptions import ClientError

        if self._subnet_by_zone is None:
            try:
                answer = self._call("describe_subnets", SubnetIds=list(self.subnet_ids))
            except ClientError as error:
                info = error.response.get("Error", {})
                raise ValueError(f"{SUBNETS_SETTING}: EC2 in {self.region} refuses "
                                 f"{', '.join(self.subnet_ids)} ({info.get('Code')}: "
                                 f"{info.get('Message')}); give subnets of this region") from None
            by_zone: dict[str, str] = {}
            for subnet in answer["Subnets"]:
                zone = subnet["AvailabilityZone"]
                if zone in by_zone:
                    raise ValueError(f"{SUBNETS_SETTING} has two subnets in zone {zone} "
                                     f"({by_zone[zone]}, {subnet['SubnetId']}); give one per "
                                     "zone")
                by_zone[zone] = subnet["SubnetId"]
            self._subnet_by_zone = by_zone
        return self._subnet_by_zone

    def _subnet_for(self, zone: str) -> str | None:
        """The subnet to launch in `zone` (None: no subnets given, EC2's default VPC)."""
        if not self.subnet_ids:
            return None
        subnets = self._subnets()
        if zone not in subnets:
            raise ValueError(f"{SUBNETS_SETTING} has no subnet in zone {zone} (its subnets are "
                             f"in {', '.join(sorted(subnets)) or 'no zone'}); add a subnet of "
                             f"{zone}, or place the run in one of those zones")
        return subnets[zone]

    def terminate(self, node: NodeHandle, reason: str = "released") -> None:
        record = self._node(node)
        if record.terminated_at_s is not None or record.ended_at_s is not None:
            return
        self._call("terminate_instances", InstanceIds=[node.node_id])
        record.terminated_at_s, record.terminate_reason = self.now_s(), reason
        record.state, record.ended_at_s = NodeState.TERMINATED, record.terminated_at_s

    def _refresh(self, records: list[_Node]) -> list[NodeEvent]:
        """Ask EC2 for the states of `records`; update them; return the changes."""
        live = [r for r in records if r.state.alive]
        if not live:
            return []
        answer = self._call("describe_instances", InstanceIds=[r.handle.node_id for r in live])
        by_id = {i["InstanceId"]: i for res in answer["Reservations"] for i in res["Instances"]}
        spot_ids = [r.spot_request_id for r in live if r.spot_request_id]
        spot_codes: dict[str, str] = {}
        if spot_ids:
            requests = self._call("describe_spot_instance_requests",
                                  SpotInstanceRequestIds=spot_ids)["SpotInstanceRequests"]
            spot_codes = {q["SpotInstanceRequestId"]: q.get("Status", {}).get("Code", "")
                          for q in requests}
        now, events = self.now_s(), []
        for record in live:
            instance = by_id.get(record.handle.node_id)
            if instance is None:
                continue
            state = node_state(instance["State"]["Name"], record.terminated_at_s is not None,
                               spot_codes.get(record.spot_request_id or ""))
            if state == record.state:
                continue
            record.state = state
            if state == NodeState.NOTICE:
                record.notice_at_s = now
            if not state.alive:
                record.ended_at_s = now
            reason = instance.get("StateReason", {}).get("Message", "")
            events.append(NodeEvent(record.handle.node_id, state, now, reason))
        return events

    def describe(self, node: NodeHandle) -> NodeStatus:
        record = self._node(node)
        self._refresh([record])
        return NodeStatus(record.handle, record.state, record.launched_at_s, record.notice_at_s,
                          record.ended_at_s, record.terminate_reason)

    def node_address(self, node: NodeHandle) -> str | None:
        """The instance's private IPv4 (EC2 gives it at launch; None until it has one)."""
        answer = self._call("describe_instances", InstanceIds=[self._node(node).handle.node_id])
        found = [i for res in answer["Reservations"] for i in res["Instances"]]
        return found[0].get("PrivateIpAddress") if found else None

    def poll_events(self) -> list[NodeEvent]:
        return sorted(self._refresh(list(self._nodes.values())), key=lambda e: e.at_s)

    def nodes(self) -> list[NodeHandle]:
        return [r.handle for r in self._nodes.values()]

    def node_cost_usd(self, node: NodeHandle) -> float:
        """The billing rule from what this provider saw (no describe call)."""
        record = self._node(node)
        end = record.ended_at_s if record.ended_at_s is not None else self.now_s()
        return max(0.0, end - record.launched_at_s) * node.price_usd_per_hour / 3600.0

    def spot_price_history(self, zone: str, instance_type: str, start_s: float, end_s: float
                           ) -> list[SpotPricePoint]:
        from datetime import UTC, datetime

        self._check(zone, instance_type)
        if end_s < start_s:
            raise ValueError(f"end_s={end_s} is before start_s={start_s}")
        points, token = [], None
        while True:
            kwargs: dict[str, Any] = {
                "InstanceTypes": [instance_type], "AvailabilityZone": zone,
                "StartTime": datetime.fromtimestamp(start_s, UTC),
                "EndTime": datetime.fromtimestamp(end_s, UTC)}
            if token:
                kwargs["NextToken"] = token
            answer = self._call("describe_spot_price_history", **kwargs)
            points += [SpotPricePoint(p["AvailabilityZone"], p["InstanceType"],
                                      p["Timestamp"].timestamp(), float(p["SpotPrice"]))
                       for p in answer["SpotPriceHistory"]
                       if p["AvailabilityZone"] == zone and p["InstanceType"] == instance_type]
            token = answer.get("NextToken")
            if not token:
                return sorted(points, key=lambda p: p.at_s)

    def spot_prices_now(self, instance_type: str) -> dict[str, float]:
        """{zone: USD/hour} of `instance_type`'s Linux spot price in effect now, for every zone
        of the region that lists one (a zone that does not offer the type is absent). One call
        for the region, StartTime = EndTime = now: EC2 answers each zone's price in effect then
        (its newest point may be days old when the price has not moved)."""
        from datetime import UTC, datetime

        if instance_type not in prices.INSTANCE_TYPES:
            raise UnknownInstanceTypeError(self.name, instance_type, tuple(prices.INSTANCE_TYPES),
                                           "the price table (cloud/prices.py)")
        now = datetime.fromtimestamp(self.now_s(), UTC)
        newest: dict[str, tuple[float, float]] = {}  # zone -> (timestamp, price)
        token = None
        while True:
            kwargs: dict[str, Any] = {"InstanceTypes": [instance_type], "StartTime": now,
                                      "EndTime": now}
            if token:
                kwargs["NextToken"] = token
            answer = self._call("describe_spot_price_history", **kwargs)
            for point in answer["SpotPriceHistory"]:
                # Linux only: Windows and SUSE prices of the same type are other markets' prices.
                if (point["InstanceType"] != instance_type
                        or not str(point.get("ProductDescription", "")).startswith("Linux/UNIX")):
                    continue
                at = point["Timestamp"].timestamp()
                zone = point["AvailabilityZone"]
                if zone not in newest or at > newest[zone][0]:
                    newest[zone] = (at, float(point["SpotPrice"]))
            token = answer.get("NextToken")
            if not token:
                return {zone: price for zone, (_, price) in sorted(newest.items())}

    def tagged_instances(self) -> list[TaggedInstance]:
        """Every pending or running instance in the region tagged `trainwise:node`, whoever
        launched it (this process, an earlier one that died, another code location)."""
        found, token = [], None
        while True:
            kwargs: dict[str, Any] = {"Filters": [
                {"Name": f"tag:{TAG_KEY}", "Values": ["1"]},
                {"Name": "instance-state-name", "Values": ["pending", "running"]}]}
            if token:
                kwargs["NextToken"] = token
            answer = self._call("describe_instances", **kwargs)
            for reservation in answer["Reservations"]:
                for instance in reservation["Instances"]:
                    tags = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
                    found.append(TaggedInstance(
                        instance["InstanceId"], instance["Placement"]["AvailabilityZone"],
                        instance["InstanceType"], instance["State"]["Name"],
                        instance["LaunchTime"].timestamp(), tags.get(RUN_TAG_KEY, "")))
            token = answer.get("NextToken")
            if not token:
                return sorted(found, key=lambda i: (i.launched_at_s, i.instance_id))

    def terminate_instances(self, instance_ids: list[str]) -> None:
        """Terminate instances by id, launched by this provider object or not (the clean-up of
        an earlier process's nodes); those this object launched are recorded as terminated."""
        if not instance_ids:
            return
        self._call("terminate_instances", InstanceIds=list(instance_ids))
        now = self.now_s()
        for instance_id in instance_ids:
            record = self._nodes.get(instance_id)
            if record is not None and record.ended_at_s is None:
                record.terminated_at_s, record.terminate_reason = now, "orphan clean-up"
                record.state, record.ended_at_s = NodeState.TERMINATED, now
