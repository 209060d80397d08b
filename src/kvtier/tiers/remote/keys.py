"""What a shared tier knows about its store's keys, without asking it: which keys are present,
which were absent a moment ago, and which wait for an existence probe.

- **present**: keys this tier stored or a probe found, at most `max_known` (the least
  recently used are forgotten first; forgetting only costs a probe later). The server may
  drop a key meanwhile (its `maxmemory` policy, a TTL): a load then fails and `forget`s it.
- **absent**: keys a probe did not find, answered MISS for `absent_ttl_s` and then asked
  again, so that what another replica stores becomes visible soon.
- **probing**: keys queued for (or inside) a probe; a lookup of one answers RETRY.

Thread-safety: not thread-safe; `RemoteTier` calls it with its lock held.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvtier.base import LookupResult
from kvtier.keys import OffloadKey

__all__ = ["KnownKeys"]


class KnownKeys:
    """Args: max_known: present keys remembered at most; absent_ttl_s: how long an absence holds."""

    def __init__(self, max_known: int, absent_ttl_s: float):
        self.max_known = max_known
        self.absent_ttl_s = absent_ttl_s
        self._present: OrderedDict[OffloadKey, None] = OrderedDict()
        # key -> when to ask again
        self._absent: OrderedDict[OffloadKey, float] = OrderedDict()
        self._queue: list[OffloadKey] = []
        self._probing: set[OffloadKey] = set()

    def __len__(self) -> int:
        return len(self._present)

    def __contains__(self, key: OffloadKey) -> bool:
        return key in self._present

    def __iter__(self) -> Iterator[OffloadKey]:
        """The keys known present (least recently used first)."""
        return iter(self._present)

    @property
    def has_queued(self) -> bool:
        return bool(self._queue)

    def answer(self, key: OffloadKey) -> LookupResult:
        """HIT, MISS, or RETRY after queueing `key` for a probe (unless it is queued already)."""
        if key in self._present:
            self._present.move_to_end(key)
            return LookupResult.HIT
        now = time.monotonic()
        while self._absent and next(iter(self._absent.values())) <= now:
            # oldest first: every entry lives absent_ttl_s
            self._absent.popitem(last=False)
        if key in self._absent:
            return LookupResult.MISS
        if key not in self._probing:
            self._probing.add(key)
            self._queue.append(key)
        return LookupResult.RETRY

    def recheck(self, keys: Sequence[OffloadKey]) -> None:
        """Forget that `keys` were absent: their next lookup probes again."""
        for key in keys:
            self._absent.pop(key, None)

    def take_queued(self, limit: int) -> list[OffloadKey]:
        """Up to `limit` keys to probe now (they stay `probing` until `record_probe` or `unprobe`)."""
        batch = self._queue[:limit]
        del self._queue[: len(batch)]
        return batch

    def record_probe(
        self, keys: Sequence[OffloadKey], found: Sequence[bool], is_current: bool
    ) -> None:
        """A probe's answers; `is_current` False: a reset came meanwhile, the answers are dropped."""
        expires = time.monotonic() + self.absent_ttl_s
        self._probing.difference_update(keys)
        if not is_current:
            return
        for key, is_present in zip(keys, found, strict=True):
            if is_present:
                self.remember(key)
            else:
                self._absent[key] = expires
                self._absent.move_to_end(key)

    def unprobe(self, keys: Sequence[OffloadKey]) -> None:
        """A probe that failed or was dropped: the keys are asked about again at their next lookup."""
        self._probing.difference_update(keys)

    def remember(self, key: OffloadKey) -> None:
        self._present[key] = None
        self._present.move_to_end(key)
        self._absent.pop(key, None)
        if len(self._present) > self.max_known:
            self._present.popitem(last=False)

    def forget(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            self._present.pop(key, None)

    def clear(self) -> None:
        self._present.clear()
        self._absent.clear()
        self._queue.clear()
        self._probing.clear()
