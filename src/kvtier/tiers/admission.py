"""Admission rules: which offered chunks a tier actually stores.

`ReuseGate(threshold)` stores a key only once `threshold` different requests offered it,
so one-off prompts do not push out chunks that are reused. A request that offers a key
again (its store found no room and is retried, or it runs a second time through
chunked prefill) is still one offer. The offers are kept for a bounded number of keys
(least recently offered forgotten first).

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey

__all__ = ["ReuseGate"]


class ReuseGate:
    """Admit a key once `threshold` requests offered it; track at most `max_tracked` keys."""

    def __init__(self, threshold: int, max_tracked: int):
        if threshold < 1:
            raise ConfigError(
                f"store_threshold must be >= 1 (1 stores on first offer), got {threshold}"
            )
        if max_tracked < 1:
            raise ConfigError(
                f"the reuse tracker needs room for at least one key, got {max_tracked}"
            )
        self.threshold = threshold
        self.max_tracked = max_tracked
        # key -> requests that offered it
        self._offers: OrderedDict[OffloadKey, frozenset[str]] = OrderedDict()

    def admit(self, key: OffloadKey, req_id: str) -> bool:
        """Count `req_id`'s offer of `key` (once per request); True once it reached the threshold."""
        if self.threshold == 1:
            return True
        # Kept after admission: a store refused for lack of room, or a chunk evicted later,
        # is admitted again on its next offer. At most `threshold` ids are kept per key.
        offers = self._offers.pop(key, frozenset())
        if len(offers) < self.threshold:
            offers = offers | {req_id}
        self._offers[key] = offers
        if len(self._offers) > self.max_tracked:
            self._offers.popitem(last=False)
        return len(offers) >= self.threshold

    def has_admitted(self, key: OffloadKey) -> bool:
        """Whether `key` reached the threshold (counts nothing)."""
        return self.threshold == 1 or len(self._offers.get(key, ())) >= self.threshold

    def __len__(self) -> int:
        return len(self._offers)

    def clear(self) -> None:
        self._offers.clear()
