"""Any eviction policy, honoring the client's hints: `RetainingPolicy`, one class and the
invariant it keeps (every held key in the wrapped policy or set aside, never both).

This docstring is the one place that says how a tier honors hints; the book that records them is
`kvtier.policies.retention` (`Band`, `Rank`, `ORDINARY`), the hints themselves `kvtier.hints`.

It wraps a `CachePolicy` (LRU, ARC, turns, adaptive, an out-of-tree one) so that its tier evicts
by the ranks of a `RetentionBook` (band first, then priority), lowest first:

1. the low heap: chunks of ended sessions that nothing else used (`Band.DROPPED`), then chunks of
   a priority below 0 — lowest rank first, then the least recently hinted;
2. the wrapped policy: ordinary chunks (`ORDINARY`: no live hint, priority 0), in its own order;
3. the high heap: chunks expected back (`Band.EXPECTED`, from `next_turn_s`), retained
   (`Band.RETAINED`, from `retain_s`) or of a priority above 0 — only when no ordinary chunk is
   left — by rank, and among equals the one whose hint reaches furthest first (its next use is
   the furthest away: what Belady's MIN evicts), then the most recently hinted (tails before
   heads).

A key ranked last among its equals (`rank_last`) goes after every other key of its rank in its
heap, until it is filed again.

The horizon and the guard. A `next_turn_s` is a prediction: holding a chunk for a far turn costs
the room of every chunk it displaces meanwhile. Where those are reused sooner (agentic trace,
5 %: 0.539 holding every expected chunk, 0.571 without hints), an expected chunk is better
ordinary until its turn nears: it ranks `Band.NOT_KEPT` (at its own priority) until the horizon,
`horizon_factor` x the tier's eviction age (`kvtier.policies.eviction_age`: how long an unused
ordinary chunk lasts here, sampled) before its hint's end (0.595). Where they are not
(conversation trace: most chunks are used once), holding all wins (0.252 against 0.203). A guard
chooses between the two modes (`GuardMode`) online, as the adaptive policy chooses its expert:
LRU miniatures of this policy, one per mode, over a hash-sampled slice of the traffic
(`kvtier.policies.minisim.PolicySelector`; at most 1,024 slots each, a thinner slice past that):

- `GuardMode.ALL`: every expected chunk is honored (the horizon is infinite). It leads until
  the miniatures know better, and for good once the guard has failed.
- `GuardMode.NEAR`: an expected chunk is honored within the horizon only.

A policy built without a guard (a miniature, a test) keeps `NEAR`'s horizon unless its owner sets
`horizon_factor`. Retained and priority chunks are always honored.

The wrapped policy holds only the chunks filed ordinary; the others are set aside (each with its
`Filing`: the rank and the book's order it was filed with) and wait beside it in the two heaps
(`LowEntry`, `HighEntry`), so an eviction costs what the wrapped policy's costs, however many
chunks are kept. A heap entry whose filing is no longer its key's is stale: skipped when met,
dropped once stale entries outnumber live ones. A chunk moves when the book changes its rank (the
book tells every policy that subscribed) and when its hint expires or its turn nears (found at
the next eviction); one that comes back is as recent as a new one. Traffic without hints is
evicted exactly as by the wrapped policy alone.

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
from enum import StrEnum
from typing import NamedTuple

from kvtier.keys import OffloadKey
from kvtier.policies.base import CachePolicy
from kvtier.policies.due_times import DueTimes
from kvtier.policies.eviction_age import EvictionAge
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.minisim import PolicySelector
from kvtier.policies.retention import ORDINARY, Band, Order, Rank, RetentionBook

__all__ = ["GuardMode", "RetainingPolicy"]

logger = logging.getLogger(__name__)


class GuardMode(StrEnum):
    """Which expected chunks a tier honors (see the module docstring)."""

    ALL = "all"
    NEAR = "near"


class Filing(NamedTuple):
    """How a key set aside was filed: the heap entries that carry another filing are stale."""

    rank: Rank
    # the book's order of the key when it was filed
    order: Order
    # ranked last among its equals (`rank_last`)
    is_last: bool = False


class LowEntry(NamedTuple):
    """A key in the low heap (ranks below `ORDINARY`), compared as a tuple: the least first."""

    rank: Rank
    # its filing's `order.seq`: the least recently hinted first (inf: ranked last)
    seq: float
    filing: Filing
    key: OffloadKey

    @classmethod
    def of(cls, filing: Filing, key: OffloadKey) -> LowEntry:
        if filing.is_last:
            return cls(filing.rank, math.inf, filing, key)
        return cls(filing.rank, filing.order.seq, filing, key)


class HighEntry(NamedTuple):
    """A key in the high heap (ranks above `ORDINARY`), compared as a tuple: the least first."""

    rank: Rank
    # minus its filing's `order.until`: the hint that reaches furthest first (inf: ranked last)
    reach: float
    # minus its filing's `order.seq`: the most recently hinted first (inf: ranked last)
    recency: float
    filing: Filing
    key: OffloadKey

    @classmethod
    def of(cls, filing: Filing, key: OffloadKey) -> HighEntry:
        if filing.is_last:
            return cls(filing.rank, math.inf, math.inf, filing, key)
        return cls(filing.rank, -filing.order.until, -filing.order.seq, filing, key)


class RetainingPolicy(CachePolicy):
    """`inner`, evicting by the ranks of `book`; see the module docstring.

    Args:
        lock: held while the book's changes are filed (the tier's lock, when its policy is
            called from several threads); None: the tier is driven from one thread.
        guard: whether a guard chooses the `GuardMode` (else the horizon is `horizon_factor`).
        listen: whether to subscribe to `book` (a miniature is told by its owner instead).
    """

    # the horizon in `GuardMode.NEAR`, in eviction ages. "near", agentic 5 % quick:
    # 0.5 -> 0.578, 1 -> 0.595, 2 -> 0.554; ages: 1 key in 16, over ~64 victims
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
        self.inner = inner
        self.book = book
        self.name = inner.name
        # held, not in `inner`: how each was filed
        self._aside: dict[OffloadKey, Filing] = {}
        self._low: list[LowEntry] = []
        self._high: list[HighEntry] = []
        # when a chunk set aside changes rank
        self._expiries = DueTimes()
        self._lock = lock
        # how long an ordinary chunk lasts unused here
        self.age = EvictionAge()
        # expected chunks not yet honored: from when
        self._soon = DueTimes()
        self.guard: PolicySelector | None = None
        # this tier's horizon now, in eviction ages (inf: every expected chunk is honored)
        self.horizon_factor = type(self).horizon_factor
        if guard:
            self.guard = PolicySelector(
                inner.capacity,
                (GuardMode.ALL, GuardMode.NEAR),
                self._miniature,
                min_keys=64,
                max_keys=1024,
                period=4,
                memory=8.0,
                margin=2.0,
            )
            self.horizon_factor = self._horizon(self.guard.best)
        if listen:
            book.subscribe(self)

    def _horizon(self, mode: str) -> float:
        """The horizon in `mode`, in eviction ages."""
        if mode == GuardMode.NEAR:
            return type(self).horizon_factor
        return math.inf

    def _miniature(self, mode: str, capacity: int) -> CachePolicy:
        """One of the guard's miniatures: an LRU of `capacity` honoring hints in `mode`."""
        # told by its owner (`_changed`), not by the book
        mini = RetainingPolicy(LRUPolicy(capacity), self.book, guard=False, listen=False)
        mini.horizon_factor = self._horizon(mode)
        return mini

    def prepare_insert(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.prepare_insert(keys)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.insert(keys)
        if len(self.book):
            self._file(keys, self.book.clock())
        self._measure(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        # keys set aside: their order is the book's
        self.inner.touch(keys)
        # a tier may be told of keys it lacks (without hints nothing is measured: no filtering)
        self._measure([key for key in keys if key in self] if len(self.book) else ())

    def _measure(self, keys: Sequence[OffloadKey]) -> None:
        """Held `keys` were used: tell the eviction age and the guard, and refile every hinted key
        if the guard changed its mode."""
        if not len(self.book):
            return
        now = self.book.clock()
        self.age.used(keys, now)
        try:
            switched = self.guard is not None and self.guard.access(keys)
        except Exception:
            # a miniature's fault must not reach the tier: honor every hint from now on
            logger.exception(
                "kvtier: the next_turn_s guard failed; every next_turn_s is honored from now on"
            )
            self.guard = None
            switched = True
        if not switched:
            return
        mode = GuardMode.ALL if self.guard is None else self.guard.best
        self.horizon_factor = self._horizon(mode)
        hinted = [key for key in self.book.hinted_keys() if key in self.inner]
        self._file([*self._aside, *hinted], now)

    def _forget(self, keys: Iterable[OffloadKey]) -> None:
        self.age.forget(keys)
        self._soon.forget(keys)
        self._expiries.forget(keys)

    def rank_here(self, key: OffloadKey, now: float) -> Rank:
        """`key`'s rank in this tier: the book's, an expected chunk's not before its turn is near."""
        rank, _ = self._ranked(key, now)
        return rank

    def _ranked(self, key: OffloadKey, now: float) -> tuple[Rank, float | None]:
        """`rank_here`, and for an expected chunk ranked `Band.NOT_KEPT` for now, when its turn is
        near (None: it ranks as the book says)."""
        rank = self.book.rank(key, now)
        if rank.band != Band.EXPECTED or self.horizon_factor == math.inf:
            return rank, None
        near = self.book.order(key).until - self.horizon_factor * self.age.seconds
        # `not near > now`, not `near <= now`: before the eviction age is measured (inf) a
        # horizon factor of 0 makes `near` NaN, and the chunk then ranks as the book says
        if not near > now:
            return rank, None
        return Rank(Band.NOT_KEPT, rank.priority), near

    def order_chain(self, keys: Sequence[OffloadKey]) -> None:
        # all held (the contract): only keys set aside are not in the wrapped policy
        aside = self._aside
        self.inner.order_chain([key for key in keys if key not in aside] if aside else keys)

    def rank_last(self, keys: Sequence[OffloadKey]) -> None:
        """Ordinary keys: the wrapped policy's. A key set aside keeps its rank and goes last among its
        equals (a head whose tail is held must not be popped and pushed back by every eviction that
        reaches its heap: an ended session's chain would cost each eviction its length), until it
        is filed again."""
        if not self._aside:
            self.inner.rank_last(keys)
            return
        self.inner.rank_last([key for key in keys if key in self.inner])
        for key in keys:
            filing = self._aside.get(key)
            if filing is None:
                continue
            # its other heap entries go stale
            self._put_aside(key, filing._replace(is_last=True))

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
            self._set_aside([(key, self._aside[key].rank) for key in aside], now)

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        held = set(self.inner.discard(keys))
        for key in keys:
            if self._aside.pop(key, None) is not None:
                held.add(key)
        self._forget(keys)
        return [key for key in dict.fromkeys(keys) if key in held]

    def clear(self) -> None:
        self.inner.clear()
        self.age.clear()
        if self.guard is not None:
            self.guard.clear()
        self._aside.clear()
        self._low = []
        self._high = []
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
        if self.guard is None:
            return
        for mini in self.guard.minis.values():
            mini._file([key for key in keys if key in mini], now)  # type: ignore[attr-defined]

    def refile(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` were inserted into `inner` directly (a disk tier's start-up scan swapped it): set
        aside again those the book ranks other than ORDINARY. Under the tier's lock."""
        self.inner.discard([key for key in keys if key in self._aside])
        self._file(keys, self.book.clock(), force=True)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0 or (not self._aside and not len(self.book)):
            # nothing hinted: the wrapped policy alone
            return self.inner.evict(n, protected)
        now = self.book.clock()
        self._expire(now)
        low = self._take(self._low, n, protected, now)
        want = n - len(low)
        ordinary = self._ordinary_or_none(want, protected, now)
        while ordinary is None:
            # fewer ordinary ones than wanted: the rest from the high ones
            num_aside = len(self._aside)
            num_high = self._available(self._high, protected, want)
            ordinary = self._ordinary_or_none(max(0, want - num_high), protected, now)
            if ordinary is not None:
                ordinary += self._take_ordinary(want - len(ordinary), protected, now)
            elif len(self._aside) == num_aside:
                # not enough at all (else offered ones were set aside: again)
                self._file(low, now, force=True)
                return None
        high = self._take(self._high, n - len(low) - len(ordinary), protected, now)
        if len(low) + len(ordinary) + len(high) < n:
            # ranks changed meanwhile: all back (ordinary as recent)
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

    def _available(
        self, heap: Sequence[LowEntry | HighEntry], protected: Container[OffloadKey], enough: int
    ) -> int:
        """Keys set aside in `heap` that an eviction may take, counted up to `enough` (an eviction
        asks once per victim while chains are held: a whole heap's count each time made a 64-chunk
        store in a tier of 4,096 retained chunks walk 260,128 entries)."""
        found: set[OffloadKey] = set()
        for entry in heap:
            if len(found) >= enough:
                break
            is_live = self._aside.get(entry.key) == entry.filing
            if is_live and entry.key not in protected:
                found.add(entry.key)
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
        skipped: list[LowEntry | HighEntry] = []
        while heap and len(taken) < n:
            entry = heapq.heappop(heap)
            is_live = self._aside.get(entry.key) == entry.filing
            if not is_live or entry.key in taken:
                # evicted, moved back, or filed again since
                continue
            if entry.key in protected:
                skipped.append(entry)
            else:
                taken.append(entry.key)
        for entry in skipped:
            heapq.heappush(heap, entry)
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
                # to be filed again then
                self._soon.set(key, near)
            if key in self._aside:
                if rank == ORDINARY:
                    del self._aside[key]
                    back.append(key)
                elif force or self._aside[key] != Filing(rank, self.book.order(key)):
                    aside.append((key, rank))
            elif rank != ORDINARY and key in self.inner:
                self.inner.discard([key])
                aside.append((key, rank))
        if back:
            # as recent as a new chunk
            self.inner.insert(back)
        self._set_aside(aside, now)

    def _set_aside(self, ranked: Sequence[tuple[OffloadKey, Rank]], now: float) -> None:
        for key, rank in ranked:
            self._put_aside(key, Filing(rank, self.book.order(key)))
            if rank.band >= Band.EXPECTED:
                # kept by a hint that expires: filed again then
                self._expiries.set(key, self.book.next_change(key, now))

    def _put_aside(self, key: OffloadKey, filing: Filing) -> None:
        """File `key` aside as `filing`, in the heap of its rank (its older entries go stale)."""
        self._aside[key] = filing
        if filing.rank < ORDINARY:
            self._push(self._low, LowEntry.of(filing, key))
        else:
            self._push(self._high, HighEntry.of(filing, key))

    def _push(self, heap: list, entry: LowEntry | HighEntry) -> None:
        """Push `entry`; once stale entries (a key filed again, moved back, evicted) outnumber the
        live ones, drop them: a session's chunks hinted at every turn would leave one per turn."""
        heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self._aside) + 64:
            aside = self._aside
            heap[:] = dict.fromkeys(e for e in heap if aside.get(e.key) == e.filing)
            heapq.heapify(heap)
