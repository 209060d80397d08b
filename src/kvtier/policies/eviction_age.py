"""How long an ordinary chunk lasts unused in a tier before it is evicted: `EvictionAge`.

A tier's eviction age is the horizon of its recency: a chunk used again within it would have
stayed anyway, one used later was evicted first. `kvtier.policies.retaining` compares a
`next_turn_s` hint with it (an expected chunk is held once its turn is that near). Measured on a
hash-sampled 1 key in `sample` (as `kvtier.policies.minisim.is_sampled`): when each was last used
while held, and how long before its eviction, averaged over the last ~`memory` victims.

Thread-safety: not thread-safe; its policy's tier serializes calls.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from kvtier.keys import OffloadKey

__all__ = ["EvictionAge"]


class EvictionAge:
    """The average time from last use to eviction of a tier's ordinary chunks (inf: not yet)."""

    def __init__(self, sample: int = 16, memory: float = 64.0):
        self.sample = sample
        self.seconds = float("inf")
        self._keep = 1.0 - 1.0 / memory
        # sampled held keys: last used
        self._seen: dict[OffloadKey, float] = {}

    def used(self, keys: Iterable[OffloadKey], now: float) -> None:
        """Held `keys` were used (stored or read) now."""
        crc32 = zlib.crc32
        sample = self.sample
        seen = self._seen
        for key in keys:
            # `is_sampled`, inlined: asked for every key a hinted tier stores or reads
            if crc32(key) % sample == 0:
                seen[key] = now

    def evicted(self, keys: Iterable[OffloadKey], now: float) -> None:
        """Ordinary `keys` were evicted now."""
        for key in keys:
            seen = self._seen.pop(key, None)
            if seen is not None:
                age = now - seen
                if self.seconds == float("inf"):
                    # the first: no average yet
                    self.seconds = age
                else:
                    self.seconds = self._keep * self.seconds + (1 - self._keep) * age

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        """`keys` left the tier otherwise (deleted, or evicted with a hint): no age to learn."""
        for key in keys:
            self._seen.pop(key, None)

    def __len__(self) -> int:
        return len(self._seen)

    def clear(self) -> None:
        self._seen.clear()
