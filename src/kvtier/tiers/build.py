"""The manager a configuration asks for: the CPU tier alone, or a `TieredManager` with the
secondary tiers the configuration names (today: disk). Engine-agnostic: the engine adapter
brings the slab rows and the namespace."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.base import OffloadingManager
from kvtier.config import KVTierConfig
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu import CPUTierManager
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.secondary import SecondaryTier
from kvtier.tiers.tiered import TieredManager

__all__ = ["build_manager", "secondary_tiers"]


def secondary_tiers(cfg: KVTierConfig, namespace: Namespace) -> list[tuple[SecondaryTier, TierRules]]:
    """The configured secondary tiers, in lookup order, each with its cascade rules.

    Raises:
        ConfigError: a tier that cannot start (e.g. a disk directory that cannot be created).
    """
    tiers: list[tuple[SecondaryTier, TierRules]] = []
    if cfg.disk_path is not None:
        from kvtier.tiers.disk import DiskTier

        direct = None if cfg.disk_direct_io == "auto" else bool(cfg.disk_direct_io)
        disk = DiskTier(cfg.disk_path, namespace, cfg.disk_bytes, policy=cfg.disk_eviction_policy,
                        fsync=cfg.disk_fsync, direct_io=direct, enable_events=cfg.enable_events,
                        rescan_s=cfg.disk_rescan_s)
        rules = TierRules(write_mode=cfg.disk_write_mode, min_offers=cfg.disk_min_offers,
                          max_queue_bytes=cfg.disk_max_queue_bytes, max_store_seconds=cfg.disk_max_store_s)
        tiers.append((disk, rules))
    return tiers


def build_manager(cfg: KVTierConfig, num_slots: int, key_bytes: int, slabs: Sequence[np.ndarray],
                  namespace: Namespace) -> OffloadingManager:
    """The CPU tier, behind a `TieredManager` when secondary tiers are configured."""
    primary = CPUTierManager(num_slots, policy=cfg.eviction_policy, store_threshold=cfg.store_threshold,
                             enable_events=cfg.enable_events, key_bytes=key_bytes)
    tiers = secondary_tiers(cfg, namespace)
    if not tiers:
        return primary
    return TieredManager(primary, slabs, tiers, max_promotion_bytes=cfg.promotion_bytes)
