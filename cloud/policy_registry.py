"""One registry of node allocation policies: a config string becomes a policy object.

Built-in peers live in `cloud/policies.py` and register on import; later policies (the trainwise
heuristic, learned policies) call `register_policy` with their own factory. An unknown name
lists the valid ones (as SkyPilot's recovery-strategy registry does).
"""

from __future__ import annotations

from collections.abc import Callable

from controllers.allocation_types import AllocationPolicy

PolicyFactory = Callable[..., AllocationPolicy]

_FACTORIES: dict[str, PolicyFactory] = {}


def register_policy(name: str, factory: PolicyFactory, replace: bool = False) -> None:
    """Make `factory(**kwargs)` available as `name`; refuses to overwrite unless `replace`."""
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"policy name {name!r} must be a non-empty snake_case word")
    if name in _FACTORIES and not replace:
        raise ValueError(f"policy {name!r} is already registered; pass replace=True to override")
    _FACTORIES[name] = factory


def _ensure_builtins() -> None:
    import cloud.policies  # noqa: F401  (registers the built-in peers)

    if "trainwise_heuristic" not in _FACTORIES:
        # trainwise's own hazard-aware heuristic, after the peers (factory kwargs: risk_model,
        # config; the cost suite passes a model fitted before each window).
        from controllers.allocation_heuristic import TrainwiseAllocationPolicy

        register_policy("trainwise_heuristic", TrainwiseAllocationPolicy)


def policy_names() -> tuple[str, ...]:
    """Registered names, built-ins first in registration order."""
    _ensure_builtins()
    return tuple(_FACTORIES)


def make_policy(name: str, **kwargs: object) -> AllocationPolicy:
    """A new policy object by name; unknown names list the valid ones."""
    _ensure_builtins()
    if name not in _FACTORIES:
        raise ValueError(f"unknown allocation policy {name!r}; valid: {', '.join(_FACTORIES)}")
    return _FACTORIES[name](**kwargs)
