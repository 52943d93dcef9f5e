"""One interface for every compute provider: launch, terminate, describe, spot price history,
events (notices, reclaims) and the bill.

Time on a provider is `now_s()`, seconds on the provider's own clock: emulated seconds since the
job started for `emulated`, Unix seconds for `aws`. Every time argument and field below is on that
clock, so a caller never mixes a replayed trace's time with this machine's.

Billing rule (every provider): a node is billed per second from its launch until it ends (its
termination, or its reclaim), at its zone's spot or on-demand price from the provider's price
source (`ComputeProvider.price_usd_per_hour`; by default `cloud/prices.py` through
`node_price_usd_per_hour`). The provider's own invoice may differ (AWS rounds, and bills spot at
the market price of the hour); these figures are what the controllers compare, so every provider
uses the same rule.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from cloud import prices
from cloud.traces import region_of_zone

SPOT = "spot"
ON_DEMAND = "on_demand"
MARKETS = (SPOT, ON_DEMAND)


class NodeState(enum.StrEnum):
    PENDING = "pending"  # launched, booting (the changeover); billed
    RUNNING = "running"
    NOTICE = "notice"  # spot reclaim announced; the node is reclaimed when the notice runs out
    RECLAIMED = "reclaimed"  # taken back by the provider (spot)
    TERMINATED = "terminated"  # ended by us

    @property
    def alive(self) -> bool:
        return self in (NodeState.PENDING, NodeState.RUNNING, NodeState.NOTICE)


# -- errors: each names the input and the fix ---------------------------------------------------
class ProviderError(Exception):
    """Base of every provider error."""


class UnknownZoneError(ProviderError, ValueError):
    def __init__(self, provider: str, zone: str, known: tuple[str, ...] | list[str]) -> None:
        self.zone, self.known = zone, tuple(known)
        super().__init__(f"provider {provider!r} does not know zone {zone!r}; known zones: "
                         f"{', '.join(sorted(self.known)) or '(none)'}")


class UnknownInstanceTypeError(ProviderError, ValueError):
    def __init__(self, provider: str, instance_type: str, known: tuple[str, ...] | list[str],
                 where: str = "") -> None:
        self.instance_type, self.known = instance_type, tuple(known)
        super().__init__(f"provider {provider!r} does not offer instance type {instance_type!r}"
                         f"{' in ' + where if where else ''}; known: "
                         f"{', '.join(sorted(self.known)) or '(none)'}")


class ProviderUnreachableError(ProviderError, ConnectionError):
    def __init__(self, provider: str, endpoint: str, cause: BaseException, fix: str) -> None:
        self.endpoint = endpoint
        super().__init__(f"provider {provider!r} at {endpoint} cannot be reached "
                         f"({type(cause).__name__}: {cause}); {fix}")


class LaunchFailedError(ProviderError, RuntimeError):
    """The provider refused or could not fill a launch; nothing was started (or what was
    started was terminated again), so nothing is billed for it."""

    def __init__(self, provider: str, zone: str, instance_type: str, market: str, count: int,
                 reason: str) -> None:
        self.zone, self.instance_type, self.market, self.count = zone, instance_type, market, count
        self.reason = reason
        super().__init__(f"{provider}: launch of {count} x {instance_type} ({market}) in {zone} "
                         f"failed: {reason}")


# -- values ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeHandle:
    node_id: str
    provider: str
    zone: str
    instance_type: str
    market: str  # SPOT or ON_DEMAND
    price_usd_per_hour: float


@dataclass(frozen=True)
class NodeStatus:
    handle: NodeHandle
    state: NodeState
    launched_at_s: float
    notice_at_s: float | None
    ended_at_s: float | None  # terminated or reclaimed; None while alive
    reason: str = ""


@dataclass(frozen=True)
class NodeEvent:
    """A state change seen by `poll_events` (notice, reclaimed, running, terminated)."""

    node_id: str
    state: NodeState
    at_s: float
    detail: str = ""


@dataclass(frozen=True)
class SpotPricePoint:
    zone: str
    instance_type: str
    at_s: float
    usd_per_hour: float
    available: int | None = None  # spot nodes available (a replayed trace knows it; AWS does not)


def check_market(market: str) -> str:
    if market not in MARKETS:
        raise ValueError(f"market {market!r}: use {SPOT!r} or {ON_DEMAND!r}")
    return market


def check_count(count: int) -> int:
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"count={count!r}: launch at least 1 node")
    return count


def spot_price_usd_per_hour(instance_type: str, region: str) -> tuple[float, str]:
    """Spot USD/h from the Spot Advisor feed, else the Can't Be Late discount; and its source."""
    try:
        return prices.spot_price_from_advisor(instance_type, region), "spot advisor 2025-06"
    except (FileNotFoundError, ValueError):
        on_demand = prices.on_demand_price(instance_type, region)
        discount = 1.0 - (prices.CANT_BE_LATE_SPOT_USD_PER_HOUR
                          / prices.CANT_BE_LATE_ON_DEMAND_USD_PER_HOUR)
        return (prices.spot_price_from_discount(on_demand, discount),
                "Can't Be Late discount (advisor feed missing)")


def node_price_usd_per_hour(provider: str, instance_type: str, zone: str, market: str) -> float:
    """The zone's spot or on-demand price of `instance_type` (the billing rule's price)."""
    check_market(market)
    if instance_type not in prices.INSTANCE_TYPES:
        raise UnknownInstanceTypeError(provider, instance_type, tuple(prices.INSTANCE_TYPES),
                                       "the price table (cloud/prices.py)")
    try:
        region = region_of_zone(zone)
        on_demand = prices.on_demand_price(instance_type, region)
    except ValueError as error:
        raise UnknownZoneError(provider, zone, (), ) from error
    if market == ON_DEMAND:
        return on_demand
    return spot_price_usd_per_hour(instance_type, region)[0]


def billed_usd(status: NodeStatus, now_s: float) -> float:
    """Node-seconds from launch to its end (or now) x its price per hour."""
    end = status.ended_at_s if status.ended_at_s is not None else now_s
    return max(0.0, end - status.launched_at_s) * status.handle.price_usd_per_hour / 3600.0


class ComputeProvider(ABC):
    """What the train job needs from a cloud. Implementations register by name with
    `@register_provider` (`cloud/providers/registry.py`): `emulated`, `aws`, and any module named
    in TRAINWISE_PROVIDER_MODULES.

    Besides the node calls, a class carries what callers ask of it by name, so that adding a
    provider is one module: `for_run` (how to build one for a training run), `preflight` (cheap
    checks before a run's first step), `price_usd_per_hour` (its price source) and
    `setting_names` (the trainwise settings it reads)."""

    name: str
    # The trainwise settings (`trainwise/settings.py`) this provider reads; shown in errors and
    # checked to be documented. A provider of one's own reads its own environment instead.
    setting_names: ClassVar[tuple[str, ...]] = ()
    # True when the nodes it launches for a run boot the node agent (`for_run` with run_id,
    # store_root and job): a run's job then runs on them (`trainwise.agent_launch`), not in
    # the launching process. The emulated provider's nodes are this machine.
    boots_node_agent: ClassVar[bool] = False

    # -- what callers ask of the class --------------------------------------------------------
    @classmethod
    def for_run(cls, instance_type: str, region: str, **options: Any) -> ComputeProvider:
        """A provider for one training run of `instance_type` in `region`
        (`trainwise.gang.provider_for_run`); `options` are the provider's own (emulated: the
        trace window; aws: endpoint_url, image_id, ...). The registry refuses a class that does
        not define it."""
        raise NotImplementedError(f"provider class {cls.__qualname__} does not say how to build "
                                  "one for a run: define the classmethod for_run")

    @classmethod  # noqa: B027 - an optional hook, not abstract: most providers check nothing
    def preflight(cls) -> None:
        """Cheap checks of this provider's settings before a run's first step
        (`trainwise.preflight.check_services`); raise ValueError naming the setting and the
        fix. No network calls: an unreachable provider is found at the first launch, which also
        comes before any step is trained."""

    def price_usd_per_hour(self, instance_type: str, zone: str, market: str) -> float:
        """The billing rule's price of one node (the price source). Default: the AWS list
        price and Spot Advisor saving of `cloud/prices.py`; a provider with its own prices (a
        replayed trace, another cloud's price list) overrides this."""
        return node_price_usd_per_hour(self.name, instance_type, zone, market)

    def node_address(self, node: NodeHandle) -> str | None:
        """The address the other nodes of a gang reach `node` at (EC2: its private IPv4), for
        the rendezvous a launcher names; None where the provider gives none."""
        return None

    # -- the node calls -----------------------------------------------------------------------

    @abstractmethod
    def now_s(self) -> float:
        """The provider's clock (see the module docstring)."""

    @abstractmethod
    def launch(self, zone: str, instance_type: str, market: str, count: int = 1
               ) -> list[NodeHandle]:
        """Start `count` nodes; all or none (LaunchFailedError). Unknown zone or type: their
        errors; an unreachable provider: ProviderUnreachableError."""

    @abstractmethod
    def terminate(self, node: NodeHandle, reason: str = "released") -> None:
        """End the node (idempotent); billing stops now."""

    @abstractmethod
    def describe(self, node: NodeHandle) -> NodeStatus: ...

    def state(self, node: NodeHandle) -> NodeState:
        return self.describe(node).state

    @abstractmethod
    def spot_price_history(self, zone: str, instance_type: str, start_s: float, end_s: float
                           ) -> list[SpotPricePoint]: ...

    @abstractmethod
    def poll_events(self) -> list[NodeEvent]:
        """State changes since the last poll (notices first), in time order."""

    @abstractmethod
    def nodes(self) -> list[NodeHandle]:
        """Every node this provider object launched."""

    def node_cost_usd(self, node: NodeHandle) -> float:
        return billed_usd(self.describe(node), self.now_s())

    def bill_usd(self) -> float:
        """The billing rule over every node launched so far (open ones up to now)."""
        return sum(self.node_cost_usd(node) for node in self.nodes())
