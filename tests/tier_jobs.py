"""Driving any secondary tier with jobs over slab-like rows: fill rows with content derived from
each key and rank, store them, load them back into zeroed rows, wait for results."""

from __future__ import annotations

import mmap

import numpy as np

from disk_crash_writer import chunk_content
from helpers import HANG_S
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.secondary import SecondaryTier, TierJob, TierResult


class Slab:
    """Page-aligned rows (one per chunk, `world_size` buffers each), like the shared host slab."""

    def __init__(self, num_rows: int, ns: Namespace):
        self.ns = ns
        self._map = mmap.mmap(-1, num_rows * ns.payload_bytes)
        self.rows = np.frombuffer(self._map, np.uint8).reshape(
            num_rows, ns.world_size, ns.slot_bytes
        )
        self._job_ids = iter(range(1, 1 << 30))

    def fill(self, row: int, k: bytes) -> None:
        for rank in range(self.ns.world_size):
            self.rows[row, rank] = chunk_content(k, rank, self.ns.slot_bytes)

    def holds(self, row: int, k: bytes) -> bool:
        return all(
            (self.rows[row, r] == chunk_content(k, r, self.ns.slot_bytes)).all()
            for r in range(self.ns.world_size)
        )

    def job(self, is_store: bool, ks: list[bytes], rows: list[int]) -> TierJob:
        buffers = tuple(
            tuple(memoryview(self.rows[row, r]) for r in range(self.ns.world_size)) for row in rows
        )
        return TierJob(
            job_id=next(self._job_ids), is_store=is_store, keys=tuple(ks), buffers=buffers
        )


def run(tier: SecondaryTier, job: TierJob) -> TierResult:
    """Submit a job and wait for its result."""
    (tier.submit_store if job.is_store else tier.submit_load)(job)
    assert tier.drain(HANG_S)
    results = tier.get_finished()
    assert [r.job_id for r in results] == [job.job_id]
    return results[0]


def store(tier: SecondaryTier, slab: Slab, ks: list[bytes]) -> TierResult:
    """Fill one row per key with the key's content, then store them (rows 0..n-1)."""
    for row, k in enumerate(ks):
        slab.fill(row, k)
    return run(tier, slab.job(True, ks, list(range(len(ks)))))


def load(tier: SecondaryTier, slab: Slab, ks: list[bytes]) -> TierResult:
    """Load keys into zeroed rows 0..n-1."""
    slab.rows[: len(ks)] = 0
    return run(tier, slab.job(False, ks, list(range(len(ks)))))
