"""`EvictionLedger`: the chunks a lazy (evict-time) store mode has yet to store.

In `store_mode="lazy"` a computed chunk is not stored when it is computed: the ledger
remembers which engine blocks hold it, and the scheduler stores it when the engine says
those blocks are next in line for eviction (`StepView.evictable_block_ids`) — so the host
tier holds what the engine is losing rather than a second copy of what it still has.

An entry is valid only while its blocks hold what they held when it was recorded: every
block the engine hands to a new owner (a request's newly written blocks) is forgotten
(`forget`), and an entry is dropped the moment any of its blocks is. Nothing here reads
or pins an engine block: a store planned from the ledger reads its blocks under the same
fences as any store (`kvtier.scheduler.jobs.JobBook.stores_reading`).

Thread-safety: none; the scheduler's thread owns it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.keys import OffloadKey

__all__ = ["LedgerEntry", "EvictionLedger"]


@dataclass(frozen=True, slots=True, eq=False)
class LedgerEntry:
    """One computed, unstored chunk of one KV-cache group, and the engine blocks holding it;
    `req_id` and `chunk` say which request computed it and where in its prompt."""

    key: OffloadKey
    group: int
    blocks: tuple[int, ...]
    req_id: str
    chunk: int


class EvictionLedger:
    """Engine block -> the unstored chunk it holds (at most one per block)."""

    def __init__(self) -> None:
        self._by_block: dict[int, LedgerEntry] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    def record(self, key: OffloadKey, group: int, blocks: Iterable[int], req_id: str, chunk: int) -> None:
        """Chunk `chunk` of request `req_id` (key `key`, group `group`) is computed in `blocks`
        (replaces what they held before)."""
        entry = LedgerEntry(key, group, tuple(blocks), req_id, chunk)
        for block in entry.blocks:
            self._by_block[block] = entry

    def forget(self, blocks: Iterable[int]) -> None:
        """`blocks` are being rewritten: the chunks they held are no longer there."""
        by_block = self._by_block
        for block in blocks:
            entry = by_block.pop(block, None)
            if entry is not None:
                self._drop(entry)

    def take(self, evictable: Iterable[int]) -> list[LedgerEntry]:
        """The recorded chunks holding any of `evictable`, each once; they leave the ledger
        (`restore` puts back the ones that could not be stored).

        Ordered request by request (the request whose blocks go first, first) and head first
        within a request, the order a request offers its chunks in eager mode — eviction
        policies rank a chain's tail before its head by that order.
        """
        taken: dict[str, list[LedgerEntry]] = {}
        by_block = self._by_block
        for block in evictable:
            entry = by_block.get(block)
            if entry is not None:
                self._drop(entry)
                taken.setdefault(entry.req_id, []).append(entry)
        return [e for entries in taken.values() for e in sorted(entries, key=lambda e: (e.chunk, e.group))]

    def restore(self, entries: Iterable[LedgerEntry]) -> None:
        """Put back entries `take` returned (their blocks were not rewritten since)."""
        for entry in entries:
            for block in entry.blocks:
                self._by_block.setdefault(block, entry)

    def clear(self) -> None:
        self._by_block.clear()

    def _drop(self, entry: LedgerEntry) -> None:
        by_block = self._by_block
        for block in entry.blocks:
            if by_block.get(block) is entry:
                del by_block[block]
