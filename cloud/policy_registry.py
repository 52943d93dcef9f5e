"""One registry of node allocation policies: a config string becomes a policy object.

Policies register with the `@register_policy(name)` decorator of `cloud/policy_factories.py`, in
one direction: a module of policies imports the decorator, and this module imports those modules
(the built-in peers of `cloud/policies.py`, in their file's order), then adds trainwise's own
heuristic. An unknown name lists the valid ones (as SkyPilot's recovery-strategy registry does).
"""

from __future__ import annotations

import cloud.policies  # noqa: F401  (the built-in peers register on import)
from cloud.policy_factories import PolicyFactory, factory_of, register_policy, registered_names
from controllers.allocation_heuristic import TrainwiseAllocationPolicy
from controllers.allocation_types import AllocationPolicy

__all__ = ["PolicyFactory", "make_policy", "policy_names", "register_policy"]

# trainwise's own hazard-aware heuristic, after the peers (factory kwargs: risk_model, config; the
# cost suite passes a model fitted before each window). Registered here because controllers/
# never imports cloud/.
register_policy("trainwise_heuristic", TrainwiseAllocationPolicy)


def policy_names() -> tuple[str, ...]:
    """Registered names, built-ins first in registration order."""
    return registered_names()


def make_policy(name: str, **kwargs: object) -> AllocationPolicy:
    """A new policy object by name; unknown names list the valid ones."""
    factory = factory_of(name)
    if factory is None:
        raise ValueError(f"unknown allocation policy {name!r}; valid: "
                         f"{', '.join(registered_names())}")
    return factory(**kwargs)
