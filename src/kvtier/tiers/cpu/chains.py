"""Prefix chains in the CPU tier: which held chunk continues which, so that a head is never
evicted before its tail (`ChainLinks`).

A tail is useless without its head: a lookup stops at the first chunk that is missing. So the
tier evicts a chunk only when no deeper chunk of its prefix is held — leaves first, as a
radix-tree prefix cache does. A chunk that has a held continuation is *parked*: an eviction
spares it (the tier's protected set asks `is_parked`) — unless nothing else can go: a tail
pinned a moment (its write-through) must not fail a store — and it is ranked out of the way of
the eviction scans (`CachePolicy.rank_last`, not a use), again whenever a scan had to pass it. When
its last continuation is evicted it takes that one's place (`CachePolicy.take_places`, or
`evict_in_place` when the eviction needs more victims: it is then the next one, as it would have
been had the whole chain been ranked behind its tail) — unless a request used it while it was
parked, which put it where that use belongs.

This replaced re-ranking a request's whole chain after every store it completed, O(prefix) per
store (issue 32: a one-chunk store of a 4,000-chunk prefix took 1.3 ms with LRU and 10 ms with
the adaptive policy). Here a store, an eviction and a touch cost O(1) per chunk; a parked chunk
is passed by a scan at most once per round of the policy's order (it is then ranked last again).

Links are learned from the requests' chains (`RequestLedger.parents`): when a chunk becomes READY,
its parent is the chunk before it in its request's chain if that one is READY (chunk by chunk
across KV-cache groups, so a chain with several groups is evicted tail first across them too),
else the chunk before it in its own group if READY. A link is made only then, so a parent was
READY before its child: links never form a cycle, whatever keys a caller passes, and every chain
has an unparked chunk (its tail).

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvtier.errors import InvariantError
from kvtier.keys import OffloadKey
from kvtier.policies import CachePolicy
from kvtier.tiers.cpu.ledger import Parents

__all__ = ["ChainLinks"]


class ChainLinks:
    """The parent of each linked READY chunk, and the parked chunks, of one tier with `policy`."""

    def __init__(self, policy: CachePolicy):
        self._policy = policy
        # linked chunk -> the chunk it continues
        self._parent: dict[OffloadKey, OffloadKey] = {}
        # parked chunk -> its linked continuations
        self._children: dict[OffloadKey, set[OffloadKey]] = {}
        # parked chunks used since they were last ranked last
        self._used: set[OffloadKey] = set()

    @property
    def num_parked(self) -> int:
        return len(self._children)

    def is_parked(self, key: OffloadKey) -> bool:
        return key in self._children

    def link(
        self,
        keys: Sequence[OffloadKey],
        parents: Sequence[Parents],
        is_ready: Callable[[OffloadKey], bool],
    ) -> None:
        """`keys` just became READY; `parents[i]` are the chunks `keys[i]` continues (in its chain, in
        its group): it is linked to the first that is READY. A parent that gets its first
        continuation is parked."""
        newly_parked: list[OffloadKey] = []
        for key, (in_chain, in_group) in zip(keys, parents, strict=True):
            if in_chain is not None and in_chain != key and is_ready(in_chain):
                parent = in_chain
            elif in_group is not None and in_group != key and is_ready(in_group):
                parent = in_group
            else:
                continue
            self._attach(key, parent, newly_parked)
        self.rank_last(newly_parked)

    def rank_last(self, keys: Sequence[OffloadKey]) -> None:
        """Parked `keys` out of the way of the eviction scans (the last place; not a use)."""
        if keys:
            self._policy.rank_last(keys)
            self._used.difference_update(keys)

    def used(self, keys: Iterable[OffloadKey]) -> None:
        """A request used `keys` (a touch): parked ones keep the place that use gave them."""
        if self._children:
            self._used.update(self._children.keys() & set(keys))

    def unlink(
        self, victims: Iterable[OffloadKey], links: list[tuple[OffloadKey, OffloadKey | None]]
    ) -> list[tuple[OffloadKey, OffloadKey]]:
        """`victims` were evicted: heads left without a continuation are evictable again. (A parked
        victim, evicted because nothing else could go, leaves its continuations unlinked.) Each
        victim's link is added to `links` (for `relink`).

        Returns:
            The freed heads that are to take their tails' places, each with its tail (those used
            while parked keep the place that use gave them).
        """
        places: list[tuple[OffloadKey, OffloadKey]] = []
        for key in victims:
            if key in self._children:
                for child in self._children.pop(key):
                    del self._parent[child]
                self._used.discard(key)
            parent = self._parent.pop(key, None)
            links.append((key, parent))
            if parent is None:
                continue
            children = self._children[parent]
            children.discard(key)
            if children:
                continue
            del self._children[parent]
            if parent in self._used:
                self._used.discard(parent)
            else:
                places.append((parent, key))
        return places

    def relink(self, links: Iterable[tuple[OffloadKey, OffloadKey | None]]) -> None:
        """Undo `unlink` of victims put back (the links it noted, in reverse order): a head they freed
        is parked again."""
        newly_parked: list[OffloadKey] = []
        for key, parent in links:
            if parent is not None:
                self._attach(key, parent, newly_parked)
        self.rank_last(newly_parked)

    def _attach(self, key: OffloadKey, parent: OffloadKey, newly_parked: list[OffloadKey]) -> None:
        """Link `key` to `parent`; a parent that gets its first continuation is added to `newly_parked`."""
        self._parent[key] = parent
        children = self._children.get(parent)
        if children is None:
            children = set()
            self._children[parent] = children
            newly_parked.append(parent)
        children.add(key)

    def clear(self) -> None:
        """Forget every link (a reset: every chunk leaves)."""
        self._parent.clear()
        self._children.clear()
        self._used.clear()

    def check(self, ready: set[OffloadKey]) -> None:
        """Cross-check the links against the READY chunks (O(n); for tests).

        Raises:
            InvariantError: naming the first inconsistency found.
        """
        children: dict[OffloadKey, set[OffloadKey]] = {}
        for key, parent in self._parent.items():
            if key not in ready or parent not in ready:
                raise InvariantError("a chain link names a chunk that is not READY")
            children.setdefault(parent, set()).add(key)
        if children != self._children:
            raise InvariantError(
                "the parked chunks differ from the chunks with a linked continuation"
            )
        if not self._used <= children.keys():
            raise InvariantError("a chunk is marked used while parked but is not parked")
