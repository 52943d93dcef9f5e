"""The compute-provider registry: a name -> `ComputeProvider` class table, filled by a decorator.

    @register_provider("gcp")
    class GcpProvider(ComputeProvider): ...        # for_run, preflight, price_usd_per_hour

A provider module decorates its class; `cloud/providers/__init__.py` imports the built-in ones
(`emulated`, `aws`), so they are registered whenever the package is. A provider of one's own (a
module outside this repository) is registered by naming its import path in the setting
TRAINWISE_PROVIDER_MODULES (comma-separated); those modules are imported before every lookup,
so `TRAINWISE_PROVIDER=<its name>` selects it. A setting rather than package entry points:
a module on PYTHONPATH is enough (nothing to install), and every setting is in one table.

Registration runs one way, as for allocation policies (`cloud/policy_factories.py`) and
SkyPilot's cloud registry: provider modules import this one; this one imports none of them.
"""

from __future__ import annotations

import importlib
import re
from typing import TypeVar

from cloud.providers.base import ComputeProvider
from trainwise import settings

PROVIDER_SETTING = "TRAINWISE_PROVIDER"
MODULES_SETTING = "TRAINWISE_PROVIDER_MODULES"
DEFAULT_PROVIDER = "emulated"
_NAME = re.compile(r"[a-z][a-z0-9_]*")

Provider = TypeVar("Provider", bound=type[ComputeProvider])

# name -> class, in registration order (`provider_names` lists the default first).
_PROVIDERS: dict[str, type[ComputeProvider]] = {}


class UnknownProviderError(settings.SettingError):
    """No provider is registered under the name asked for; the message lists those that are."""


class ProviderModuleError(settings.SettingError):
    """A module named in TRAINWISE_PROVIDER_MODULES cannot be imported or registers nothing."""

    def __init__(self, module: str, problem: str) -> None:
        self.module = module
        super().__init__(f"{MODULES_SETTING} names module {module!r}, which {problem}; fix the "
                         f"module or remove it from {MODULES_SETTING}")


def register_provider(name: str):
    """Class decorator: make `cls` the provider called `name`. The class must be a
    `ComputeProvider` that defines `for_run`; its `name` attribute is set to `name` (or must
    already equal it). A second class under a taken name is refused; the same class again (its
    module imported a second time) replaces the first."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"provider name {name!r} must be a lowercase word "
                         "(letters, digits, underscores; a letter first)")

    def register(cls: Provider) -> Provider:
        where = f"{cls.__module__}.{cls.__qualname__}"
        if not (isinstance(cls, type) and issubclass(cls, ComputeProvider)):
            raise TypeError(f"@register_provider({name!r}) on {where}: a provider is a "
                            "subclass of cloud.providers.base.ComputeProvider")
        if getattr(cls.for_run, "__func__", None) is ComputeProvider.for_run.__func__:
            raise TypeError(f"@register_provider({name!r}) on {where}: define the classmethod "
                            "for_run(instance_type, region, **options), how the train job "
                            "builds one for a run")
        own = getattr(cls, "name", None)
        if own is None:
            cls.name = name
        elif own != name:
            raise ValueError(f"@register_provider({name!r}) on {where}, whose name is {own!r}: "
                             "register it under its own name")
        taken = _PROVIDERS.get(name)
        if taken is not None and _where(taken) != where:
            raise ValueError(f"provider {name!r} is already registered by {_where(taken)}; "
                             f"give {where} another name")
        _PROVIDERS[name] = cls
        return cls

    return register


def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def load_provider_modules(value: str | None = None) -> tuple[str, ...]:
    """Import every module TRAINWISE_PROVIDER_MODULES (or `value`) names, in order; each must
    register at least one provider. Returns the module names. Imports are cached by Python, so
    calling this before every lookup costs a dictionary lookup per module."""
    raw = value if value is not None else settings.get(MODULES_SETTING)
    modules = tuple(part.strip() for part in raw.split(",") if part.strip())
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            missing = error.name or ""
            itself = module == missing or module.startswith(missing + ".")
            raise ProviderModuleError(module, (
                "cannot be found (put its folder on PYTHONPATH)" if itself else
                f"cannot be imported: it imports {missing!r}, which is not installed")) from error
        except Exception as error:  # noqa: BLE001 - whatever the module raised, name it
            raise ProviderModuleError(module, f"raised {type(error).__name__}: {error} while "
                                      "being imported") from error
        if not any(c.__module__ == module or c.__module__.startswith(module + ".")
                   for c in _PROVIDERS.values()):
            raise ProviderModuleError(module, "registers no provider (decorate its "
                                      "ComputeProvider class with @register_provider(\"name\") "
                                      "from cloud.providers.registry)")
    return modules


def provider_names() -> tuple[str, ...]:
    """Every registered provider (after TRAINWISE_PROVIDER_MODULES): the default first, then
    in registration order (the built-ins before the modules of the setting)."""
    load_provider_modules()
    return tuple(sorted(_PROVIDERS, key=lambda name: name != DEFAULT_PROVIDER))


def provider_name(value: str | None = None) -> str:
    """The selected provider: `value`, else the TRAINWISE_PROVIDER setting, else emulated;
    an unknown name lists the registered ones."""
    name = (value if value is not None else settings.get(PROVIDER_SETTING)).strip()
    name = name or DEFAULT_PROVIDER
    provider_class(name)
    return name


def provider_class(name: str) -> type[ComputeProvider]:
    """The class registered as `name` (TRAINWISE_PROVIDER_MODULES imported first)."""
    names = provider_names()
    if name not in _PROVIDERS:
        raise UnknownProviderError(
            f"{PROVIDER_SETTING}={name!r} is not a provider; use one of {', '.join(names)} "
            f"(a provider of your own: name its module in {MODULES_SETTING})")
    return _PROVIDERS[name]


__all__ = ["DEFAULT_PROVIDER", "MODULES_SETTING", "PROVIDER_SETTING", "ProviderModuleError",
           "UnknownProviderError", "load_provider_modules", "provider_class", "provider_name",
           "provider_names", "register_provider"]
