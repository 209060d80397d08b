"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from itertools import islice

from kvtier.keys import OffloadKey
from kvtier.policies.base import CachePolicy

__all__ = ["LRUPolicy"]


class LRUPolicy(CachePolicy):
    """Evicts the least recently inserted or touched key first.

    Keys of one call are walked in reverse, so a request's prefix ends up more recent
    than its tail: the tail, which is useless without the prefix, goes first.
    """

    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        # oldest first
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        order = self._order
        for key in reversed(keys):
            order[key] = None
            order.move_to_end(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        order = self._order
        move = self._order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)

    def rank_last(self, keys: Sequence[OffloadKey]) -> None:
        order = self._order
        move = self._order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def take_places(self, keys: Sequence[OffloadKey], victims: Sequence[OffloadKey]) -> None:
        """The victims were the oldest keys: to the oldest end."""
        order = self._order
        move = self._order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key, last=False)

    def evict_in_place(
        self, key: OffloadKey, victim: OffloadKey, protected: Container[OffloadKey]
    ) -> bool:
        """In the oldest place, an unprotected key is the next victim."""
        if key not in self._order:
            return False
        if key in protected:
            self._order.move_to_end(key, last=False)
            return False
        del self._order[key]
        return True

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        victims = list(islice((k for k in self._order if k not in protected), n))
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def evict_keys(self, keys: Sequence[OffloadKey]) -> None:
        """Forget `keys` as evicted, chosen by another policy (`kvtier.policies.adaptive`); LRU
        keeps no history, so this is `discard`."""
        self.discard(keys)

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        order = self._order
        held = []
        for key in keys:
            if key in order:
                del order[key]
                held.append(key)
        return held

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
