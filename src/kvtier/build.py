"""The manager a configuration asks for: the CPU tier alone, or a `TieredManager` with the
secondary tiers the configuration names — each built by its own slice (`tiers/<tier>/config.py`,
or an out-of-tree tier's, named in `extra_tiers`), looked up in the order of
`KVTierConfig.tier_configs`. Engine-agnostic: the engine adapter brings the slab rows and the
namespace.

A tier is built only if it is registered (`kvtier.tiers.registry`) under the name its slice's
descriptor gives, and reports that name as its `medium`: the name is what estimates, events and
metrics are keyed on, so a tier the registry does not know is a `ConfigError` here, never a
silent default later.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.base import OffloadingManager
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.quotas import in_slots
from kvtier.tiers.registry import secondary_tier_configs
from kvtier.tiers.secondary import SecondaryTier
from kvtier.tiers.tiered import TieredManager

__all__ = ["build_manager", "secondary_tiers"]

logger = logging.getLogger(__name__)


def secondary_tiers(
    cfg: KVTierConfig, namespace: Namespace
) -> list[tuple[SecondaryTier, TierRules]]:
    """The configured secondary tiers, in lookup order, each with its cascade rules.

    Raises:
        ConfigError: a tier that cannot start (a disk directory that cannot be created, a
            secret file that cannot be read, a required shared tier that does not answer), or
            one not registered under the name it reports; the tiers built before it are closed.
    """
    tiers: list[tuple[SecondaryTier, TierRules]] = []
    try:
        for config in cfg.tier_configs():
            if not config.is_enabled:
                continue
            _check_registered(config)
            built = config.build(namespace, enable_events=cfg.enable_events, remote=cfg.remote)
            if built is None:
                # a shared tier whose client could not even be built: the engine runs without it
                continue
            tiers.append(built)
            _check_medium(config, built[0])
    except BaseException:
        for tier, _ in tiers:
            tier.close()
        raise
    return tiers


def build_manager(
    cfg: KVTierConfig,
    num_slots: int,
    key_bytes: int,
    slabs: Sequence[np.ndarray],
    namespace: Namespace,
) -> OffloadingManager:
    """The CPU tier, behind a `TieredManager` when secondary tiers are configured."""
    slot_bytes = sum(slab.shape[1] for slab in slabs)
    primary = CPUTierManager(
        num_slots,
        policy=cfg.eviction_policy,
        store_threshold=cfg.store_threshold,
        enable_events=cfg.enable_events,
        key_bytes=key_bytes,
        tenant_quotas=in_slots(dict(cfg.tenant_quotas), slot_bytes),
    )
    tiers = secondary_tiers(cfg, namespace)
    try:
        handoff_tier = _handoff_tier(cfg, [tier.medium for tier, _ in tiers])
    except ConfigError:
        for tier, _ in tiers:
            tier.close()
        raise
    if not tiers:
        return primary
    return TieredManager(
        primary,
        slabs,
        tiers,
        max_promotion_bytes=cfg.promotion_bytes,
        job_timeout_s=cfg.job_timeout_s,
        handoff_tier=handoff_tier,
        # into RAM (an engine job), then out of it
        handoff_store_s=2 * cfg.job_timeout_s,
    )


def _handoff_tier(cfg: KVTierConfig, built: list[str]) -> str | None:
    """The tier hand-offs go to: `handoff_tier` ("": the manager picks the first shared one).

    Raises:
        ConfigError: `handoff_tier` names a tier that is not configured.
    """
    name = cfg.handoff_tier
    if name is None:
        return ""
    configured = [c.TIER.name for c in cfg.tier_configs() if c.is_enabled]
    if name not in configured:
        raise ConfigError(
            f"handoff_tier {name!r} is not a configured tier (configured: {configured})"
        )
    if name not in built:
        # a shared tier whose client could not be built: the engine runs without it
        logger.warning("kvtier: the hand-off tier %s is not available; no hand-offs", name)
        return None
    return name


def _check_registered(config: Any) -> None:
    """Raises ConfigError unless slice `config`'s class is the one registered under its tier's name."""
    name = config.TIER.name
    registered = secondary_tier_configs().get(name)
    if registered is type(config):
        return
    if registered is None:
        raise ConfigError(
            f"{type(config).__name__} configures a tier named {name!r}, which is not registered: "
            "register its slice with kvtier.tiers.register_tier, or name it in extra_tiers"
        )
    raise ConfigError(
        f"{type(config).__name__} configures a tier named {name!r}, but that name is registered "
        f"to {registered.__name__}: tier names are unique"
    )


def _check_medium(config: Any, tier: SecondaryTier) -> None:
    """Raises ConfigError unless `tier` reports its registered name as its medium."""
    name = config.TIER.name
    if tier.medium != name:
        raise ConfigError(
            f"{type(config).__qualname__} built a tier whose medium is {tier.medium!r}, not its "
            f"registered name {name!r}: a tier's medium is its name (estimates, events and "
            "metrics are keyed on it)"
        )
