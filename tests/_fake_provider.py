"""`steady`: a compute provider of the tests' own, outside `cloud/providers/`, registered only by
naming this module in TRAINWISE_PROVIDER_MODULES (tests/test_provider_registry.py).

A cloud whose nodes run from the moment they are launched until they are terminated: no boot, no
spot market, no reclaims. It sells on-demand nodes only, at its own price list (its price
source, not AWS's), and bills the base billing rule: node-seconds from launch to termination on
its clock (monotonic seconds since the provider object was made) x the node's price per hour.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cloud.providers.base import (
    ON_DEMAND,
    ComputeProvider,
    LaunchFailedError,
    NodeEvent,
    NodeHandle,
    NodeState,
    NodeStatus,
    SpotPricePoint,
    UnknownInstanceTypeError,
    UnknownZoneError,
    check_count,
    check_market,
)
from cloud.providers.registry import register_provider

NAME = "steady"
ZONES = ("steady-central-1a", "steady-central-1b")
# USD per on-demand node-hour: this cloud's own list, deliberately unlike AWS's.
PRICES_USD_PER_HOUR = {"p3.2xlarge": 2.0, "g5.xlarge": 0.75}


@dataclass
class _Node:
    handle: NodeHandle
    launched_at_s: float
    ended_at_s: float | None = None
    reason: str = ""

    @property
    def state(self) -> NodeState:
        return NodeState.RUNNING if self.ended_at_s is None else NodeState.TERMINATED


@register_provider(NAME)
class SteadyProvider(ComputeProvider):
    name = NAME

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._start_s = clock()
        self._nodes: dict[str, _Node] = {}
        self._events: list[NodeEvent] = []
        self._serial = 0

    @classmethod
    def for_run(cls, instance_type: str, region: str, **options: Any) -> SteadyProvider:
        # One price list for every region: nothing to choose; the launch checks the type.
        return cls(**options)

    # -- lookups ------------------------------------------------------------------------------
    @property
    def zones(self) -> tuple[str, ...]:
        return ZONES

    def now_s(self) -> float:
        return self.clock() - self._start_s

    def price_usd_per_hour(self, instance_type: str, zone: str, market: str) -> float:
        check_market(market)
        if zone not in ZONES:
            raise UnknownZoneError(self.name, zone, ZONES)
        if instance_type not in PRICES_USD_PER_HOUR:
            raise UnknownInstanceTypeError(self.name, instance_type, tuple(PRICES_USD_PER_HOUR),
                                           "the steady price list")
        if market != ON_DEMAND:
            raise LaunchFailedError(self.name, zone, instance_type, market, 1,
                                    "steady sells on-demand nodes only; launch on_demand")
        return PRICES_USD_PER_HOUR[instance_type]

    def _node(self, node: NodeHandle) -> _Node:
        if node.node_id not in self._nodes:
            raise KeyError(f"node {node.node_id!r} was not launched by this steady provider")
        return self._nodes[node.node_id]

    # -- the interface ------------------------------------------------------------------------
    def launch(self, zone: str, instance_type: str, market: str, count: int = 1
               ) -> list[NodeHandle]:
        check_count(count)
        try:
            price = self.price_usd_per_hour(instance_type, zone, market)
        except LaunchFailedError as refused:  # name the whole request, not one node
            raise LaunchFailedError(self.name, zone, instance_type, market, count,
                                    refused.reason) from None
        now, handles = self.now_s(), []
        for _ in range(count):
            self._serial += 1
            handle = NodeHandle(f"steady-{self._serial:04d}", self.name, zone, instance_type,
                                market, price)
            self._nodes[handle.node_id] = _Node(handle, now)
            self._events.append(NodeEvent(handle.node_id, NodeState.RUNNING, now, "launched"))
            handles.append(handle)
        return handles

    def terminate(self, node: NodeHandle, reason: str = "released") -> None:
        record = self._node(node)
        if record.ended_at_s is not None:
            return
        record.ended_at_s, record.reason = self.now_s(), reason
        self._events.append(NodeEvent(node.node_id, NodeState.TERMINATED, record.ended_at_s,
                                      reason))

    def describe(self, node: NodeHandle) -> NodeStatus:
        record = self._node(node)
        return NodeStatus(record.handle, record.state, record.launched_at_s, None,
                          record.ended_at_s, record.reason)

    def spot_price_history(self, zone: str, instance_type: str, start_s: float, end_s: float
                           ) -> list[SpotPricePoint]:
        """No spot market: no points, for a zone and type it knows."""
        self.price_usd_per_hour(instance_type, zone, ON_DEMAND)
        if end_s < start_s:
            raise ValueError(f"end_s={end_s} is before start_s={start_s}")
        return []

    def poll_events(self) -> list[NodeEvent]:
        events, self._events = sorted(self._events, key=lambda e: e.at_s), []
        return events

    def nodes(self) -> list[NodeHandle]:
        return [record.handle for record in self._nodes.values()]
