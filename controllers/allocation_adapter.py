"""Put a node allocation policy (`AllocationObservation -> AllocationAction`, e.g. the
`TrainwiseAllocationPolicy`) into the slow layer's allocation slot
(`HeuristicSlowPolicy(allocation_policy=...)`, which calls `act(SlowObservation)`).

The slow observation carries the allocation observation in `SlowObservation.market` (filled by
whatever runs the cluster: the simulator, the emulated cloud, the AWS provider). The resulting
`AllocationAction` goes into `SlowAction.allocation`, so the controller's decision record holds
the allocation with its own reason and numbers next to the slow layer's.

`market=None` means "no market view this tick": the adapter returns None (keep the nodes as they
are), the slow layer's documented no-allocation action. A market of another type is a wiring
error and raises TypeError naming the fix (the controller records it and falls back).
"""

from __future__ import annotations

from controllers.allocation_types import AllocationAction, AllocationObservation, AllocationPolicy
from controllers.slow_types import SlowObservation


class SlowAllocationAdapter:
    """The slow layer's allocation policy, delegating to a node allocation policy."""

    def __init__(self, policy: AllocationPolicy) -> None:
        if not callable(getattr(policy, "act", None)):
            raise TypeError(f"policy {policy!r} has no act(observation) method")
        self.policy = policy
        self.name = getattr(policy, "name", type(policy).__name__)

    def act(self, observation: SlowObservation) -> AllocationAction | None:
        market = observation.market
        if market is None:
            return None
        if not isinstance(market, AllocationObservation):
            raise TypeError(
                f"SlowObservation.market is a {type(market).__name__}; the allocation policy "
                f"{self.name!r} needs an AllocationObservation there (or None to keep the nodes)"
            )
        return self.policy.act(market)
