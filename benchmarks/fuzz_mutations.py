"""Issue 20's defects 1-4 and issue 32's defects 1, 3, 4 and 5, put back: to show that the stack
fuzzer finds each of them.

Each mutation is a context manager that patches the fixed code back to what main had before the
fix (the smallest patch that restores the defective behaviour), and undoes it on exit.
`python benchmarks/fuzz_stack.py --mutation defect1` runs the fuzzer with one applied.

Issue 20 (main at 087adb5):

- defect1: the lazy store mode's ledger keeps one chunk per engine block, so a block shared
  by two unstored chunks (a prefix hit ending mid-chunk) forgets the older one when it is
  rewritten; that chunk is stored later with the block's new owner's KV.
- defect2: a disk store whose rename and then cleanup fail (EROFS, EIO) leaves its key
  claimed: the next store or delete of that key waits forever.
- defect3: a primary hit does not join the request's chain at lookup, so the request's own
  promotions may evict the hits its scan just found.
- defect4: a shared tier admits stores while its reset's sweep runs: the sweep deletes
  values the tier keeps as present (phantom hits).

Issue 32 (main at 0838b54):
- i32-defect2: a decision that wrote a tier off never tries it again (no exploration): nothing
  measures the tier any more, and no request loads from it again after a stall.
- i32-defect1: a lazy store's owner has no tenant: every tenant's evict-time stores are
  charged to tenant "", which shares "*": a tenant with a smaller quota holds more than it.
- i32-defect3: a lazy store's owner has no hints and acts for nobody: a keeper's chunks stored
  at eviction time are ordinary, and go before unhinted ones.
- i32-defect4: an S3 batch returns at its first failure (`pool.map`), while its other uploads
  still read the job's slab rows: once the manager hands the rows to other chunks, an upload
  sends their bytes under its own name (a value whose checksum fails; after a reset, a value
  the sweep missed: defect 5 on S3).
- i32-defect5: the reset's sweep does not count the jobs in flight, so it lists and deletes
  before an upload from before the reset lands (Redis too).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

from kvtier.hints import NO_HINTS
from kvtier.keys import OffloadKey
from kvtier.scheduler import core, lazy
from kvtier.scheduler.load_cost import LoadCosts
from kvtier.scheduler.stores import StorePlanning
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.remote.reset import ResetSweep
from kvtier.tiers.remote.s3 import S3Store
from kvtier.tiers.remote.tier import RemoteTier

__all__ = ["MUTATIONS", "mutation", "reaches"]


class _OneEntryPerBlockLedger(lazy.EvictionLedger):
    """087adb5's ledger: block -> the newest entry only (the displaced one is not dropped)."""

    def __init__(self) -> None:
        self._by_block: dict[int, lazy.LedgerEntry] = {}

    def __len__(self) -> int:
        return len(set(map(id, self._by_block.values())))

    def record(
        self, key: OffloadKey, group: int, blocks: Iterable[int], req_id: str, chunk: int
    ) -> None:
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
        return [
            e
            for entries in taken.values()
            for e in sorted(entries, key=lambda e: (e.chunk, e.group))
        ]

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
        # raises too: the release below never runs
        self._files.discard_tmp(tmp, key)
        index.release(key)
        raise
    with self._lock:
        if index.commit(key, ticket):
            if not self.is_scanned:
                self._fresh.append(key)
            self._book.emit([key], removed=False)
            # what 087adb5's commit did
            index.busy.discard(key)
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


def _lazy_owner_losing(**lost):
    """0838b54's lazy owner: `StorePlanning._eviction_owner` whose context loses `lost` (its
    tenant, or its hints and whose use it is)."""
    original = StorePlanning._eviction_owner

    def eviction_owner(self, computed_by):
        owner = original(self, computed_by)
        owner.req_context = dataclasses.replace(owner.req_context, **lost)
        return owner

    return eviction_owner


def _each_until_first_failure(self: S3Store, op, fn, items):
    """0838b54's `S3Store._each`: `pool.map` returns (raises) at the first failure, in item order,
    while the requests after it still run."""
    self._check_open()
    return [fn(item) for item in items] if len(items) <= 1 else list(self._pool.map(fn, items))


def _admit_uncounted(self: ResetSweep) -> int:
    """A sweep that does not count the jobs in flight (it never waits for them)."""
    return self.generation


def _job_over_uncounted(self: ResetSweep) -> None:
    with self._cond:
        self._cond.notify_all()


_PATCHES = {
    "defect1": [(core, "EvictionLedger", _OneEntryPerBlockLedger)],
    "defect2": [(DiskTier, "_publish", _publish_leaving_the_claim)],
    "defect3": [(CPUTierManager, "join_chain", lambda self, keys, ctx: None)],
    "defect4": [(RemoteTier, "_rejected_locked", _rejected_only_while_broken)],
    "i32-defect1": [(StorePlanning, "_eviction_owner", _lazy_owner_losing(tenant=None))],
    "i32-defect2": [
        (LoadCosts, "_explore", lambda self, state, start, locations, choice, costs, now: choice)
    ],
    "i32-defect3": [
        (StorePlanning, "_eviction_owner", _lazy_owner_losing(hints=NO_HINTS, on_behalf_of=None))
    ],
    "i32-defect4": [(S3Store, "_each", _each_until_first_failure)],
    "i32-defect5": [
        (ResetSweep, "admit_locked", _admit_uncounted),
        (ResetSweep, "job_over", _job_over_uncounted),
    ],
}
MUTATIONS = tuple(_PATCHES)

# the configurations in which each defect can show at all (a FuzzConfig -> bool): a run with a
# mutation draws only these, so its budget is not spent where the defect has no code to run
_REACH = {
    "defect1": lambda config: config.store_mode == "lazy" and config.blocks_per_chunk > 1,
    "defect2": lambda config: config.disk is not None,
    "defect3": lambda config: config.disk is not None or config.redis is not None,
    "defect4": lambda config: config.redis is not None,
    # lazy stores of a tenant whose quota is below another's ("*": the tenant "" the defect charged)
    "i32-defect1": lambda config: config.store_mode == "lazy"
    and any(t != "*" for t, _ in config.quotas),
    "i32-defect2": lambda config: config.load_costs == "measured",
    "i32-defect3": lambda config: config.store_mode == "lazy" and config.keepers,
    "i32-defect4": lambda config: config.s3 is not None,
    "i32-defect5": lambda config: config.redis is not None or config.s3 is not None,
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
