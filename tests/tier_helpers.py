"""Helpers for the tiered-manager suites: a real disk tier on small chunks, slab rows with
content derived from each key, and `HeldTier`, a fault injector that delays a real tier's
jobs (a slow disk or server) without re-implementing any of it."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from helpers import HANG_S, make_req_context
from kvtier.base import LookupResult, OffloadingEvent
from kvtier.keys import OffloadKey
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.secondary import SecondaryTier, TierJob, TierResult, TierStats
from kvtier.tiers.tiered import TieredManager

SLOT_BYTES = 4096
# the request that looks chunks up and loads them
CTX = make_req_context("r")
# the request that stored them (another one: see `put`)
WRITER = make_req_context("w")


def namespace(world_size: int = 1) -> Namespace:
    return Namespace("tiny", "float32", "blocks_first", 16, 1, "sha256", world_size, SLOT_BYTES)


@contextlib.contextmanager
def disk_tiers(
    default_root: Path, default_namespace: Callable[[], Namespace]
) -> Iterator[Callable[..., DiskTier]]:
    """`make(capacity_files=8, ns=None, root=None, **DiskTier kwargs)`: a scanned `DiskTier` with
    room for that many files (under `default_root` unless `root` is given); all closed at the end."""
    tiers: list[DiskTier] = []

    def make(
        capacity_files: int = 8, ns: Namespace | None = None, root: Path | None = None, **kwargs
    ) -> DiskTier:
        ns = ns or default_namespace()
        tier = DiskTier(
            root or default_root, ns, capacity_files * (4096 + ns.payload_bytes), **kwargs
        )
        tiers.append(tier)
        assert tier.wait_scanned(HANG_S)
        return tier

    try:
        yield make
    finally:
        for tier in tiers:
            tier.close()


def content(key: OffloadKey, rank: int = 0) -> np.ndarray:
    """The bytes rank `rank` holds for `key` (derived from both, so a mix-up shows)."""
    seed = int.from_bytes(hashlib.sha256(key + bytes([rank])).digest()[:8], "big")
    return np.random.default_rng(seed).integers(0, 256, SLOT_BYTES, dtype=np.uint8)


def make_slabs(num_slots: int, world_size: int = 1) -> list[np.ndarray]:
    return [np.zeros((num_slots, SLOT_BYTES), dtype=np.uint8) for _ in range(world_size)]


_made_disks: list[DiskTier] = []


def close_made_disks() -> None:
    """Stop the disk tiers `make_tiered` made (conftest calls it after each test): their threads
    would otherwise live on until the garbage collector finds the tier."""
    while _made_disks:
        _made_disks.pop().close()


def make_tiered(
    tmp_path,
    num_slots: int = 4,
    disk_chunks: int = 16,
    world_size: int = 1,
    policy: str = "lru",
    rules: TierRules | None = None,
    held: bool | str = False,
    **kwargs,
) -> tuple[TieredManager, list[np.ndarray]]:
    """A TieredManager over a real disk tier; `held`: True holds the tier's jobs (see `HeldTier`),
    "loads" only its reads."""
    disk = DiskTier(
        tmp_path / "disk", namespace(world_size), disk_chunks * (SLOT_BYTES * world_size + 4096)
    )
    _made_disks.append(disk)
    assert disk.wait_scanned(HANG_S)
    tier: SecondaryTier = HeldTier(disk, hold_stores=held != "loads") if held else disk
    slabs = make_slabs(num_slots, world_size)
    # the manager gives a tier job up at its deadline: one only a hang reaches, unless a test sets its own
    kwargs.setdefault("job_timeout_s", HANG_S)
    manager = TieredManager(
        CPUTierManager(num_slots, policy=policy), slabs, [(tier, rules or TierRules())], **kwargs
    )
    return manager, slabs


def put(
    manager: TieredManager, slabs: list[np.ndarray], keys: Sequence[OffloadKey], ctx=WRITER
) -> list[OffloadKey]:
    """What a store does end to end: reserve slots, the worker writes them, complete.

    By default another request than `CTX` stores: a promotion never evicts chunks of the
    requesting request's own chain, and the scenarios here want promotions to evict.
    """
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    for k, slot in zip(out.keys_to_store, out.store_spec.slot_ids, strict=True):
        for rank, slab in enumerate(slabs):
            slab[slot] = content(k, rank)
    manager.complete_store(out.keys_to_store, ctx)
    return out.keys_to_store


def settle(manager: TieredManager, timeout: float = HANG_S) -> None:
    """Wait for every tier job, then let the manager apply the results."""
    for tier in manager.tiers:
        assert tier.drain(timeout)
    # polls
    manager.stats()


def read_back(
    manager: TieredManager, slabs: list[np.ndarray], k: OffloadKey, ctx=CTX
) -> list[np.ndarray]:
    """Load `k` from the CPU tier (it must be a HIT) and return each rank's bytes."""
    assert manager.lookup(k, ctx) is LookupResult.HIT
    slot = int(manager.prepare_load([k], ctx).slot_ids[0])
    rows = [slab[slot].copy() for slab in slabs]
    manager.complete_load([k], ctx)
    return rows


def counters(manager: TieredManager, index: int = 0) -> dict[str, int]:
    return dict(manager.tier_stats()[index].counters)


class HeldTier(SecondaryTier):
    """A real tier whose jobs wait until `release()` (loads and/or stores, as chosen)."""

    def __init__(self, inner: SecondaryTier, hold_stores: bool = True):
        self.inner, self.medium = inner, inner.medium
        self.hold_loads, self.hold_stores = True, hold_stores
        self._held: list[TierJob] = []
        self._dropped: list[TierResult] = []

    def release(self) -> None:
        held, self._held = self._held, []
        for job in held:
            (self.inner.submit_store if job.is_store else self.inner.submit_load)(job)

    def submit_load(self, job: TierJob) -> None:
        self._held.append(job) if self.hold_loads else self.inner.submit_load(job)

    def submit_store(self, job: TierJob) -> None:
        self._held.append(job) if self.hold_stores else self.inner.submit_store(job)

    @property
    def queued_store_bytes(self) -> int:
        return self.inner.queued_store_bytes + sum(j.num_bytes for j in self._held if j.is_store)

    def drain(self, timeout: float) -> bool:
        return not self._held and self.inner.drain(timeout)

    def lookup(self, key: OffloadKey) -> LookupResult:
        return self.inner.lookup(key)

    def recheck(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.recheck(keys)

    @property
    def is_reachable(self) -> bool:
        return self.inner.is_reachable

    def get_finished(self) -> list[TierResult]:
        dropped, self._dropped = self._dropped, []
        return dropped + self.inner.get_finished()

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.touch(keys)

    def use_retention(self, book) -> None:
        self.inner.use_retention(book)

    def take_events(self) -> list[OffloadingEvent]:
        return self.inner.take_events()

    def stats(self) -> TierStats:
        return self.inner.stats()

    def reset(self) -> None:
        """As the contract says of jobs in flight at a reset: they end as failed."""
        self._dropped += [
            TierResult(job_id=j.job_id, failed_keys=frozenset(j.keys), error="reset")
            for j in self._held
        ]
        self._held = []
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()
