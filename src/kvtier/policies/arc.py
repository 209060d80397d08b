"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03) as an eviction policy.

T1 holds keys used once since they entered, T2 keys used at least twice. Ghost lists
B1 and B2 remember keys recently evicted from T1 and T2 (keys only, no slots). A key
stored again while in B1 means T1 was too small: the target size `p` of T1 grows;
one in B2 shrinks it. Eviction takes from T1 while it is larger than `p`, else from
T2. Each ghost list is bounded by the capacity.

As in ARC itself, a ghost hit is taken when a key is about to be stored
(`prepare_insert`), before the evictions that make room for it — those push older keys
into the ghost lists and trim the oldest ghosts, which are often the very keys being
stored again. The key then enters T2 when its store completes.

A key the tier lost (`discard`: a corrupt or deleted file) leaves T1 or T2 without becoming
a ghost: ARC did not choose it, so storing it again says nothing about the size of T1.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence

from kvtier.keys import OffloadKey
from kvtier.policies.base import CachePolicy

__all__ = ["ARCPolicy"]


class ARCPolicy(CachePolicy):
    """ARC over the READY keys of one tier; `target_t1` is the adaptive target `p`."""

    name = "arc"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.target_t1 = 0.0
        # oldest first
        self.t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        # ghost hits whose store is in flight
        self._returning: OrderedDict[OffloadKey, None] = OrderedDict()

    def prepare_insert(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            if key in self.b1:
                self._adapt(+max(1.0, len(self.b2) / len(self.b1)))
                del self.b1[key]
            elif key in self.b2:
                self._adapt(-max(1.0, len(self.b1) / len(self.b2)))
                del self.b2[key]
            else:
                continue
            self._returning[key] = None
            # stores that never completed
            if len(self._returning) > self.capacity:
                self._returning.popitem(last=False)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self.t1 or key in self.t2:
                self.touch((key,))
            elif key in self._returning:
                del self._returning[key]
                self.t2[key] = None
            else:
                self.t1[key] = None

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2 = self.t1, self.t2
        for key in reversed(keys):
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def order_chain(self, keys: Sequence[OffloadKey]) -> None:
        # A head is used at least as often as its tail (no tail is usable without it): the
        # keys before the chain's last T2 key belong in T2 too. Then, within each list, the
        # head ends up most recent.
        last_t2 = max((i for i, key in enumerate(keys) if key in self.t2), default=0)
        for key in keys[:last_t2]:
            if key in self.t1:
                del self.t1[key]
                self.t2[key] = None
        for key in reversed(keys):
            if key in self.t1:
                self.t1.move_to_end(key)
            else:
                self.t2.move_to_end(key)

    def rank_last(self, keys: Sequence[OffloadKey]) -> None:
        """To the most recent end of its own list (not a use: a T1 key stays in T1)."""
        for key in keys:
            if key in self.t1:
                self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)

    def take_places(self, keys: Sequence[OffloadKey], victims: Sequence[OffloadKey]) -> None:
        """To the least recent end of the list its victim left (its ghost says which): a head is used at
        least as often as its tail, so one whose tail left T2 moves into T2; one in T2 whose tail left
        T1 keeps its place."""
        for key, victim in zip(reversed(keys), reversed(victims), strict=True):
            if victim in self.b2 and key in self.t1:
                del self.t1[key]
                self.t2[key] = None
            if key in self.t2 and victim in self.b2:
                self.t2.move_to_end(key, last=False)
            elif key in self.t1:
                self.t1.move_to_end(key, last=False)

    def evict_in_place(
        self, key: OffloadKey, victim: OffloadKey, protected: Container[OffloadKey]
    ) -> bool:
        """Moved to the least recent end of its list, an unprotected key is the next victim when ARC
        takes from that list now (T1 while it is larger than its target); otherwise (a T2 head whose
        tail left T1 keeps its place) `evict` decides."""
        self.take_places((key,), (victim,))
        live = self._list_of(key)
        if live is None or next(iter(live)) != key or key in protected:
            return False
        is_t1 = live is self.t1
        if is_t1 != (len(self.t1) > self.target_t1):
            return False
        self._evict_from(key, is_t1)
        return True

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        from_t1 = self._candidates(self.t1, protected)
        from_t2 = self._candidates(self.t2, protected)
        size_t1 = len(self.t1)
        # (victim, came from T1)
        plan: list[tuple[OffloadKey, bool]] = []
        for _ in range(n):
            prefer_t1 = size_t1 > self.target_t1
            first, second = (from_t1, from_t2) if prefer_t1 else (from_t2, from_t1)
            key = next(first, None)
            is_t1 = prefer_t1
            if key is None:
                key = next(second, None)
                is_t1 = not prefer_t1
            if key is None:
                return None
            size_t1 -= is_t1
            plan.append((key, is_t1))
        for key, is_t1 in plan:
            self._evict_from(key, is_t1)
        return [key for key, _ in plan]

    def evict_keys(self, keys: Sequence[OffloadKey]) -> None:
        """Forget `keys` as evicted, chosen by another policy (`kvtier.policies.adaptive`): each
        becomes a ghost of its list, as if ARC had chosen it; keys not held are ignored."""
        for key in keys:
            if key in self.t1:
                self._to_ghost(key, self.t1, self.b1)
            elif key in self.t2:
                self._to_ghost(key, self.t2, self.b2)

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        held = []
        for key in keys:
            live = self._list_of(key)
            if live is not None:
                del live[key]
                held.append(key)
        return held

    def clear(self) -> None:
        for d in (self.t1, self.t2, self.b1, self.b2, self._returning):
            d.clear()
        self.target_t1 = 0.0

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def _adapt(self, delta: float) -> None:
        self.target_t1 = min(max(self.target_t1 + delta, 0.0), float(self.capacity))

    def _list_of(self, key: OffloadKey) -> OrderedDict[OffloadKey, None] | None:
        """T1 or T2, whichever holds `key` (None: neither)."""
        if key in self.t1:
            return self.t1
        if key in self.t2:
            return self.t2
        return None

    def _evict_from(self, key: OffloadKey, is_t1: bool) -> None:
        """`key` leaves T1 (`is_t1`) or T2 for that list's ghosts, B1 or B2."""
        if is_t1:
            self._to_ghost(key, self.t1, self.b1)
        else:
            self._to_ghost(key, self.t2, self.b2)

    def _to_ghost(self, key: OffloadKey, live: OrderedDict, ghost: OrderedDict) -> None:
        del live[key]
        ghost[key] = None
        if len(ghost) > self.capacity:
            ghost.popitem(last=False)

    @staticmethod
    def _candidates(order: OrderedDict, protected: Container[OffloadKey]) -> Iterator[OffloadKey]:
        return (k for k in order if k not in protected)
