"""The eviction-policy interface, kept apart from bookkeeping.

A `CachePolicy` only orders the READY keys of one tier. Slots, states and pins
belong to the tier manager, which tells the policy what happened (insert, touch,
remove, clear) and asks it for victims (`evict`). Each policy overrides these few
hooks; none of them re-implements accounting.

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Sequence

from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey

__all__ = ["CachePolicy"]


class CachePolicy(ABC):
    """Eviction order over the READY keys of one tier of `capacity` slots."""

    name = "base"

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ConfigError(f"a cache policy needs a positive capacity, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` became READY; walked in reverse so the first key ends up most recent."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` were used; walked in reverse so a chain's tail is evicted before its prefix.

        Keys the policy does not hold are ignored.
        """

    @abstractmethod
    def remove(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` left the tier without an eviction (rollback, reset); unknown keys are ignored."""

    @abstractmethod
    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        """Choose and forget `n` victims, none of them in `protected`.

        Atomic: when fewer than `n` keys can be evicted nothing changes.

        Returns:
            The victims in eviction order, or None when there are not `n` candidates.
        """

    @abstractmethod
    def clear(self) -> None:
        """Forget every key (and any history)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of keys held (READY keys of the tier)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether the policy holds `key`."""
