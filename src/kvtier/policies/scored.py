"""A base for policies that evict the key with the lowest score.

A subclass sets scores (`_set`, or `rescore_all` at once) from its `insert`, `touch` and
`order_chain`; this class keeps them and a heap to find the lowest. Each held key has one
entry there that counts, its anchor, scored no higher than the key: a key scored lower gets a
new anchor (the old one goes stale, skipped when it surfaces; the heap is rebuilt when they pile
up), a key scored higher keeps its anchor, and an anchor that surfaces below its key's score is
pushed again at that score. Scores mostly rise (a use, a store ranked behind its chain, a head
ranked last): on bench_sched_side a stored chunk was pushed three times, now once. The order
is the same: by score, ties by the order the keys were last scored in.
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

# (score, seq, key): a heap entry
_Entry = tuple[float, int, OffloadKey]


class ScoredPolicy(CachePolicy):
    """Evicts the lowest score first (ties: the key scored first)."""

    name = "scored"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.clock = 0.0
        self.scores: dict[OffloadKey, float] = {}
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        # held key -> when it was last scored (ties: the earliest first)
        self._seq_of: dict[OffloadKey, int] = {}
        # held key -> its heap entry that counts (score <= its score; the others are stale)
        self._anchor: dict[OffloadKey, _Entry] = {}

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        heap = self._heap
        victims: dict[OffloadKey, None] = {}
        # popped entries, pushed back unless evicted
        taken: list[_Entry] = []
        while heap and len(victims) < n:
            entry = self._settle(heapq.heappop(heap))
            if entry is None:
                continue
            taken.append(entry)
            key = entry[2]
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
            self._drop(key)
            self._forget(key, evicted=True)
        return list(victims)

    def _settle(self, entry: _Entry) -> _Entry | None:
        """A popped `entry`, if it is its key's anchor at its key's score; else None, and an anchor
        below its key's score is pushed again at that score (its place now)."""
        score, seq, key = entry
        if self._anchor.get(key) is not entry:
            # stale: the key got a lower anchor, or is gone
            return None
        if score == self.scores[key] and seq == self._seq_of[key]:
            return entry
        self._push(key, self.scores[key], self._seq_of[key])
        return None

    def _push(self, key: OffloadKey, score: float, seq: int) -> None:
        entry = (score, seq, key)
        self._anchor[key] = entry
        heapq.heappush(self._heap, entry)

    def _drop(self, key: OffloadKey) -> None:
        """`key` leaves: its heap entries go stale."""
        del self.scores[key]
        del self._seq_of[key]
        del self._anchor[key]

    def evict_keys(self, keys: Sequence[OffloadKey]) -> None:
        """Forget `keys` as evicted, chosen by another policy (`kvtier.policies.adaptive`),
        leaving the history an eviction leaves; keys not held are ignored."""
        for key in keys:
            if key in self.scores:
                self._drop(key)
                self._forget(key, evicted=True)

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        held = [key for key in dict.fromkeys(keys) if key in self.scores]
        for key in held:
            self._drop(key)
            self._forget(key, evicted=False)
        return held

    def clear(self) -> None:
        self.scores.clear()
        self._heap.clear()
        self._seq_of.clear()
        self._anchor.clear()
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
        self._drop(key)
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
        while heap:
            score, seq, key = heap[0]
            is_anchor = self._anchor.get(key) is heap[0]
            if is_anchor and score == self.scores[key] and seq == self._seq_of[key]:
                return score
            # stale: dropped; an anchor below its key's score: pushed again at it
            self._settle(heapq.heappop(heap))
        return self.clock

    def _forget(self, key: OffloadKey, evicted: bool) -> None:
        """`key` left the policy (`evicted`, or lost: `discard`): drop what a subclass keeps about it."""

    def rescore_all(self, scores: dict[OffloadKey, float]) -> None:
        """Replace every key's score at once (O(n)): `scores` names exactly the keys held."""
        self.scores = scores
        self._seq_of = {k: next(self._seq) for k in scores}
        self._rebuild()

    def _rebuild(self) -> None:
        """One anchor per key at its score, no stale entry (O(n))."""
        seq_of = self._seq_of
        self._heap = [(s, seq_of[k], k) for k, s in self.scores.items()]
        self._anchor = {entry[2]: entry for entry in self._heap}
        heapq.heapify(self._heap)

    def _set(self, key: OffloadKey, score: float) -> None:
        self.scores[key] = score
        seq = next(self._seq)
        self._seq_of[key] = seq
        anchor = self._anchor.get(key)
        if anchor is not None and anchor[0] <= score:
            # raised (or kept): its anchor still ranks it no later than its score does
            return
        self._push(key, score, seq)
        if len(self._heap) > 2 * len(self.scores) + 1024:
            self._rebuild()
