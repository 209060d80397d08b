"""Client hints at eviction time: what requests asked to keep or to drop, honored by every policy.

A `RetentionBook` records, per chunk, what the requests that used it said (`kvtier.hints`): how
long to keep it, its priority, its session, whether that session ended. One book serves every
tier of a manager (the CPU tier and the disk tier evict by it; a shared store sets a value's
lifetime from `kept_until`). `RetainingPolicy` wraps any `CachePolicy` (LRU, ARC, turns, an
out-of-tree one) so that its tier evicts by rank, lowest first:

1. chunks of ended sessions that nothing else used (`end_session`), then chunks of a priority
   below 0 — lowest first, each rank in the order its chunks were last hinted;
2. ordinary chunks (no hint, or an expired one, priority 0): in the wrapped policy's own order;
3. chunks kept (`retain_s` / `next_turn_s` not yet expired) or of a priority above 0, by
   (kept, priority), soonest expiry first — only when no ordinary chunk is left to evict.

So a hint moves a chunk between ranks and never reorders ordinary chunks: traffic without hints
is evicted exactly as the wrapped policy would (the book is then empty and `evict` delegates).

Priority: the highest any request gave the chunk; never below 0 once a request without that
wish (another session, an unhinted request) used it. A session's end drops only the chunks no
other session or unhinted request used, so a shared system prompt stays. Any later use of a
dropped chunk makes it ordinary again. The book remembers the last `max_entries` hinted chunks;
older ones become ordinary.

The book also remembers which tenant (`cache_salt`) stored each of the last `max_entries` chunks,
once a tier behind the CPU tier enforces tenant quotas (`track_tenants`): such a tier gets only
keys from the manager, never the request.

Thread-safety: the book is locked (the scheduler thread writes it, a disk tier's threads read
it while evicting). A `RetainingPolicy` is as thread-safe as the policy it wraps: its tier
serializes calls.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence

from kvtier.errors import ConfigError, InvariantError
from kvtier.hints import Hints
from kvtier.keys import OffloadKey
from kvtier.policies.base import CachePolicy

__all__ = ["ORDINARY", "RetainingPolicy", "RetentionBook"]

Rank = tuple[int, int]  # (band: -1 dropped, 0 not kept, 1 kept; priority)
ORDINARY: Rank = (0, 0)


class _Entry:
    __slots__ = ("is_dropped", "is_shared", "priority", "session", "until")

    def __init__(self) -> None:
        self.until = float("-inf")  # kept until then (the scheduler's clock)
        self.priority = 0
        self.session: str | None = None  # the first session that used it
        self.is_shared = False  # used outside that session: its end does not drop it
        self.is_dropped = False  # its session ended

    def rank(self, now: float) -> Rank:
        if self.is_dropped:
            return (-1, self.priority)
        return (1 if self.until > now else 0, self.priority)


class RetentionBook:
    """The hints of the chunks requests used; see the module docstring.

    Args:
        clock: the clock hint durations count on (the scheduler's; `set_clock` changes it).
        max_entries: chunks remembered at most (the least recently hinted are forgotten).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = 1 << 16):
        if max_entries <= 0:
            raise ConfigError(f"a retention book needs room for entries, got max_entries={max_entries}")
        self.clock = clock
        self.max_entries = max_entries
        self._entries: OrderedDict[OffloadKey, _Entry] = OrderedDict()
        self._sessions: dict[str, dict[OffloadKey, None]] = {}
        self._low: dict[OffloadKey, None] = {}  # entries ranked below ORDINARY (rank never expires there)
        self.track_tenants = False  # set by a tier with tenant quotas
        self._tenants: OrderedDict[OffloadKey, str] = OrderedDict()
        self._lock = threading.Lock()

    def set_clock(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def note(self, keys: Iterable[OffloadKey], hints: Hints) -> None:
        """A request with `hints` used (loaded, stored, hit) `keys` now."""
        with self._lock:
            if hints.is_empty:
                for key in keys:
                    if (entry := self._entries.get(key)) is not None:
                        self._share(key, entry)
                return
            until = self.clock() + hints.keep_s if hints.keep_s > 0 else float("-inf")
            for key in keys:
                self._hint(key, hints, until)

    def note_tenant(self, keys: Iterable[OffloadKey], tenant: str | None) -> None:
        """`tenant`'s request stored `keys` (remembered only while a tier tracks tenants)."""
        if not self.track_tenants:
            return
        with self._lock:
            for key in keys:
                self._tenants[key] = tenant or ""
                self._tenants.move_to_end(key)
            while len(self._tenants) > self.max_entries:
                self._tenants.popitem(last=False)

    def tenant_of(self, key: OffloadKey) -> str | None:
        """The tenant that stored `key`, if remembered."""
        return self._tenants.get(key)

    def end_session(self, hints: Hints, keys: Iterable[OffloadKey]) -> None:
        """The request with `hints` (its `end_session` set) ended having used `keys`: its session's
        chunks that nothing else used go first from now on."""
        with self._lock:
            ended = dict.fromkeys(keys)
            if hints.session is not None:
                ended.update(self._sessions.pop(hints.session, {}))
            for key in ended:
                entry = self._entries.get(key)
                if entry is not None and not entry.is_shared:
                    entry.is_dropped = True
                    self._low[key] = None

    def rank(self, key: OffloadKey, now: float) -> Rank:
        entry = self._entries.get(key)
        return ORDINARY if entry is None else entry.rank(now)

    def kept_until(self, key: OffloadKey) -> float | None:
        """Until when (the book's clock) `key` is to be kept, or None."""
        entry = self._entries.get(key)
        return None if entry is None or entry.is_dropped or entry.until == float("-inf") else entry.until

    def low(self, now: float) -> list[tuple[Rank, OffloadKey]]:
        """The chunks ranked below ORDINARY, lowest rank first (then least recently hinted)."""
        with self._lock:
            ranked = [(self._entries[key].rank(now), key) for key in self._low]
        return sorted((pair for pair in ranked if pair[0] < ORDINARY), key=lambda pair: pair[0])

    def high(self, now: float) -> list[tuple[Rank, float, OffloadKey]]:
        """The chunks ranked above ORDINARY: (rank, kept until, key), lowest rank and soonest expiry first."""
        with self._lock:
            ranked = [(entry.rank(now), entry.until, key) for key, entry in self._entries.items()]
        return sorted((item for item in ranked if item[0] > ORDINARY), key=lambda item: item[:2])

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sessions.clear()
            self._low.clear()
            self._tenants.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _hint(self, key: OffloadKey, hints: Hints, until: float) -> None:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            entry.priority, entry.session = hints.priority, hints.session
            self._forget_oldest()
        else:
            self._entries.move_to_end(key)
            entry.priority = max(entry.priority, hints.priority)
            entry.is_shared |= hints.session != entry.session
        entry.until = max(entry.until, until)
        entry.is_dropped = False
        if entry.is_shared:
            entry.priority = max(entry.priority, 0)
        if hints.session is not None:
            self._sessions.setdefault(hints.session, {})[key] = None
        self._rank_changed(key, entry)

    def _share(self, key: OffloadKey, entry: _Entry) -> None:
        """An unhinted request used `key`: it is nobody's alone, and no longer dropped."""
        entry.is_shared, entry.is_dropped = True, False
        entry.priority = max(entry.priority, 0)
        self._rank_changed(key, entry)

    def _rank_changed(self, key: OffloadKey, entry: _Entry) -> None:
        if entry.is_dropped or entry.priority < 0:
            self._low[key] = None
        else:
            self._low.pop(key, None)

    def _forget_oldest(self) -> None:
        while len(self._entries) > self.max_entries:
            key, entry = self._entries.popitem(last=False)
            self._low.pop(key, None)
            if entry.session is not None and (keys := self._sessions.get(entry.session)) is not None:
                keys.pop(key, None)
                if not keys:
                    del self._sessions[entry.session]


class RetainingPolicy(CachePolicy):
    """`inner`, evicting by the ranks of `book`; see the module docstring."""

    def __init__(self, inner: CachePolicy, book: RetentionBook):
        super().__init__(inner.capacity)
        self.inner, self.book = inner, book
        self.name = inner.name

    def prepare_insert(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.prepare_insert(keys)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.insert(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.touch(keys)

    def order_chain(self, keys: Sequence[OffloadKey]) -> None:
        self.inner.order_chain(keys)

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        return self.inner.discard(keys)

    def clear(self) -> None:
        self.inner.clear()

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0 or not len(self.book):
            return self.inner.evict(n, protected)  # nothing hinted: the wrapped policy alone
        now = self.book.clock()
        low = [key for _, key in self.book.low(now) if key in self.inner and key not in protected][:n]
        not_ordinary = _NotOrdinary(protected, self.book, now)
        ordinary = self._ordinary(n - len(low), not_ordinary, now, protected)
        if ordinary is None:
            return None
        victims, high = ordinary
        self._discard(low)
        self._discard(high)
        return [*low, *victims, *high]

    def _ordinary(self, n: int, not_ordinary: _NotOrdinary, now: float,
                  protected: Container[OffloadKey]) -> tuple[list[OffloadKey], list[OffloadKey]] | None:
        """`n` victims: as many ordinary ones as there are (the wrapped policy's choice), the rest
        kept ones; None (nothing evicted) when there are not `n`."""
        if n == 0:
            return [], []
        victims = self.inner.evict(n, not_ordinary)
        if victims is not None:
            return victims, []
        high = [key for _, _, key in self.book.high(now) if key in self.inner and key not in protected]
        victims = []
        if (least := n - len(high)) > 0:  # the ordinary ones that must exist for `n` to be found
            victims = self.inner.evict(least, not_ordinary)
            if victims is None:
                return None
        step = n - len(victims)
        while step > 0 and len(victims) < n:  # every ordinary one left: their count is not known
            more = self.inner.evict(min(step, n - len(victims)), not_ordinary)
            if more is None:
                step //= 2
            else:
                victims.extend(more)
        return victims, high[:n - len(victims)]

    def _discard(self, keys: list[OffloadKey]) -> None:
        if keys and len(self.inner.discard(keys)) != len(keys):
            raise InvariantError(f"policy {self.name!r} lost keys it held while evicting by rank")


class _NotOrdinary:
    """Protects `protected` and every chunk the book ranks other than ORDINARY."""

    __slots__ = ("book", "now", "protected")

    def __init__(self, protected: Container[OffloadKey], book: RetentionBook, now: float):
        self.protected, self.book, self.now = protected, book, now

    def __contains__(self, key: object) -> bool:
        return key in self.protected or self.book.rank(key, self.now) != ORDINARY  # type: ignore[arg-type]
