"""Compute providers behind one interface (`base.ComputeProvider`), chosen by name.

    provider = make_provider("emulated", markets=..., clock=...)   # or "aws", region=...

`provider_name()` reads the TRAINWISE_PROVIDER setting (emulated | aws; default emulated).
"""

from __future__ import annotations

from typing import Any

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
from trainwise import settings

PROVIDER_NAMES = ("emulated", "aws")
DEFAULT_PROVIDER = "emulated"


def provider_name(value: str | None = None) -> str:
    """The selected provider: `value`, else the TRAINWISE_PROVIDER setting, else emulated."""
    name = (value if value is not None else settings.get("TRAINWISE_PROVIDER")).strip()
    name = name or DEFAULT_PROVIDER
    if name not in PROVIDER_NAMES:
        raise ValueError(f"TRAINWISE_PROVIDER={name!r} is not a provider; use one of "
                         f"{', '.join(PROVIDER_NAMES)}")
    return name


def make_provider(name: str | None = None, **kwargs: Any) -> ComputeProvider:
    """The provider called `name` (see `provider_name`), built with its own arguments:
    emulated: markets, clock, rules (or `EmulatedProvider.from_traces`);
    aws: region, endpoint_url, image_id (see `AwsProvider`)."""
    name = provider_name(name)
    if name == "aws":
        from cloud.providers.aws import AwsProvider

        return AwsProvider(**kwargs)
    from cloud.providers.emulated import EmulatedProvider

    return EmulatedProvider(**kwargs)


__all__ = [
    "DEFAULT_PROVIDER", "MARKETS", "ON_DEMAND", "PROVIDER_NAMES", "SPOT", "ComputeProvider",
    "LaunchFailedError", "NodeEvent", "NodeHandle", "NodeState", "NodeStatus", "ProviderError",
    "ProviderUnreachableError", "SpotPricePoint", "UnknownInstanceTypeError", "UnknownZoneError",
    "make_provider", "provider_name",
]
