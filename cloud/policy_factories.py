"""The table behind the allocation-policy registry: name -> factory, and the decorator that fills it.

Imports nothing of ours but the controllers' types, so a module of policies imports this one and
decorates its classes (`@register_policy("on_demand")`), and `cloud/policy_registry.py` imports
those modules: registration runs in one direction, never back (as stable-baselines3 and SkyPilot
register theirs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from controllers.allocation_types import AllocationPolicy

PolicyFactory = Callable[..., AllocationPolicy]
Factory = TypeVar("Factory", bound=PolicyFactory)

# Insertion order is the order `policy_names` lists them in (built-ins first).
_FACTORIES: dict[str, PolicyFactory] = {}


def register_policy(name: str, factory: Factory | None = None, replace: bool = False):
    """Make `factory(**kwargs)` available as `name`; refuses to overwrite unless `replace`.

    As a decorator, `@register_policy(name)` registers the class (or function) below it and
    returns it unchanged; called with a factory, it registers that factory and returns it.
    """
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"policy name {name!r} must be a non-empty snake_case word")

    def register(target: Factory) -> Factory:
        if name in _FACTORIES and not replace:
            raise ValueError(f"policy {name!r} is already registered; pass replace=True to "
                             "override")
        _FACTORIES[name] = target
        return target

    return register if factory is None else register(factory)


def registered_names() -> tuple[str, ...]:
    """Every registered name, in registration order."""
    return tuple(_FACTORIES)


def factory_of(name: str) -> PolicyFactory | None:
    return _FACTORIES.get(name)
