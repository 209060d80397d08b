"""The disk tier's configuration: the user's `disk_*` keys, checked when built, the tier they
build, and the tier's descriptor (`DiskConfig.TIER`, registered in `kvtier.tiers.registry`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvtier.costmodel.estimates import ReadEstimate
from kvtier.settings import (
    choice,
    flag,
    integer,
    policy,
    quotas,
    seconds,
    setting,
    size,
    text,
    validate,
)
from kvtier.tiers.cascade import WRITE_MODES, TierRules
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.secondary import SecondaryTier, TierDescriptor

__all__ = ["DiskConfig"]


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """The disk tier's settings (user keys `disk_<field>`); no `path`: no disk tier."""

    KEY_PREFIX: ClassVar[str] = "disk_"
    # a local NVMe disk, until measured; its reset deletes files it does not announce one by one
    TIER: ClassVar[TierDescriptor] = TierDescriptor(
        name="disk",
        event_medium="STORAGE",
        locality="LOCAL",
        read_prior=ReadEstimate(1e9, 0.0005),
        announces_reset=False,
        sized_by="disk_bytes",
    )

    path: str | None = setting(
        None,
        text,
        "Directory of the disk tier, created if missing; without it there is no disk tier.",
    )
    bytes: int = setting(16 * 2**30, size, "Capacity of the disk tier, in whole chunk files.")
    fsync: bool = setting(
        False, flag, "Fsync each chunk file and its directory before the chunk counts as stored."
    )
    direct_io: str | bool = setting(
        "auto",
        choice("auto", True, False),
        "Use O_DIRECT: auto (where the filesystem and the slab's alignment allow it), true (required) or false.",
    )
    write_mode: str = setting(
        "write_through",
        choice(*WRITE_MODES),
        "Which chunks go to disk: write_through (every chunk stored in RAM) or on_evict (those RAM evicts).",
    )
    min_offers: int = setting(
        1,
        integer(1),
        "Write to disk only chunks that at least this many requests stored or reused.",
    )
    eviction_policy: str = setting(
        "lru",
        policy,
        "The disk tier's eviction policy: lru, arc, turns or an out-of-tree module:Class.",
    )
    tenant_quotas: tuple[tuple[str, int], ...] = setting(
        (),
        quotas,
        "Bytes of the disk tier each tenant (cache_salt) may hold, as tenant_quotas for RAM.",
    )
    file_mode: str = setting(
        "0600",
        choice("0600", "0640"),
        "Permissions of chunk files: 0600 (this user only) or 0640 (its group may read them too).",
    )
    rescan_s: float | None = setting(
        None,
        seconds(0.001, optional=True),
        "Every so many seconds, adopt chunk files other engines sharing the directory wrote since this one started.",
    )
    max_queue_bytes: int = setting(
        256 * 2**20,
        size,
        "Backpressure: drop writes to disk while this many bytes are queued for it.",
    )
    max_store_s: float = setting(
        2.0,
        seconds(0.001),
        "Backpressure: drop writes to disk while recent ones took longer than this.",
    )

    def __post_init__(self) -> None:
        validate(self)

    @property
    def is_enabled(self) -> bool:
        return self.path is not None

    def rules(self) -> TierRules:
        """How the tiered manager feeds the disk tier."""
        return TierRules(
            write_mode=self.write_mode,
            min_offers=self.min_offers,
            max_queue_bytes=self.max_queue_bytes,
            max_store_seconds=self.max_store_s,
        )

    def build(
        self, namespace: Namespace, *, enable_events: bool, remote: object = None
    ) -> tuple[SecondaryTier, TierRules]:
        """The disk tier (its index rebuilt in the background) and its rules (`remote`: the shared
        tiers' settings, which a disk does not use).

        Raises:
            ConfigError: a directory that cannot be made or is not safe to use (see `root`).
        """
        from kvtier.tiers.disk.tier import DiskTier

        assert self.path is not None, "build only an enabled tier"
        direct = None if self.direct_io == "auto" else bool(self.direct_io)
        tier = DiskTier(
            self.path,
            namespace,
            self.bytes,
            policy=self.eviction_policy,
            fsync=self.fsync,
            direct_io=direct,
            enable_events=enable_events,
            rescan_s=self.rescan_s,
            file_mode=int(self.file_mode, 8),
            tenant_quotas=dict(self.tenant_quotas),
        )
        return tier, self.rules()
