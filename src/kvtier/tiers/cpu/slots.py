"""Slot allocation for fixed-size tiers: fresh ids first, then reuse of freed ones; and `Chunk`,
what the CPU tier keeps per key (its slot, state and pin count).

Handing out never-used ids first keeps a young tier's slab writes sequential; freed ids
are reused most-recently-freed first (their pages are likely still warm). O(1) per id.

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.base import ChunkState
from kvtier.errors import ConfigError

__all__ = ["Chunk", "SlotAllocator"]


class Chunk:
    """One key's slot, its state (PENDING until written, READY, RETIRED by a reset) and pin count."""

    __slots__ = ("pins", "slot", "state")

    def __init__(self, slot: int):
        self.slot = slot
        self.state = ChunkState.PENDING
        self.pins = 0


class SlotAllocator:
    """Ids 0..num_slots-1: `allocate(n)` returns n ids or None, `free(ids)` returns them."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ConfigError(
                f"num_slots must be positive, got {num_slots}; give the tier more bytes"
            )
        self.num_slots = num_slots
        self._next_fresh = 0
        # a stack: the most recently freed id is reused first
        self._freed: list[int] = []

    @property
    def num_free(self) -> int:
        return self.num_slots - self._next_fresh + len(self._freed)

    def allocate(self, n: int) -> list[int] | None:
        """Reserve `n` slot ids (fresh first), or return None when fewer are free."""
        if n > self.num_free:
            return None
        num_fresh = min(n, self.num_slots - self._next_fresh)
        ids = list(range(self._next_fresh, self._next_fresh + num_fresh))
        self._next_fresh += num_fresh
        for _ in range(n - num_fresh):
            ids.append(self._freed.pop())
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return slot ids for reuse."""
        self._freed.extend(ids)

    def free_ids(self) -> set[int]:
        """The free ids (for `check()`; O(num_slots))."""
        return set(range(self._next_fresh, self.num_slots)) | set(self._freed)
