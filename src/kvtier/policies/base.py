"""The eviction-policy interface, kept apart from bookkeeping.

A `CachePolicy` only orders the READY keys of one tier. Slots, states and pins
belong to the tier manager, which tells the policy what happened (prepare_insert,
insert, touch, order_chain, discard, clear), asks it for victims (`evict`), and may
move keys in the order without counting a use (`rank_last`, `take_places`). Each
policy overrides these few hooks; none of them re-implements accounting.

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Sequence

from kvtier.errors import ConfigError, InvariantError
from kvtier.keys import OffloadKey

__all__ = ["CachePolicy"]


class CachePolicy(ABC):
    """Eviction order over the READY keys of one tier of `capacity` slots."""

    name = "base"

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ConfigError(f"a cache policy needs a positive capacity, got {capacity}")
        self.capacity = capacity

    def prepare_insert(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 (an optional hook)
        """`keys` are about to be stored: called before the evictions that make room for them.

        A policy with history (ARC's ghosts) looks the keys up here, before those evictions
        change the history.
        """

    @abstractmethod
    def insert(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` became READY; walked in reverse so the first key ends up most recent."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` were used; walked in reverse so a chain's tail is evicted before its prefix.

        Keys the policy does not hold are ignored.
        """

    def order_chain(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` are one prefix chain, head first, all held: rank them so that none is evicted
        before a key after it (a tail is useless without its head). Not a use of the keys.

        The default is `touch`, right for policies where a touch only moves recency; a policy
        that counts uses in `touch` (ARC) overrides it.
        """
        self.touch(keys)

    def rank_last(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 (an optional hook)
        """Rank held `keys` to be evicted no sooner than a key used now (in the order given), without
        counting a use: the tier cannot evict them for a while (`kvtier.tiers.cpu.chains`), and they
        must not stand in the way of every eviction's scan meanwhile.

        The default does nothing: they stay where they are, skipped by each scan.
        """

    def take_places(self, keys: Sequence[OffloadKey], victims: Sequence[OffloadKey]) -> None:  # noqa: B027
        """Each held `keys[i]` takes the place `victims[i]` had, just before it was evicted: the deeper
        chunk of its prefix was the next victim, and so would it have been (in the list it was in,
        for a policy with several). Not a use; keys ranked first in the order given.

        The default does nothing: they keep their place.
        """

    def evict_in_place(
        self, key: OffloadKey, victim: OffloadKey, protected: Container[OffloadKey]
    ) -> bool:
        """`take_places([key], [victim])`; then, if `key` is the victim `evict(1, protected)` would
        choose now, evict it as `evict` does. An eviction that needs more victims asks this of each
        head a victim freed: a chain goes tail first at the cost of one such call a chunk.

        Returns:
            Whether `key` was evicted. The default never evicts (the caller asks `evict`).
        """
        self.take_places((key,), (victim,))
        return False

    @abstractmethod
    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        """Choose and forget `n` victims, none of them in `protected`.

        Atomic: when fewer than `n` keys can be evicted nothing changes.

        Returns:
            The victims in eviction order, or None when there are not `n` candidates.
        """

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Forget `keys` if held: they were lost outside the policy's choice (a corrupt or
        deleted file), so this is no eviction and leaves no history behind.

        O(1) per key in the built-in policies. This default, for out-of-tree policies that do
        not override it, is one O(n) pass through `evict` (and leaves whatever history an
        eviction leaves).

        Returns:
            The keys that were held, in the order given (each once).
        """
        held = [key for key in dict.fromkeys(keys) if key in self]
        if held and self.evict(len(held), _AllBut(held)) is None:
            raise InvariantError(f"policy {self.name!r} could not evict {len(held)} keys it holds")
        return held

    @abstractmethod
    def clear(self) -> None:
        """Forget every key (and any history)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of keys held (READY keys of the tier)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether the policy holds `key`."""


class _AllBut:
    """Protects every key but `keys`: makes `evict` take exactly those."""

    __slots__ = ("keys",)

    def __init__(self, keys: Sequence[OffloadKey]):
        self.keys = set(keys)

    def __contains__(self, key: object) -> bool:
        return key not in self.keys
