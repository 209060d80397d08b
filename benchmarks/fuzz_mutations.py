"""Issue 20's defects 1-4, put back: to show that the stack fuzzer finds each of them.

Each mutation is a context manager that patches the fixed code back to what main had at
087adb5 (the smallest patch that restores the defective behaviour), and undoes it on exit.
`python benchmarks/fuzz_stack.py --mutation defect1` runs the fuzzer with one applied.

- defect1: the lazy store mode's ledger keeps one chunk per engine block, so a block shared
  by two unstored chunks (a prefix hit ending mid-chunk) forgets the older one when it is
  rewritten; that chunk is stored later with the block's new owner's KV.
- defect2: a disk store whose rename and then cleanup fail (EROFS, EIO) leaves its key
  claimed: the next store or delete of that key waits forever.
- defect3: a primary hit does not join the request's chain at lookup, so the request's own
  promotions may evict the hits its scan just found.
- defect4: a shared tier admits stores while its reset's sweep runs: the sweep deletes
  values the tier keeps as present (phantom hits).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from kvtier.keys import OffloadKey
from kvtier.scheduler import core, lazy
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.remote.tier import RemoteTier

__all__ = ["MUTATIONS", "mutation", "reaches"]


class _OneEntryPerBlockLedger(lazy.EvictionLedger):
    """087adb5's ledger: block -> the newest entry only (the displaced one is not dropped)."""

    def __init__(self) -> None:
        self._by_block: dict[int, lazy.LedgerEntry] = {}

    def __len__(self) -> int:
        return len(set(map(id, self._by_block.values())))

    def record(self, key: OffloadKey, group: int, blocks: Iterable[int], req_id: str, chunk: int) -> None:
        entry = lazy.LedgerEntry(key, group, tuple(blocks), req_id, chunk)
        for block in entry.blocks:
            self._by_block[block] = entry

    def forget(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            entry = self._by_block.pop(block, None)
            if entry is not None:
                self._drop_old(entry)

    def take(self, evictable: Iterable[int]) -> list[lazy.LedgerEntry]:
        taken: dict[str, list[lazy.LedgerEntry]] = {}
        for block in evictable:
            entry = self._by_block.get(block)
            if entry is not None:
                self._drop_old(entry)
                taken.setdefault(entry.req_id, []).append(entry)
        return [e for entries in taken.values() for e in sorted(entries, key=lambda e: (e.chunk, e.group))]

    def restore(self, entries: Iterable[lazy.LedgerEntry]) -> None:
        for entry in entries:
            for block in entry.blocks:
                self._by_block.setdefault(block, entry)

    def clear(self) -> None:
        self._by_block.clear()

    def _drop_old(self, entry: lazy.LedgerEntry) -> None:
        for block in entry.blocks:
            if self._by_block.get(block) is entry:
                del self._by_block[block]


def _publish_leaving_the_claim(self: DiskTier, key: OffloadKey, tmp: str, ticket: int) -> bool:
    """087adb5's `DiskTier._publish`: a failed cleanup after a failed rename skips the release."""
    index = self._index
    if not index.claim(key, lambda: index.pending.get(key) == ticket):
        self._files.discard_tmp(tmp, key)
        return False
    try:
        self._files.publish(tmp, key)
    except BaseException:
        self._files.discard_tmp(tmp, key)  # raises too: the release below never runs
        index.release(key)
        raise
    with self._lock:
        if index.commit(key, ticket):
            if not self.is_scanned:
                self._fresh.append(key)
            self._book.emit([key], removed=False)
            index.busy.discard(key)  # what 087adb5's commit did
            self._cond.notify_all()
            return True
    self._files.unlink(key)
    index.release(key)
    return False


def _rejected_only_while_broken(self: RemoteTier, job) -> bool:
    """087adb5's admission: jobs are refused while the breaker is open, not while a reset sweeps."""
    if not (self.breaker.is_open or self._workers.is_closed):
        return False
    self._counters["breaker_rejects"] += len(job.keys)
    self._book.finish(job, set(job.keys), 0, 0.0, "tier unavailable (breaker open)")
    return True


_PATCHES = {
    "defect1": [(core, "EvictionLedger", _OneEntryPerBlockLedger)],
    "defect2": [(DiskTier, "_publish", _publish_leaving_the_claim)],
    "defect3": [(CPUTierManager, "join_chain", lambda self, keys, ctx: None)],
    "defect4": [(RemoteTier, "_rejected_locked", _rejected_only_while_broken)],
}
MUTATIONS = tuple(_PATCHES)

# the configurations in which each defect can show at all (a FuzzConfig -> bool): a run with a
# mutation draws only these, so its budget is not spent where the defect has no code to run
_REACH = {
    "defect1": lambda config: config.store_mode == "lazy" and config.blocks_per_chunk > 1,
    "defect2": lambda config: config.disk is not None,
    "defect3": lambda config: config.disk is not None or config.redis is not None,
    "defect4": lambda config: config.redis is not None,
}


def reaches(name: str | None, config) -> bool:
    """Whether mutation `name` (None: none) has code to run in configuration `config`."""
    return name is None or _REACH[name](config)


@contextlib.contextmanager
def mutation(name: str | None) -> Iterator[None]:
    """Apply mutation `name` (None: none) for the duration of the block."""
    patches = _PATCHES[name] if name else []
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for owner, attr, value in patches:
        setattr(owner, attr, value)
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)
