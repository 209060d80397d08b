"""The disk tier: one file per chunk in a local directory, the index in memory.

`DiskTier` drives one module per concept: `index` (what is where, and the room),
`files` (which file holds a chunk), `format` (what a file holds), `reports`
(results, events, counters), `upkeep` (scans, the reset sweep, deletions: the part of the
tier that keeps the directory and the index in agreement) and `workers` (the threads).

- The manager's thread only does bookkeeping (lookups, reservations, evictions); a read
  pool and a write pool do the I/O, one task per chunk, and finished jobs queue up for
  `get_finished`. A housekeeping thread rebuilds the index from the directory at start
  (lookups answer MISS until it is done), deletes everything after `reset()`, and with
  `rescan_s` adopts files that other engines sharing the directory wrote.
- A store in flight at `reset()` (its ticket is gone) deletes its own file instead of publishing.
  Evicted files become spares later stores overwrite (`files`); lost or corrupt ones are unlinked.
- Deadlines (`TierJob.deadline`): a chunk whose I/O has not started by then is not read or
  written (`expired`); a read that ends after it is reported failed (`late`), its file kept.

Thread-safety: the public methods are called from one thread (the manager's). Pool
threads touch the shared state (index, job book) only under `_lock`, which is never held
across I/O; the manager's thread never waits for I/O.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from kvtier.base import LookupResult, OffloadingEvent
from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey
from kvtier.policies.retention import RetentionBook
from kvtier.tiers.disk.files import ChunkFiles
from kvtier.tiers.disk.format import choose_direct_io
from kvtier.tiers.disk.index import DiskIndex, Spared
from kvtier.tiers.disk.reports import DiskJob, DiskReports, FailureLog
from kvtier.tiers.disk.root import make_directory
from kvtier.tiers.disk.upkeep import DirectoryUpkeep
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.quotas import in_slots
from kvtier.tiers.secondary import SecondaryTier, TierJob, TierResult, TierStats
from kvtier.tiers.workers import Workers

__all__ = ["DiskTier"]

logger = logging.getLogger(__name__)


class DiskTier(DirectoryUpkeep, SecondaryTier):
    """Chunks as files under `<root>/<namespace id>/`, at most `capacity_bytes` of them.

    Args:
        root: directory shared by every namespace (created if needed).
        namespace: what the chunks' bytes mean; engines of another namespace never see them.
        capacity_bytes: disk budget; capacity in files = capacity_bytes // file_bytes.
        policy: eviction policy name ("lru", "arc") or "module:Class".
        fsync: make each file and its rename durable before the store succeeds.
        direct_io: O_DIRECT for aligned buffers; None = where the filesystem allows it.
        num_read_threads, num_write_threads: I/O pool sizes (each O_DIRECT transfer waits on the
            device, not the CPU: 4 in flight measured faster than 2; see benchmarks/README.md).
        enable_events: record stored/removed events for `take_events`.
        rescan_s: every so many seconds, adopt files other engines wrote (None = never).
        file_mode: mode of the chunk files, 0o600 or 0o640 (directories: 0o700, 0o750).
        tenant_quotas: bytes of files each tenant may hold ({cache_salt or "*": bytes}; `DiskIndex`).
    Raises:
        ConfigError: the root is not a writable directory, another user owns it or every user
            may write it (see `kvtier.tiers.disk.root`), the budget holds no file, or
            direct_io=True where the filesystem refuses O_DIRECT.
    """

    medium = "disk"

    def __init__(
        self,
        root: str | Path,
        namespace: Namespace,
        capacity_bytes: int,
        *,
        policy: str = "lru",
        fsync: bool = False,
        direct_io: bool | None = None,
        num_read_threads: int = 4,
        num_write_threads: int = 4,
        enable_events: bool = True,
        rescan_s: float | None = None,
        file_mode: int = 0o600,
        tenant_quotas: dict[str, int] | None = None,
    ):
        if min(num_read_threads, num_write_threads) < 1 or (rescan_s is not None and rescan_s <= 0):
            raise ConfigError(
                "num_read_threads and num_write_threads must be >= 1, rescan_s > 0 or None"
            )
        directory, dir_fd = make_directory(Path(root), namespace, file_mode)
        try:
            direct = choose_direct_io(directory, direct_io)
        except BaseException:
            os.close(dir_fd)
            raise
        self._files = ChunkFiles(
            directory,
            dir_fd,
            namespace.id,
            namespace.payload_bytes,
            direct_io=direct,
            fsync=fsync,
            file_mode=file_mode,
        )
        self.directory, self.file_bytes = directory, self._files.file_bytes
        self.uses_direct_io = (
            self._files.direct_io
        )  # for aligned buffers; stats count *_direct_chunks
        self.capacity_bytes = capacity_bytes
        self.capacity_files = capacity_bytes // self.file_bytes
        if self.capacity_files <= 0:
            self._files.close()
            raise ConfigError(
                f"disk capacity {capacity_bytes} bytes holds no chunk file of "
                f"{self._files.file_bytes} bytes; raise capacity_bytes"
            )
        self.namespace, self.enable_events = namespace, enable_events
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index = DiskIndex(
            policy, self.capacity_files, self._cond, in_slots(tenant_quotas, self.file_bytes)
        )
        self._book = DiskReports(self.medium, enable_events, namespace.payload_bytes)
        self._counters = self._book.counters
        self._log = FailureLog(logger)
        self._fresh: list[OffloadKey] = []  # keys published while the start-up scan runs
        self._generation = self._queued_store_bytes = 0
        self.is_scanned = self._is_rescanning = False  # is_scanned: the index is built
        self._scanned = threading.Event()
        self._workers = Workers(self._cond, num_read_threads, num_write_threads, logger, "disk")
        self._workers.housekeep(self._scan_at_start, 0)
        if rescan_s is not None:
            self._workers.every(rescan_s, self._rescan_soon)

    # -- what the manager asks --------------------------------------------------------------

    def wait_scanned(self, timeout: float | None = None) -> bool:
        """Wait until the start-up scan has built the index; True when it has."""
        return self._scanned.wait(timeout)

    def lookup(self, key: OffloadKey) -> LookupResult:
        with self._lock:
            hit = self.is_scanned and self._index.is_ready(key)
            self._counters["hits" if hit else "misses"] += 1
        return LookupResult.HIT if hit else LookupResult.MISS

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        with self._lock:
            self._index.policy.touch(keys)

    def use_retention(self, book: RetentionBook) -> None:
        with self._lock:
            self._index.use_retention(book)

    @property
    def queued_store_bytes(self) -> int:
        return self._queued_store_bytes

    def get_finished(self) -> list[TierResult]:
        with self._lock:
            return self._book.take_finished()

    def take_events(self) -> list[OffloadingEvent]:
        with self._lock:
            return self._book.take_events()

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                self.medium,
                self.capacity_bytes,
                used_bytes=len(self._index.policy) * self.file_bytes,
                queued_store_bytes=self._queued_store_bytes,
                counters=Counter(self._counters),
            )

    # -- loads --------------------------------------------------------------------------

    def submit_load(self, job: TierJob) -> None:
        with self._lock:
            state, tasks = DiskJob(job, self._generation), []
            for key, bufs in zip(job.keys, job.buffers, strict=True):
                readable = (
                    self.is_scanned and self._index.is_ready(key) and self._book.fits(key, bufs)
                )
                if readable and not self._workers.is_closed:
                    self._index.pin(key)
                    tasks.append((key, bufs))
                else:
                    self._counters["load_failures"] += 1
                    state.failed.add(key)
            self._book.start(state, len(tasks), self._generation)
        for key, bufs in tasks:
            self._workers.read(self._load_one, state, key, bufs)

    def _load_one(self, state: DiskJob, key: OffloadKey, bufs: tuple[memoryview, ...]) -> None:
        corrupt, failure, direct = self._read(state.job, key, bufs)
        failure = "corrupt" if corrupt is not None else failure
        is_lost = failure not in (None, "expired", "late")  # the file is bad or gone, not just slow
        with self._lock:
            if state.generation == self._generation:
                self._index.unpin(key)
                if is_lost:  # O(1): the policy's discard, not a pass over the index
                    self._book.emit(self._index.forget([key]), removed=True)
            nbytes = sum(b.nbytes for b in bufs) if failure is None else 0
            self._book.chunk_done(state, key, nbytes, direct, failure, self._generation)
        if corrupt is not None:
            self._log.log_once(
                "corrupt", f"disk tier: dropped corrupt chunk {key.hex()[:16]}… ({corrupt})"
            )
        if is_lost:
            self._unlink_if_absent(key)

    def _read(
        self, job: TierJob, key: OffloadKey, bufs: tuple[memoryview, ...]
    ) -> tuple[str | None, str | None, bool]:
        """(why the file is corrupt, the failure's kind, whether O_DIRECT was used) of reading `key`
        into `bufs`; no read once the job is past its deadline, and a read that ends after it fails."""
        if time.monotonic() >= job.deadline:
            return None, "expired", False
        try:
            corrupt, direct = self._files.read(key, bufs)
        except Exception as exc:  # a tier never raises into the manager
            return None, self._log.failure(exc, f"load of {key.hex()[:16]}…"), False
        late = (
            corrupt is None and time.monotonic() > job.deadline
        )  # the manager gave up: it only frees the slot
        return corrupt, "late" if late else None, direct

    # -- stores -------------------------------------------------------------------------

    def submit_store(self, job: TierJob) -> None:
        victims: list[OffloadKey] = []
        with self._lock:
            state, tasks, index = DiskJob(job, self._generation), [], self._index
            spared = Spared(set(job.keys), index.pinned)
            index.prepare_store(job.keys)  # before evicting: ARC's ghost hits
            for key, bufs in zip(job.keys, job.buffers, strict=True):
                if index.holds(key):
                    continue  # present or being written: success without rewriting
                if self._workers.is_closed or not self._book.fits(key, bufs):
                    self._counters["store_failures"] += 1
                elif (ticket := index.reserve(key, spared, victims)) is not None:
                    self._queued_store_bytes += sum(b.nbytes for b in bufs)
                    tasks.append((key, bufs, ticket))
                    continue
                else:
                    self._counters["rejected"] += 1  # everything else is being read: "no room now"
                state.failed.add(key)
            self._counters["evictions"] += len(victims)
            self._book.emit(victims, removed=True)
            self._book.start(state, len(tasks), self._generation)
        for key in victims:
            self._workers.write(self._unlink_if_absent, key, True)
        for task in tasks:
            self._workers.write(self._store_one, state, *task)

    def _store_one(
        self, state: DiskJob, key: OffloadKey, bufs: tuple[memoryview, ...], ticket: int
    ) -> None:
        nbytes = sum(b.nbytes for b in bufs)
        kind, direct, published = None, False, False
        if time.monotonic() >= state.job.deadline:
            kind = "expired"  # never started: the manager has given up on it
        else:
            try:
                tmp, direct = self._files.write_tmp(key, bufs)
                published = self._publish(key, tmp, ticket)
            except Exception as exc:  # a tier never raises into the manager
                kind = self._log.failure(exc, f"store of {key.hex()[:16]}…")
        with self._lock:
            self._queued_store_bytes -= nbytes
            self._index.give_back(key, ticket)  # a failed write gives its reservation back
            failure = None if published else kind or "discarded"
            self._book.chunk_done(
                state, key, nbytes if published else 0, direct, failure, self._generation
            )
        if not published and self._take_left_file(key):
            # this tier decided to delete the key's file (evicted, corrupt, reset) while this store
            # had it reserved, and left it for the store to replace: it is nobody's now (a file
            # another engine sharing the directory wrote is never deleted here)
            self._unlink_if_absent(key, True)

    def _publish(self, key: OffloadKey, tmp: str, ticket: int) -> bool:
        """Rename `tmp` to `key`'s final name if the store still owns the key; READY on success."""
        index = self._index
        if not index.claim(key, lambda: index.pending.get(key) == ticket):
            self._files.discard_tmp(tmp, key)  # reset() forgot this store
            return False
        try:
            return self._rename_claimed(key, tmp, ticket)
        finally:  # on every path: a claim left behind blocks every later store or delete of the key
            index.release(key)

    def _rename_claimed(self, key: OffloadKey, tmp: str, ticket: int) -> bool:
        try:
            self._files.publish(tmp, key)
        except BaseException:
            try:
                self._files.discard_tmp(tmp, key)
            except OSError as exc:  # EROFS, EIO: the start-up scan removes it once it is old
                self._log.failure(exc, f"removal of a temporary file of {key.hex()[:16]}…")
            raise
        with self._lock:
            if self._index.commit(key, ticket):
                if not self.is_scanned:
                    self._fresh.append(key)
                self._book.emit([key], removed=False)
                return True
        self._files.unlink(key)  # reset() came during the rename: this file must not survive it
        return False

    # -- the directory (start-up scan, rescans, deletions: `kvtier.tiers.disk.upkeep`) -------------

    def reset(self) -> None:
        with self._lock:
            self._generation += 1
            self._index.clear()
            self._fresh = []
            self._counters["resets"] += 1
        self._workers.housekeep(self._sweep)

    # -- lifecycle --------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        return self._workers.drain(timeout)

    def close(self) -> None:
        if self._workers.close():
            self._files.close()  # no task uses the directories' descriptors any more
        # else a thread is stuck in I/O: its descriptors stay open (a closed number could be
        # reused by another open and written through); the process is ending anyway

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
