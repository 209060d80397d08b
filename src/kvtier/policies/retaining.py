"""Any eviction policy, honoring the client's hints: `RetainingPolicy`, one class and the
invariant it keeps (every held key in the wrapped policy or set aside, never both).

It wraps a `CachePolicy` (LRU, ARC, turns, adaptive, an out-of-tree one) so that its tier evicts
by the ranks of a `kvtier.policies.retention.RetentionBook`, lowest first:

1. chunks of ended sessions that nothing else used (`end_session`), then chunks of a priority
   below 0 — lowest rank first, then the least recently hinted;
2. ordinary chunks (no hint, or an expired one, priority 0): in the wrapped policy's own order;
3. chunks expected back (`next_turn_s`), retained (`retain_s`) or of a priority above 0 — only
   when no ordinary chunk is left — by (band, priority), and among equals the one whose hint
   reaches furthest first (its next use is the furthest away: what Belady's MIN evicts), tails
   before heads.

A `next_turn_s` is a prediction: holding a chunk for a far turn costs the room of every chunk it
displaces meanwhile. Where those are reused sooner (agentic trace, 5 %: 0.539 holding every
expected chunk, 0.571 without hints), an expected chunk is better ordinary until its turn nears:
within `horizon_factor` x the tier's eviction age (how long an unused ordinary chunk lasts here,
sampled) of its hint's end (0.595). Where they are not (conversation trace: most chunks are used
once), holding all wins (0.252 against 0.203). A guard chooses online, as the adaptive policy
chooses its expert: LRU miniatures "all" and "near" over a hash-sampled slice of the traffic
(`kvtier.policies.minisim.PolicySelector`). Retained and priority chunks are always honored.

The wrapped policy holds only the chunks filed ordinary; the others wait beside it in heaps, so
an eviction costs what the wrapped policy's costs, however many chunks are kept. A chunk moves
when the book changes its rank (the book tells every policy that subscribed) and when its hint
expires or its turn nears (found at the next eviction); one that comes back is as recent as a
new one. Traffic without hints is evicted exactly as by the wrapped policy alone.

Thread-safety: as the policy it wraps (its tier serializes calls). `ranks_changed` comes from the
thread that writes the book (the scheduler's) and takes the tier's lock when it has one.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import threading
from collections.abc import Container, Iterable, Sequence

from kvtier.keys import OffloadKey
from kvtier.policies.base import CachePolicy
from kvtier.policies.due_times import DueTimes
from kvtier.policies.eviction_age import EvictionAge
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.minisim import PolicySelector
from kvtier.policies.retention import ORDINARY, Rank, RetentionBook

__all__ = ["RetainingPolicy"]

logger = logging.getLogger(__name__)

# a chunk set aside: its rank, kept until, last hinted (the book's order)[, _RANKED_LAST]
Filing = tuple[Rank, float, int] | tuple[Rank, float, int, str]
_RANKED_LAST = "last"  # a filing's mark: ranked last among its equals (`rank_last`)


class RetainingPolicy(CachePolicy):
    """`inner`, evicting by the ranks of `book`; see the module docstring.

    Args:
        lock: held while the book's changes are filed (the tier's lock, when its policy is
            called from several threads); None: the tier is driven from one thread.
    """

    # "near", agentic 5 % quick: 0.5 -> 0.578, 1 -> 0.595, 2 -> 0.554; ages: 1 key in 16, over ~64 victims
    horizon_factor = 1.0

    def __init__(
        self,
        inner: CachePolicy,
        book: RetentionBook,
        lock: threading.Condition | None = None,
        guard: bool = True,
        listen: bool = True,
    ):
        super().__init__(inner.capacity)
        self.inner, self.book, self.name = inner, book, inner.name
        self._aside: dict[OffloadKey, Filing] = {}  # held, not in `inner`: how each was filed
        self._low: list[
            tuple
        ] = []  # heaps of (order..., filing, key); an entry not its key's filing is stale
        self._high: list[tuple] = []
        self._expiries = DueTimes()  # when a chunk set aside changes rank
        self._lock = lock
        self.age = EvictionAge()  # how long an ordinary chunk lasts unused here
        self._soon = DueTimes()  # expected chunks not yet honored: from when
        self.guard = (
            PolicySelector(
                inner.capacity,
                ("all", "near"),
                self._miniature,
                min_keys=64,
                period=4,
                memory=8.0,
                margin=2.0,
            )
            if guard
            else None
        )  # "all" leads until measured
        self.horizon_factor = type(self).horizon_factor if self.guard is None else float("inf")
        if listen:
            book.subscribe(self)

    def _horizon(self, leader: str) -> float:
        return type(self).horizon_factor if leader == "near" else float("inf")

    def _miniature(self, name: str, capacity: int) -> CachePolicy:
        mini = RetainingPolicy(
            LRUPolicy(capacity), self.book, guard=False, listen=False
        )  # told by its owner
        mini.horizon_factor = self._horizon(name)
        return mini

    def prepare_insert(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.prepare_insert(keys)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.insert(keys)
        if len(self.book):
            self._file(keys, self.book.clock())
        self._measure(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.touch(keys)  # keys set aside: their order is the book's
        self._measure([key for key in keys if key in self])  # a tier may be told of keys it lacks

    def _measure(self, keys: Sequence[OffloadKey]) -> None:
        if not len(self.book):
            return
        now = self.book.clock()
        self.age.used(keys, now)
        try:
            switched = self.guard is not None and self.guard.access(keys)
        except (
            Exception
        ):  # a miniature's fault must not reach the tier: honor every hint from now on
            logger.exception(
                "kvtier: the next_turn_s guard failed; every next_turn_s is honored from now on"
            )
            self.guard, switched = None, True
        if switched:
            self.horizon_factor = self._horizon(
                self.guard.best if self.guard is not None else "all"
            )
            self._file(
                [*self._aside, *(key for key in self.book.hinted_keys() if key in self.inner)], now
            )

    def _forget(self, keys: Iterable[OffloadKey]) -> None:
        self.age.forget(keys)
        self._soon.forget(keys)
        self._expiries.forget(keys)

    def rank_here(self, key: OffloadKey, now: float) -> Rank:
        """`key`'s rank in this tier: the book's, an expected chunk's not before its turn is near."""
        return self._ranked(key, now)[0]

    def _ranked(self, key: OffloadKey, now: float) -> tuple[Rank, float | None]:
        """`rank_here`, and for an expected chunk ranked ordinary for now, when its turn is near."""
        rank = self.book.rank(key, now)
        near = (
            self.book.order(key)[0] - self.horizon_factor * self.age.seconds
            if rank[0] == 1 and self.horizon_factor != float("inf")
            else None
        )
        return ((0, rank[1]), near) if near is not None and near > now else (rank, None)

    def order_chain(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.order_chain([key for key in keys if key in self.inner])

    def rank_last(self, keys: Sequence[OffloadKey]) -> None:
        """Ordinary keys: the wrapped policy's. A key set aside keeps its rank and goes last among its
        equals (a head whose tail is held must not be popped and pushed back by every eviction that
        reaches its heap: an ended session's chain would cost each eviction its length), until it
        is filed again."""
        self.inner.rank_last([key for key in keys if key in self.inner])
        for key in keys:
            filing = self._aside.get(key)
            if filing is None:
                continue
            rank = filing[0]
            last = self._aside[key] = (*filing[:3], _RANKED_LAST)  # its other heap entries go stale
            if rank < ORDINARY:
                self._push(self._low, (rank, math.inf, last, key))
            else:
                self._push(self._high, (rank, math.inf, math.inf, last, key))

    def evict_in_place(
        self, key: OffloadKey, victim: OffloadKey, protected: Container[OffloadKey]
    ) -> bool:
        """Nothing hinted: the wrapped policy's answer (as `evict` is then the wrapped policy's);
        otherwise in place, and `evict` decides by the ranks."""
        if not self._aside and not len(self.book):
            return self.inner.evict_in_place(key, victim, protected)
        self.take_places((key,), (victim,))
        return False

    def take_places(self, keys: Sequence[OffloadKey], victims: Sequence[OffloadKey]) -> None:
        """Ordinary keys take their victims' places in the wrapped policy; a key set aside is filed
        by its rank again (its place among its equals is the book's)."""
        pairs = [
            (key, victim) for key, victim in zip(keys, victims, strict=True) if key in self.inner
        ]
        self.inner.take_places([key for key, _ in pairs], [victim for _, victim in pairs])
        aside = [key for key in keys if key in self._aside]
        if aside:
            now = self.book.clock()
            self._set_aside([(key, self._aside[key][0]) for key in aside], now)

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        held = set(self.inner.discard(keys))
        held.update(key for key in keys if self._aside.pop(key, None) is not None)
        self._forget(keys)
        return [key for key in dict.fromkeys(keys) if key in held]

    def clear(self) -> None:
        self.inner.clear()
        self.age.clear()
        if self.guard is not None:
            self.guard.clear()
        self._aside.clear()
        self._low, self._high = [], []
        self._expiries.clear()
        self._soon.clear()

    def __len__(self) -> int:
        return len(self.inner) + len(self._aside)

    def __contains__(self, key: object) -> bool:
        return key in self.inner or key in self._aside

    def ranks_changed(self, keys: Sequence[OffloadKey]) -> None:
        """The book changed these keys' ranks: file the ones held again."""
        with self._lock or contextlib.nullcontext():
            self._changed(keys)

    def _changed(self, keys: Sequence[OffloadKey]) -> None:
        now = self.book.clock()
        self._file(keys, now)
        for mini in self.guard.minis.values() if self.guard is not None else ():
            mini._file([key for key in keys if key in mini], now)  # type: ignore[attr-defined]

    def refile(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` were inserted into `inner` directly (a disk tier's start-up scan swapped it): set
        aside again those the book ranks other than ORDINARY. Under the tier's lock."""
        self.inner.discard([key for key in keys if key in self._aside])
        self._file(keys, self.book.clock(), force=True)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0 or (not self._aside and not len(self.book)):
            return self.inner.evict(n, protected)  # nothing hinted: the wrapped policy alone
        now = self.book.clock()
        self._expire(now)
        low = self._take(self._low, n, protected, now)
        want = n - len(low)
        ordinary = self._ordinary_or_none(want, protected, now)
        while ordinary is None:  # fewer ordinary ones than wanted: the rest from the high ones
            aside = len(self._aside)
            ordinary = self._ordinary_or_none(
                max(0, want - self._available(self._high, protected, want)), protected, now
            )
            if ordinary is not None:
                ordinary += self._take_ordinary(want - len(ordinary), protected, now)
            elif (
                len(self._aside) == aside
            ):  # not enough at all (else offered ones were set aside: again)
                self._file(low, now, force=True)
                return None
        high = self._take(self._high, n - len(low) - len(ordinary), protected, now)
        if (
            len(low) + len(ordinary) + len(high) < n
        ):  # ranks changed meanwhile: all back (ordinary as recent)
            self.inner.prepare_insert(ordinary)
            self.inner.insert(ordinary)
            self._file([*low, *high], now, force=True)
            return None
        for key in (*low, *high):
            del self._aside[key]
        self.age.evicted(ordinary, now)
        self._forget((*ordinary, *low, *high))
        return [*low, *ordinary, *high]

    def _ordinary_or_none(
        self, n: int, protected: Container[OffloadKey], now: float
    ) -> list[OffloadKey] | None:
        """`n` ordinary victims in the wrapped policy's order, or None with the wrapped policy as it
        was (as its own `evict`): a failed eviction must not reorder it. (Unless chunks it offers
        turn out ranked otherwise and then it has too few: those taken go back, as recent.)"""
        victims: list[OffloadKey] = []
        while len(victims) < n:
            offered = self.inner.evict(n - len(victims), protected)
            if offered is None:
                if victims:
                    self.inner.prepare_insert(victims)
                    self.inner.insert(victims)
                return None
            victims.extend(self._keep_ordinary(offered, now))
        return victims

    def _keep_ordinary(self, offered: Sequence[OffloadKey], now: float) -> list[OffloadKey]:
        """The ordinary ones of the victims the wrapped policy offered; the others are set aside."""
        ranked = [(key, self.rank_here(key, now)) for key in offered]
        self._set_aside([(key, rank) for key, rank in ranked if rank != ORDINARY], now)
        return [key for key, rank in ranked if rank == ORDINARY]

    def _available(self, heap: list, protected: Container[OffloadKey], enough: int) -> int:
        """Keys set aside in `heap` that an eviction may take, counted up to `enough` (an eviction
        asks once per victim while chains are held: a whole heap's count each time made a 64-chunk
        store in a tier of 4,096 retained chunks walk 260,128 entries)."""
        found: set[OffloadKey] = set()
        for item in heap:
            if len(found) >= enough:
                break
            key = item[-1]
            if self._aside.get(key) == item[-2] and key not in protected:
                found.add(key)
        return len(found)

    def _take_ordinary(
        self, n: int, protected: Container[OffloadKey], now: float
    ) -> list[OffloadKey]:
        """Up to `n` ordinary victims in the wrapped policy's order; chunks it offers whose rank
        changed meanwhile are set aside as they come (each once, however many chunks are kept)."""
        victims: list[OffloadKey] = []
        step = n
        while len(victims) < n and step > 0:
            offered = self.inner.evict(min(step, n - len(victims)), protected)
            if offered is None:
                step //= 2
                continue
            victims.extend(self._keep_ordinary(offered, now))
        return victims

    def _take(
        self, heap: list, n: int, protected: Container[OffloadKey], now: float
    ) -> list[OffloadKey]:
        """Up to `n` keys set aside, in `heap`'s order, unprotected; stale entries dropped."""
        taken: list[OffloadKey] = []
        skipped: list = []
        while heap and len(taken) < n:
            item = heapq.heappop(heap)
            key = item[-1]
            if self._aside.get(key) != item[-2] or key in taken:
                continue  # evicted, moved back, or filed again since
            (skipped if key in protected else taken).append(item if key in protected else key)
        for item in skipped:
            heapq.heappush(heap, item)
        return taken

    def _expire(self, now: float) -> None:
        self._file([key for key in self._expiries.due(now) if key in self._aside], now)
        self._file([key for key in self._soon.due(now) if key in self], now)

    def _file(self, keys: Iterable[OffloadKey], now: float, force: bool = False) -> None:
        """Put each held key where its rank says: in the wrapped policy, or aside (`force`: aside
        again even if its rank is unchanged, its heap entries having been taken)."""
        back: list[OffloadKey] = []
        aside: list[tuple[OffloadKey, Rank]] = []
        for key in dict.fromkeys(keys):
            rank, near = self._ranked(key, now)
            if near is not None and key in self:
                self._soon.set(key, near)  # to be filed again then
            if key in self._aside:
                if rank == ORDINARY:
                    del self._aside[key]
                    back.append(key)
                elif force or self._aside[key] != (rank, *self.book.order(key)):
                    aside.append((key, rank))
            elif rank != ORDINARY and key in self.inner:
                self.inner.discard([key])
                aside.append((key, rank))
        if back:
            self.inner.insert(back)  # as recent as a new chunk
        self._set_aside(aside, now)

    def _set_aside(self, ranked: Sequence[tuple[OffloadKey, Rank]], now: float) -> None:
        for key, rank in ranked:
            until, seq = self.book.order(key)
            filing = self._aside[key] = (rank, until, seq)
            if rank < ORDINARY:
                self._push(self._low, (rank, seq, filing, key))
            else:
                self._push(self._high, (rank, -until, -seq, filing, key))
            if rank[0] >= 1:
                self._expiries.set(key, self.book.next_change(key, now))

    def _push(self, heap: list, item: tuple) -> None:
        """Push `item`; once stale entries (a key filed again, moved back, evicted) outnumber the
        live ones, drop them: a session's chunks hinted at every turn would leave one per turn."""
        heapq.heappush(heap, item)
        if len(heap) > 2 * len(self._aside) + 64:
            heap[:] = dict.fromkeys(
                entry for entry in heap if self._aside.get(entry[-1]) == entry[-2]
            )
            heapq.heapify(heap)
