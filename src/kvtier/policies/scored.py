"""A base for policies that evict the key with the lowest score.

A subclass sets scores (`_set`, or `rescore_all` at once) from its `insert`, `touch` and
`order_chain`; this class keeps them and a heap to find the lowest: a rescored key leaves a
stale entry behind, skipped when it surfaces, and the heap is rebuilt when they pile up.
Eviction, `discard`, `clear` and the counts are done here, atomically as `CachePolicy` asks.

Scores are in "key time" by convention: a `clock` that advances by one per key used, so
a score of `clock + bonus` reads as "keep this key `bonus` keys' worth of traffic longer
than LRU would".

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Container, Sequence

from kvtier.keys import OffloadKey
from kvtier.policies.base import CachePolicy

__all__ = ["ScoredPolicy"]


class ScoredPolicy(CachePolicy):
    """Evicts the lowest score first (ties: the key scored first)."""

    name = "scored"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.clock = 0.0
        self.scores: dict[OffloadKey, float] = {}
        self._heap: list[tuple[float, int, OffloadKey]] = []
        self._seq = itertools.count()

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        heap = self._heap
        scores = self.scores
        victims: dict[OffloadKey, None] = {}
        # popped entries, pushed back unless evicted
        taken: list[tuple[float, int, OffloadKey]] = []
        while heap and len(victims) < n:
            entry = heapq.heappop(heap)
            score, _, key = entry
            if scores.get(key) != score or key in victims:
                # stale: the key was rescored or is gone
                continue
            taken.append(entry)
            if key not in protected:
                victims[key] = None
        if len(victims) < n:
            for entry in taken:
                heapq.heappush(heap, entry)
            return None
        for entry in taken:
            if entry[2] not in victims:
                heapq.heappush(heap, entry)
        for key in victims:
            del scores[key]
            self._forget(key, evicted=True)
        return list(victims)

    def evict_keys(self, keys: Sequence[OffloadKey]) -> None:
        """Forget `keys` as evicted, chosen by another policy (`kvtier.policies.adaptive`),
        leaving the history an eviction leaves; keys not held are ignored."""
        for key in keys:
            # its heap entries go stale
            if self.scores.pop(key, None) is not None:
                self._forget(key, evicted=True)

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        held = [key for key in dict.fromkeys(keys) if key in self.scores]
        for key in held:
            # its heap entries go stale
            del self.scores[key]
            self._forget(key, evicted=False)
        return held

    def clear(self) -> None:
        self.scores.clear()
        self._heap.clear()
        self.clock = 0.0

    def __len__(self) -> int:
        return len(self.scores)

    def __contains__(self, key: object) -> bool:
        return key in self.scores

    def rank_last(self, keys: Sequence[OffloadKey]) -> None:
        """Scored no lower than a key used now (`clock`), in the order given."""
        for key in keys:
            if key in self.scores:
                self.clock += 1.0
                self._raise_to(key, self.clock)

    def take_places(self, keys: Sequence[OffloadKey], victims: Sequence[OffloadKey]) -> None:
        """The victims had the lowest scores: scored below every key held, the first given lowest."""
        held = [key for key in keys if key in self.scores]
        lowest = self._lowest_score()
        for i, key in enumerate(held):
            self._lower_to(key, lowest - (len(held) - i))

    def evict_in_place(
        self, key: OffloadKey, victim: OffloadKey, protected: Container[OffloadKey]
    ) -> bool:
        """Scored below every key held, an unprotected key is the next victim."""
        if key not in self.scores:
            return False
        if key in protected:
            self.take_places((key,), (victim,))
            return False
        # its heap entries go stale
        del self.scores[key]
        self._forget(key, evicted=True)
        return True

    def _raise_to(self, key: OffloadKey, score: float) -> None:
        """`rank_last`: score `key` at least `score` (a subclass whose scores derive from its own
        state sets that state instead)."""
        if self.scores[key] < score:
            self._set(key, score)

    def _lower_to(self, key: OffloadKey, score: float) -> None:
        """`take_places`: score `key` `score`, below every other (as `_raise_to`)."""
        self._set(key, score)

    def _lowest_score(self) -> float:
        """The lowest score held (stale heap entries on top are dropped), or `clock` when none is held."""
        heap = self._heap
        scores = self.scores
        while heap and scores.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else self.clock

    def _forget(self, key: OffloadKey, evicted: bool) -> None:
        """`key` left the policy (`evicted`, or lost: `discard`): drop what a subclass keeps about it."""

    def rescore_all(self, scores: dict[OffloadKey, float]) -> None:
        """Replace every key's score at once (O(n)): `scores` names exactly the keys held."""
        self.scores = scores
        self._heap = [(s, next(self._seq), k) for k, s in scores.items()]
        heapq.heapify(self._heap)

    def _set(self, key: OffloadKey, score: float) -> None:
        self.scores[key] = score
        heapq.heappush(self._heap, (score, next(self._seq), key))
        if len(self._heap) > 2 * len(self.scores) + 1024:
            self._heap = [(s, next(self._seq), k) for k, s in self.scores.items()]
            heapq.heapify(self._heap)
