"""The manager a configuration asks for: the CPU tier alone, or a `TieredManager` with the
secondary tiers the configuration names — each built by its own slice (`tiers/<tier>/config.py`),
looked up in the order of `SECONDARY_TIERS`. Engine-agnostic: the engine adapter brings the slab
rows and the namespace.

A new secondary tier is a package under `tiers/` whose configuration slice builds it, a field
of `KVTierConfig`, and one line in `SECONDARY_TIERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvtier.base import OffloadingManager
from kvtier.config import KVTierConfig
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.quotas import in_slots
from kvtier.tiers.secondary import SecondaryTier
from kvtier.tiers.tiered import TieredManager

__all__ = ["SECONDARY_TIERS", "build_manager", "secondary_tiers"]

Built = (
    tuple[SecondaryTier, TierRules] | None
)  # None: a shared tier whose client could not even be built
# each secondary tier: the `KVTierConfig` field of its slice, and how that slice builds it; searched in this order
SECONDARY_TIERS: dict[str, Callable[[KVTierConfig, Namespace], Built]] = {
    "disk": lambda cfg, ns: cfg.disk.build(ns, enable_events=cfg.enable_events),
    "redis": lambda cfg, ns: cfg.redis.build(cfg.remote, ns, enable_events=cfg.enable_events),
    "s3": lambda cfg, ns: cfg.s3.build(cfg.remote, ns, enable_events=cfg.enable_events),
}


def secondary_tiers(
    cfg: KVTierConfig, namespace: Namespace
) -> list[tuple[SecondaryTier, TierRules]]:
    """The configured secondary tiers, in lookup order, each with its cascade rules.

    Raises:
        ConfigError: a tier that cannot start (a disk directory that cannot be created, a
            secret file that cannot be read, a required shared tier that does not answer); the
            tiers built before it are closed.
    """
    tiers: list[tuple[SecondaryTier, TierRules]] = []
    try:
        for name, build in SECONDARY_TIERS.items():
            built = build(cfg, namespace) if getattr(cfg, name).is_enabled else None
            if built is not None:
                tiers.append(built)
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
    if not tiers:
        return primary
    return TieredManager(
        primary,
        slabs,
        tiers,
        max_promotion_bytes=cfg.promotion_bytes,
        job_timeout_s=cfg.job_timeout_s,
    )
