"""Client hints at eviction time: what requests asked to keep or to drop (`RetentionBook`).

The book records, per chunk, what the requests that used it said (`kvtier.hints`): how long to
keep it, its priority, its sessions, whether they ended. One book serves every tier of a manager:
the CPU and disk tiers evict by its ranks (`kvtier.policies.retaining.RetainingPolicy`, which
subscribes to its changes), a shared store sets a value's lifetime from `kept_until`.

A chunk's `Rank` is its `Band` (what its hints say now), then its priority; lower ranks are
evicted first. `ORDINARY` (`Band.NOT_KEPT`, priority 0) is the rank of a chunk without a live
hint: never hinted, or its hints expired.
How a tier evicts each band, and when it stops honoring an `EXPECTED` chunk (the guard and the
horizon), is explained once, in `kvtier.policies.retaining`.

Priority: the highest any request gave the chunk; never below 0 once a request without that
wish used it (another session, an unhinted request, or one that found the chunk already stored).
A session (per tenant: `cache_salt`) ending drops only the chunks no one else used. Any later
use of a dropped chunk makes it ordinary again. The book remembers the last `max_entries` hinted
chunks (older ones become ordinary), and which tenant stored each recent chunk once a tier
enforces tenant quotas (`track_tenants`): such a tier gets keys from the manager, never requests.

Thread-safety: locked; it calls its subscribers after releasing its lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum
from typing import NamedTuple, Protocol

from kvtier.errors import ConfigError
from kvtier.hints import Hints
from kvtier.keys import OffloadKey

__all__ = ["ORDINARY", "Band", "Order", "Rank", "RetentionBook"]


class Band(IntEnum):
    """What a chunk's hints say now: the first field of its `Rank` (lowest evicted first)."""

    # its session ended and no other session or request used it (`end_session`)
    DROPPED = -1
    # no live hint keeps it (none, or expired): ordinary, unless its priority is not 0
    NOT_KEPT = 0
    # expected back: `next_turn_s` not expired (a prediction, which a tier may stop honoring)
    EXPECTED = 1
    # retained: `retain_s` not expired (the client's instruction)
    RETAINED = 2


class Rank(NamedTuple):
    """A chunk's rank: compared as a tuple (band first, then priority), lowest evicted first."""

    band: Band
    # the highest priority any request gave the chunk (never below 0 once shared)
    priority: int

    def __str__(self) -> str:
        return f"{self.band.name} at priority {self.priority}"


class Order(NamedTuple):
    """How the book breaks ties within a rank (`RetentionBook.order`)."""

    # kept until then (the book's clock): the end of its `retain_s` or `next_turn_s`
    until: float
    # when it was last hinted (the book's counter)
    seq: int


ORDINARY = Rank(Band.NOT_KEPT, 0)
_NEVER = float("-inf")


class _Entry:
    __slots__ = ("is_dropped", "is_shared", "owners", "priority", "retained", "seq", "until")

    def __init__(self, seq: int) -> None:
        # kept until then (the scheduler's clock): retained or expected
        self.until = _NEVER
        # retained until then (`retain_s`; never after `until`)
        self.retained = _NEVER
        self.priority = 0
        # who hinted it: (tenant, session) names, or requests without one
        self.owners: set[str] = set()
        # used outside its sessions: their end does not drop it
        self.is_shared = False
        # its session ended
        self.is_dropped = False
        # when it was last hinted (a counter)
        self.seq = seq

    def rank(self, now: float) -> Rank:
        return Rank(self.band(now), self.priority)

    def band(self, now: float) -> Band:
        if self.is_dropped:
            return Band.DROPPED
        if self.retained > now:
            return Band.RETAINED
        if self.until > now:
            return Band.EXPECTED
        return Band.NOT_KEPT

    def state(self, now: float) -> tuple[Band, int, float, float]:
        """What a hint may change that the book's subscribers must hear of: the rank's fields,
        `until` and `retained`."""
        return (self.band(now), self.priority, self.until, self.retained)

    def next_change(self, now: float) -> float:
        """When its rank drops next by time alone."""
        return self.retained if self.retained > now else self.until


class RankListener(Protocol):
    def ranks_changed(self, keys: Sequence[OffloadKey]) -> None: ...


class RetentionBook:
    """The hints of the chunks requests used; see the module docstring.

    Args:
        clock: the clock hint durations count on (the scheduler's; `set_clock` changes it).
        max_entries: chunks remembered at most (the least recently hinted are forgotten).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = 1 << 16):
        if max_entries <= 0:
            raise ConfigError(
                f"a retention book needs room for entries, got max_entries={max_entries}"
            )
        self.clock = clock
        self.max_entries = max_entries
        # set by a tier with tenant quotas
        self.track_tenants = False
        self._entries: OrderedDict[OffloadKey, _Entry] = OrderedDict()
        self._sessions: dict[str, dict[OffloadKey, None]] = {}
        self._tenants: OrderedDict[OffloadKey, str] = OrderedDict()
        self._listeners: list[RankListener] = []
        # forgotten while the lock is held: ordinary now, to tell
        self._forgotten: list[OffloadKey] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def set_clock(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def subscribe(self, listener: RankListener) -> None:
        """`listener.ranks_changed(keys)` after every change of ranks (not expiries: those are read)."""
        self._listeners.append(listener)

    def note(
        self,
        keys: Sequence[OffloadKey],
        hints: Hints,
        tenant: str | None = None,
        is_new: bool = False,
        req_id: str = "",
    ) -> None:
        """Request `req_id` of `tenant` with `hints` used `keys` now; `is_new`: it stored them (else
        they were already there, so someone else used them first)."""
        with self._lock:
            changed: list[OffloadKey] = []
            if hints.is_empty:
                entries = self._entries
                for key in keys:
                    # (`_share` asks the same first: most keys were never hinted)
                    if key in entries and self._share(key):
                        changed.append(key)
            else:
                now = self.clock()
                until = _NEVER
                if hints.keep_s > 0:
                    until = now + hints.keep_s
                retained = _NEVER
                if hints.retain_s > 0:
                    retained = now + hints.retain_s
                session = None
                if hints.session is not None:
                    session = f"{tenant or ''}\x00{hints.session}"
                # a request without a session owns what it alone used
                owner = session or f"\x01{req_id}"
                for key in keys:
                    if self._hint(key, hints, until, retained, session, owner, is_new):
                        changed.append(key)
            changed += self._forgotten
            self._forgotten = []
        self._tell(changed)

    def end_session(
        self, hints: Hints, keys: Iterable[OffloadKey], tenant: str | None = None
    ) -> None:
        """The request of `tenant` with `hints` (its `end_session` set) ended having used `keys`: its
        session's chunks that nothing else used go first from now on."""
        with self._lock:
            ended = dict.fromkeys(keys)
            if hints.session is not None:
                ended.update(self._sessions.pop(f"{tenant or ''}\x00{hints.session}", {}))
            changed = []
            for key in ended:
                entry = self._entries.get(key)
                if entry is not None and not entry.is_shared and not entry.is_dropped:
                    entry.is_dropped = True
                    changed.append(key)
        self._tell(changed)

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

    def rank(self, key: OffloadKey, now: float) -> Rank:
        entry = self._entries.get(key)
        return ORDINARY if entry is None else entry.rank(now)

    def order(self, key: OffloadKey) -> Order:
        """When `key` is kept until and when it was last hinted: ties within a rank are broken by
        them."""
        entry = self._entries.get(key)
        if entry is None:
            return Order(_NEVER, 0)
        return Order(entry.until, entry.seq)

    def next_change(self, key: OffloadKey, now: float) -> float:
        """When `key`'s rank drops next by time alone (-inf: never)."""
        entry = self._entries.get(key)
        return _NEVER if entry is None else entry.next_change(now)

    def hinted_keys(self) -> list[OffloadKey]:
        """Every chunk the book remembers."""
        with self._lock:
            return list(self._entries)

    def kept_until(self, key: OffloadKey) -> float | None:
        """Until when (the book's clock) `key` is to be kept, or None."""
        entry = self._entries.get(key)
        if entry is None or entry.is_dropped or entry.until == _NEVER:
            return None
        return entry.until

    def clear(self) -> None:
        with self._lock:
            keys = list(self._entries)
            self._entries.clear()
            self._sessions.clear()
            self._tenants.clear()
        self._tell(keys)

    def __len__(self) -> int:
        return len(self._entries)

    def _hint(
        self,
        key: OffloadKey,
        hints: Hints,
        until: float,
        retained: float,
        session: str | None,
        owner: str,
        is_new: bool,
    ) -> bool:
        """Note `hints` on `key` (kept until `until`, retained until `retained`); whether its rank,
        `until` or `retained` changed."""
        entry = self._entries.get(key)
        before = None
        if entry is not None:
            before = entry.state(self.clock())
        if entry is None:
            entry = _Entry(next(self._seq))
            self._entries[key] = entry
            entry.priority = hints.priority
            # found stored: someone's before
            entry.is_shared = not is_new
            self._forget_oldest()
        else:
            self._entries.move_to_end(key)
            entry.priority = max(entry.priority, hints.priority)
            entry.seq = next(self._seq)
            entry.is_shared |= owner not in entry.owners
        entry.until = max(entry.until, until)
        entry.retained = max(entry.retained, retained)
        entry.is_dropped = False
        if entry.is_shared:
            # nobody's alone: no session's end drops it, so no session lists it
            entry.priority = max(entry.priority, 0)
            self._unlist(key, entry)
        else:
            entry.owners.add(owner)
            if session is not None:
                self._sessions.setdefault(session, {})[key] = None
        return before != entry.state(self.clock())

    def _share(self, key: OffloadKey) -> bool:
        """An unhinted request used `key`: it is nobody's alone, and no longer dropped."""
        entry = self._entries.get(key)
        if entry is None or (entry.is_shared and not entry.is_dropped and entry.priority >= 0):
            return False
        entry.is_shared = True
        entry.is_dropped = False
        entry.priority = max(entry.priority, 0)
        self._unlist(key, entry)
        return True

    def _forget_oldest(self) -> None:
        while len(self._entries) > self.max_entries:
            key, entry = self._entries.popitem(last=False)
            self._unlist(key, entry)
            self._forgotten.append(key)

    def _unlist(self, key: OffloadKey, entry: _Entry) -> None:
        """Take `key` out of every session's list (its owners' sessions)."""
        for owner in entry.owners:
            keys = self._sessions.get(owner)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._sessions[owner]
        entry.owners.clear()

    def _tell(self, keys: Sequence[OffloadKey]) -> None:
        if keys:
            for listener in self._listeners:
                listener.ranks_changed(keys)
