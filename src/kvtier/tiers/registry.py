"""The tiers kvtier knows, by name: one place every name-keyed part of the code reads.

A secondary tier is registered by its configuration slice: a frozen dataclass of `setting`
fields (`kvtier.settings`) with

- `KEY_PREFIX`: the prefix of its user keys (`"disk_"`);
- `TIER`: its `TierDescriptor` (`kvtier.tiers.secondary`): name, how its events name it, its
  read prior, whether its reset announces what it drops, what sizes it;
- `is_enabled`: whether the user's values ask for the tier at all;
- `build(namespace, *, enable_events, remote)`: the tier and its `TierRules`, or None when a
  shared tier's client cannot even be built (`remote`: the `RemoteConfig` every shared tier
  shares; a tier that shares nothing ignores it); raises `ConfigError` when it cannot start.

The built-in tiers (disk, Redis, S3) are registered here; an out-of-tree one with
`register_tier(MyConfig)`, or by naming its slice in the user's `extra_tiers` key as
"module:Class" (`kvtier.config.KVTierConfig`), which imports and registers it. The CPU tier is
the primary one, configured by the core keys: only its descriptor is here.

A tier's name is unique: registering a second slice under a taken name is a `ConfigError`.

Thread-safety: registration happens at import or configuration time, before any tier runs.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any

from kvtier.costmodel.estimates import ReadEstimate, declare_read_prior
from kvtier.errors import ConfigError
from kvtier.tiers.disk.config import DiskConfig
from kvtier.tiers.remote.config import RedisConfig, S3Config
from kvtier.tiers.secondary import TierDescriptor

__all__ = [
    "CPU_TIER",
    "check_registrable",
    "import_tier",
    "load_tier",
    "register_tier",
    "secondary_tier_configs",
    "tier_descriptor",
    "tier_descriptors",
]

# the primary tier, host RAM (`cpu_bytes`); its prior is a copy into the engine: a memcpy or PCIe
CPU_TIER = TierDescriptor(
    name="cpu",
    event_medium="CPU",
    locality="LOCAL",
    read_prior=ReadEstimate(4e9, 0.0002),
    announces_reset=True,
    sized_by="cpu_bytes",
)
_DESCRIPTORS: dict[str, TierDescriptor] = {}
# the secondary tiers' configuration slices, by tier name, in registration order
_CONFIGS: dict[str, type] = {}


def register_tier(config: type) -> type:
    """Register the secondary tier configured by slice class `config` (see the module docstring);
    registering the same class again does nothing. Usable as a class decorator.

    Raises:
        ConfigError: `config` is not a slice with a `TIER` descriptor, or another tier has its name.
    """
    check_registrable([config])
    descriptor = config.TIER
    if _CONFIGS.get(descriptor.name) is config:
        return config
    _add(descriptor)
    _CONFIGS[descriptor.name] = config
    return config


def check_registrable(configs: Sequence[type]) -> None:
    """Raise the `ConfigError` that registering `configs` one after another would, registering
    nothing (a configuration refused for one of its tiers leaves the registry as it was)."""
    named: dict[str, type] = {}
    for config in configs:
        name = _checked_slice(config).name
        owner = _CONFIGS.get(name, named.get(name))
        if owner is config:
            continue
        if name in _DESCRIPTORS:
            raise _name_taken(config, _owner(name))
        if name in named:
            raise _name_taken(config, _qualname(named[name]))
        named[name] = config


def load_tier(spec: str) -> type:
    """The slice class named by `spec`, "module:Class", imported and checked but not registered
    (`KVTierConfig` registers it once its keys are known to be free).

    Raises:
        ConfigError: it cannot be imported (whatever its module raises), or is not a slice.
    """
    module_name, _, class_name = spec.partition(":")
    try:
        config = getattr(importlib.import_module(module_name), class_name)
    except Exception as exc:
        raise ConfigError(
            f"extra_tiers: cannot import the tier slice {spec!r}: {type(exc).__name__}: {exc}"
        ) from None
    try:
        _checked_slice(config)
    except ConfigError as exc:
        raise ConfigError(f"extra_tiers: {spec!r}: {exc}") from None
    return config


def import_tier(spec: str) -> type:
    """Import and register the slice class named by `spec`, "module:Class".

    Raises:
        ConfigError: it cannot be imported, or `register_tier` refuses it.
    """
    config = load_tier(spec)
    try:
        return register_tier(config)
    except ConfigError as exc:
        raise ConfigError(f"extra_tiers: {spec!r}: {exc}") from None


def tier_descriptor(name: str) -> TierDescriptor:
    """The descriptor of the tier named `name`.

    Raises:
        ConfigError: no tier of that name is registered.
    """
    descriptor = _DESCRIPTORS.get(name)
    if descriptor is None:
        raise ConfigError(
            f"no tier named {name!r} is registered; registered: {sorted(_DESCRIPTORS)} "
            "(an out-of-tree tier is added by naming its slice in extra_tiers)"
        )
    return descriptor


def tier_descriptors() -> list[TierDescriptor]:
    """Every registered tier's descriptor: the CPU tier's, then in registration order."""
    return list(_DESCRIPTORS.values())


def secondary_tier_configs() -> dict[str, type]:
    """Every registered secondary tier's slice class, by tier name, in registration order."""
    return dict(_CONFIGS)


def _checked_slice(config: Any) -> TierDescriptor:
    """`config`'s descriptor, once `config` is known to be a slice class.

    Raises:
        ConfigError: it is not a dataclass with a `TIER` descriptor and the slice's members.
    """
    descriptor = getattr(config, "TIER", None)
    if not dataclasses.is_dataclass(config) or not isinstance(descriptor, TierDescriptor):
        raise ConfigError(
            f"{config!r} is not a tier's configuration slice: a dataclass with a TIER "
            "descriptor (kvtier.tiers.secondary.TierDescriptor)"
        )
    missing = [a for a in ("KEY_PREFIX", "is_enabled", "build") if not hasattr(config, a)]
    if missing:
        raise ConfigError(f"tier slice {_qualname(config)} lacks {missing}")
    return descriptor


def _add(descriptor: TierDescriptor) -> None:
    _DESCRIPTORS[descriptor.name] = descriptor
    declare_read_prior(descriptor.name, descriptor.read_prior)


def _name_taken(config: type, owner: str) -> ConfigError:
    return ConfigError(
        f"a tier named {config.TIER.name!r} is registered already ({owner}), so "
        f"{_qualname(config)} cannot be: tier names are unique (estimates, events and metrics "
        "are keyed on them); rename one"
    )


def _owner(name: str) -> str:
    config = _CONFIGS.get(name)
    if config is None:
        return "the primary tier"
    return _qualname(config)


def _qualname(config: type) -> str:
    return f"{config.__module__}.{config.__qualname__}"


_add(CPU_TIER)
# the built-in secondary tiers, in the order a lookup asks them
register_tier(DiskConfig)
register_tier(RedisConfig)
register_tier(S3Config)
