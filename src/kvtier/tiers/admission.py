"""Admission rules: which offered chunks a tier actually stores.

`ReuseGate(threshold)` stores a key only once it was offered `threshold` times, so
one-off prompts do not push out chunks that are reused. The offer counts are kept
for a bounded number of keys (least recently offered forgotten first).

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey

__all__ = ["ReuseGate"]


class ReuseGate:
    """Admit a key on its `threshold`-th offer; track at most `max_tracked` keys."""

    def __init__(self, threshold: int, max_tracked: int):
        if threshold < 1:
            raise ConfigError(f"store_threshold must be >= 1 (1 stores on first offer), got {threshold}")
        if max_tracked < 1:
            raise ConfigError(f"the reuse tracker needs room for at least one key, got {max_tracked}")
        self.threshold = threshold
        self.max_tracked = max_tracked
        self._offers: OrderedDict[OffloadKey, int] = OrderedDict()

    def admit(self, key: OffloadKey) -> bool:
        """Count one offer of `key`; True once it reached the threshold."""
        if self.threshold == 1:
            return True
        # The count is kept after admission: a store refused for lack of room, or a
        # chunk evicted later, is admitted again on its next offer.
        count = self._offers.pop(key, 0) + 1
        self._offers[key] = count
        if len(self._offers) > self.max_tracked:
            self._offers.popitem(last=False)
        return count >= self.threshold

    def __len__(self) -> int:
        return len(self._offers)

    def clear(self) -> None:
        self._offers.clear()
