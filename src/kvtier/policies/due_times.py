"""Keys each due at a time: `DueTimes`, the clocks of `RetainingPolicy`'s chunks set aside.

A key has one time, the last one set; `due(now)` hands out the keys whose time came, each once.
A heap orders them; an entry whose key was set again or forgotten since is stale and skipped,
and the heap is rebuilt once stale entries outnumber live ones, so a key set at every turn of
a long session costs one entry, not one per turn.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from kvtier.keys import OffloadKey

__all__ = ["DueTimes"]


class DueTimes:
    """Keys -> when each is due; not thread-safe (its policy's tier serializes calls)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, OffloadKey]] = []
        # each key's live time (other heap entries are stale)
        self._at: dict[OffloadKey, float] = {}

    def __len__(self) -> int:
        return len(self._at)

    def get(self, key: OffloadKey) -> float | None:
        return self._at.get(key)

    def set(self, key: OffloadKey, when: float) -> None:
        """`key` is due at `when` (and no longer at a time set before)."""
        if self._at.get(key) == when:
            return
        self._at[key] = when
        heapq.heappush(self._heap, (when, key))
        if len(self._heap) > 2 * len(self._at) + 64:
            self._heap = [(at, k) for k, at in self._at.items()]
            heapq.heapify(self._heap)

    def due(self, now: float) -> list[OffloadKey]:
        """The keys due at or before `now`, earliest first; they are no longer due."""
        keys = []
        while self._heap and self._heap[0][0] <= now:
            when, key = heapq.heappop(self._heap)
            if self._at.get(key) == when:
                del self._at[key]
                keys.append(key)
        return keys

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self._at.pop(key, None)

    def clear(self) -> None:
        self._heap = []
        self._at = {}

    def entries(self) -> int:
        """Heap entries, stale ones included (what it holds in memory)."""
        return len(self._heap)
