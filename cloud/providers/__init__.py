"""Compute providers behind one interface (`base.ComputeProvider`), chosen by name.

    provider = make_provider("emulated", markets=..., clock=...)   # or "aws", region=...
    provider = provider_class(provider_name()).for_run(instance_type, region)   # for a run

Each provider is one module whose class registers itself with `@register_provider(name)`
(`registry.py`); importing this package registers the built-ins, `emulated`, `aws` and `kubernetes`. A
provider of one's own is registered by naming its module in TRAINWISE_PROVIDER_MODULES.
`provider_name()` reads the TRAINWISE_PROVIDER setting (default emulated) and lists the
registered providers when the name is none of them.
"""

from __future__ import annotations

from typing import Any

# The built-ins register on import (`@register_provider` on their classes).
from cloud.providers import aws as _aws  # noqa: F401
from cloud.providers import emulated as _emulated  # noqa: F401
from cloud.providers import kubernetes_pods as _kubernetes  # noqa: F401
from cloud.providers.base import (
    MARKETS,
    ON_DEMAND,
    SPOT,
    ComputeProvider,
    LaunchFailedError,
    NodeEvent,
    NodeHandle,
    NodeState,
    NodeStatus,
    ProviderError,
    ProviderUnreachableError,
    SpotPricePoint,
    UnknownInstanceTypeError,
    UnknownZoneError,
)
from cloud.providers.registry import (
    DEFAULT_PROVIDER,
    MODULES_SETTING,
    ProviderModuleError,
    UnknownProviderError,
    load_provider_modules,
    provider_class,
    provider_name,
    provider_names,
    register_provider,
)


def make_provider(name: str | None = None, **kwargs: Any) -> ComputeProvider:
    """The provider called `name` (see `provider_name`), built with its class's own arguments
    (emulated: markets, clock, rules, or `EmulatedProvider.from_traces`; aws: region,
    endpoint_url, image_id, see `AwsProvider`). For a training run use the class's `for_run`
    (`trainwise.gang.provider_for_run`)."""
    return provider_class(provider_name(name))(**kwargs)


__all__ = [
    "DEFAULT_PROVIDER", "MARKETS", "MODULES_SETTING", "ON_DEMAND", "SPOT", "ComputeProvider",
    "LaunchFailedError", "NodeEvent", "NodeHandle", "NodeState", "NodeStatus", "ProviderError",
    "ProviderModuleError", "ProviderUnreachableError", "SpotPricePoint",
    "UnknownInstanceTypeError", "UnknownProviderError", "UnknownZoneError",
    "load_provider_modules", "make_provider", "provider_class", "provider_name",
    "provider_names", "register_provider",
]
