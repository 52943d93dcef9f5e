"""The `aws` provider: EC2 through boto3.

- launch: `run_instances` (MinCount = MaxCount = count, so all or none), placed in the zone;
  spot through `InstanceMarketOptions` (one-time, terminate on interruption), tagged
  `trainwise:node=1`. Refusals (no capacity, limits, bad AMI) raise `LaunchFailedError` with
  EC2's error code.
- terminate: `terminate_instances`; describe: `describe_instances` (pending -> pending, running ->
  running, shutting-down / terminated / stopped -> terminated when we asked, else reclaimed; a
  spot request `marked-for-termination` -> notice).
- spot_price_history: `describe_spot_price_history`, every page.
- zones are checked with `describe_availability_zones`; instance types against the price table
  (billing needs a price: `cloud/prices.py`).

Credentials come only from boto3's default chain (environment, profile, instance role); this
module never reads, logs or passes them. `endpoint_url` points the client at another EC2 endpoint
(moto_server on loopback in the tests). The clock is Unix seconds (`time.time`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from cloud import prices
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
    setting_names = (ENDPOINT_SETTING,)

    @classmethod
    def for_run(cls, instance_type: str, region: str, **options: Any) -> AwsProvider:
        """A training run's provider: EC2 in `region` at TRAINWISE_EC2_ENDPOINT_URL unless
        `endpoint_url` is given; other `options` go to `AwsProvider` (image_id, client, clock,
        connect_timeout_s)."""
        options.setdefault("endpoint_url", ec2_endpoint_url())
        return cls(region, **options)

    @classmethod
    def preflight(cls) -> None:
        """boto3 is installed and the endpoint override, if any, is a URL (no EC2 call: an
        unreachable endpoint is found at the first launch, still before any step)."""
        check_endpoint_url(ec2_endpoint_url())
        try:
            import boto3  # noqa: F401
        except ImportError as error:
            raise ValueError(f"TRAINWISE_PROVIDER='aws' needs boto3 ({error}); install it or "
                             "choose another provider") from None

    def __init__(self, region: str, *, endpoint_url: str | None = None,
                 image_id: str | None = None, client: Any = None,
                 clock: Callable[[], float] = time.time, connect_timeout_s: float = 5.0) -> None:
        import boto3
        from botocore.config import Config

        self.region = region
        self.endpoint_url = endpoint_url
        self.image_id = image_id
        self.clock = clock
        self.client = client or boto3.client(
            "ec2", region_name=region, endpoint_url=endpoint_url,
            config=Config(connect_timeout=connect_timeout_s, read_timeout=30,
                          retries={"max_attempts": 2, "mode": "standard"}))
        self._nodes: dict[str, _Node] = {}
        self._zones: tuple[str, ...] | None = None

    # -- plumbing -----------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return self.endpoint_url or f"EC2 {self.region}"

    def _call(self, operation: str, **kwargs: Any) -> Any:
        """One EC2 call; a connection failure becomes ProviderUnreachableError."""
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import NoCredentialsError

        try:
            return getattr(self.client, operation)(**kwargs)
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
        """The region's zones (asked of EC2 once). A property, as on every provider: the run's
        session reads `provider.zones` to place a launch without a zone (it called this method's
        bound object a list of zones before, and the train job could not launch on aws)."""
        if self._zones is None:
            answer = self._call("describe_availability_zones")
            self._zones = tuple(z["ZoneName"] for z in answer["AvailabilityZones"])
        return self._zones

    def _check(self, zone: str, instance_type: str) -> None:
        if zone not in self.zones:
            raise UnknownZoneError(self.name, zone, self.zones)
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
        if not self.image_id:
            raise ValueError("no AMI to launch: pass image_id (setting TRAINWISE_EC2_IMAGE_ID) "
                             "with the trainer image for this region")
        price = self.price_usd_per_hour(instance_type, zone, market)
        request: dict[str, Any] = {
            "ImageId": self.image_id, "InstanceType": instance_type, "MinCount": count,
            "MaxCount": count, "Placement": {"AvailabilityZone": zone},
            "TagSpecifications": [{"ResourceType": "instance",
                                   "Tags": [{"Key": TAG_KEY, "Value": "1"}]}]}
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
