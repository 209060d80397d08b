"""`EvictionLedger`: the chunks a lazy (evict-time) store mode has yet to store.

In `store_mode="lazy"` a computed chunk is not stored when it is computed: the ledger
remembers which engine blocks hold it, and the scheduler stores it when those blocks are
next in line for eviction: at the end of each step the adapter passes the cached blocks no
request holds that the engine's next allocations would evict to
`OffloadScheduler.plan_evictions` — so the host tier holds what the engine is losing rather
than a second copy of what it still has.

Each entry keeps the context of the request that computed it (its tenant, hints and session):
the store made for it later is charged to that tenant's quota and hinted as that request asked
(issue 32, defects 1 and 3: under one owner of kvtier's own, every tenant shared one quota and
every hint was lost).

An entry is valid only while its blocks hold what they held when it was recorded: every
block the engine hands to a new owner (a request's newly written blocks) is forgotten
(`forget`), and an entry is dropped the moment any of its blocks is — also where a block
holds part of several entries (see `EvictionLedger`). Nothing here reads
or pins an engine block: a store planned from the ledger reads its blocks under the same
fences as any store (`kvtier.scheduler.jobs.TransferJobBook.stores_reading`).

Thread-safety: none; the scheduler's thread owns it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.base import ReqContext
from kvtier.keys import OffloadKey

__all__ = ["LedgerEntry", "EvictionLedger"]


@dataclass(frozen=True, slots=True, eq=False)
class LedgerEntry:
    """One computed, unstored chunk of one KV-cache group, and the engine blocks holding it;
    `owner` (the context of the request that computed it) and `chunk` say whose it is and where
    in its prompt."""

    key: OffloadKey
    group: int
    blocks: tuple[int, ...]
    owner: ReqContext
    chunk: int

    @property
    def req_id(self) -> str:
        """The id of the request that computed it."""
        return self.owner.req_id


class EvictionLedger:
    """Engine block -> the unstored chunks it holds.

    A block may hold part of several chunks: with several blocks per chunk, a request whose
    prefix hit ends inside a chunk shares that chunk's first blocks with the request that
    computed them (A's chunk 0 is [A0, A1], B's is [A0, B1]). Each chunk is valid only while
    every one of its blocks is, so a rewritten block drops every chunk it holds (issue 20:
    keeping only the newest chunk per block let A's chunk outlive A0 and be stored with the
    next owner's KV).
    """

    def __init__(self) -> None:
        # an insertion-ordered set per block
        self._by_block: dict[int, dict[LedgerEntry, None]] = {}
        self._num_entries = 0

    def __len__(self) -> int:
        """Chunks recorded and not stored, forgotten or taken."""
        return self._num_entries

    def record(
        self, key: OffloadKey, group: int, blocks: Iterable[int], owner: ReqContext, chunk: int
    ) -> None:
        """Chunk `chunk` of the request whose context is `owner` (key `key`, group `group`) is computed
        in `blocks` (chunks recorded earlier in the same blocks stay: a shared prefix block holds both)."""
        self._add(LedgerEntry(key, group, tuple(blocks), owner, chunk))

    def forget(self, blocks: Iterable[int]) -> None:
        """`blocks` are being rewritten: no chunk they held is there any more."""
        for block in blocks:
            for entry in list(self._by_block.get(block, ())):
                self._drop(entry)

    def take(self, evictable: Iterable[int]) -> list[LedgerEntry]:
        """The recorded chunks holding any of `evictable`, each once; they leave the ledger
        (`restore` puts back the ones that could not be stored).

        Ordered request by request (the request whose blocks go first, first; one request is
        one `owner` context, so a reused request id is another request) and head first within a
        request, the order a request offers its chunks in eager mode — eviction policies rank a
        chain's tail before its head by that order.
        """
        # keyed by the owner's identity: a context is not hashable (its kv_transfer_params are a dict)
        taken: dict[int, list[LedgerEntry]] = {}
        for block in evictable:
            for entry in list(self._by_block.get(block, ())):
                self._drop(entry)
                taken.setdefault(id(entry.owner), []).append(entry)
        return [
            e
            for entries in taken.values()
            for e in sorted(entries, key=lambda e: (e.chunk, e.group))
        ]

    def restore(self, entries: Iterable[LedgerEntry]) -> None:
        """Put back entries `take` returned (their blocks were not rewritten since)."""
        for entry in entries:
            self._add(entry)

    def clear(self) -> None:
        self._by_block.clear()
        self._num_entries = 0

    def _add(self, entry: LedgerEntry) -> None:
        for block in entry.blocks:
            self._by_block.setdefault(block, {})[entry] = None
        self._num_entries += 1

    def _drop(self, entry: LedgerEntry) -> None:
        by_block = self._by_block
        for block in entry.blocks:
            holders = by_block.get(block)
            if holders is not None:
                holders.pop(entry, None)
                if not holders:
                    del by_block[block]
        self._num_entries -= 1
