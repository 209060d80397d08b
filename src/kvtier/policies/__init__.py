"""Eviction policies, registered by name, plus a module-path hook for out-of-tree ones.

`make_policy("lru", capacity)` builds a built-in policy; `make_policy("pkg.mod:MyPolicy",
capacity)` imports a `CachePolicy` subclass from any importable module.
"""

from __future__ import annotations

import importlib

from kvtier.errors import ConfigError
from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import CachePolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.turns import TurnsPolicy

__all__ = [
    "ARCPolicy",
    "AdaptivePolicy",
    "CachePolicy",
    "LRUPolicy",
    "TurnsPolicy",
    "make_policy",
    "policy_names",
    "register_policy",
]

_REGISTRY: dict[str, type[CachePolicy]] = {}


def register_policy(cls: type[CachePolicy]) -> type[CachePolicy]:
    """Register a policy class under its `name` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise ConfigError(f"{cls!r} is not a CachePolicy subclass")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    """Names accepted by `make_policy` besides module paths."""
    return sorted(_REGISTRY)


def make_policy(spec: str, capacity: int) -> CachePolicy:
    """Build a policy from a registered name or a ``"module:Class"`` path."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(
            f"policy must be a name, one of {policy_names()}, or 'module:Class'; got {spec!r}"
        )
    if spec in _REGISTRY:
        return _REGISTRY[spec](capacity)
    if ":" not in spec:
        raise ConfigError(
            f"unknown policy {spec!r}: use one of {policy_names()} or an out-of-tree 'module:Class'"
        )
    return _import_policy(spec)(capacity)


def _import_policy(spec: str) -> type[CachePolicy]:
    module_name, _, class_name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import policy {spec!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise ConfigError(f"policy {spec!r} is not a kvtier.policies.CachePolicy subclass")
    return cls


register_policy(LRUPolicy)
register_policy(ARCPolicy)
register_policy(TurnsPolicy)
register_policy(AdaptivePolicy)
