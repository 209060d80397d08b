"""The disk tier: one file per chunk in a local directory, the index in memory.

`DiskTier` drives one module per concept: `index` (what is where, and the room),
`files` (which file holds a chunk), `format` (what a file holds), `reports`
(results, events, counters) and `workers` (the threads); the tier itself keeps the directory
and the index in agreement (scans, the reset sweep, deletions).

- The manager's thread only does bookkeeping (lookups, reservations, evictions); a read
  pool and a write pool do the I/O, one task per chunk, and finished jobs queue up for
  `get_finished`. A housekeeping thread rebuilds the index from the directory at start
  (lookups answer MISS until it is done), deletes everything after `reset()`, and with
  `rescan_s` adopts files that other engines sharing the directory wrote.
- Start-up: spares a previous run left are adopted, the directory is scanned, the newest
  `capacity_files` files are indexed (with what was stored meanwhile) and the rest become
  spares. Rescans adopt files into free room only (and those a hand-off waits for: `recheck`);
  a scan that a reset overtook changes nothing.
- A store in flight at `reset()` (its ticket is gone) deletes its own file instead of publishing.
  Evicted files become spares later stores overwrite (`files`); lost or corrupt ones are unlinked.
- A file is deleted only while the key is neither READY nor being written: else it is left
  to that store to replace, and noted, so that an evicted, corrupt or pre-reset file never
  outlives the decision to delete it (`_unlink_if_absent`, `_take_left_file`).
- Deadlines (`TierJob.deadline`): a chunk whose I/O has not started by then is not read or
  written (`expired`); a read that ends after it is reported failed (`late`), its file kept.

Thread-safety: the public methods are called from one thread (the manager's), `check` only
with no job in flight. Pool and housekeeping threads touch the shared state (index, job book)
only under `_lock`, which is never held across I/O; the manager's thread never waits for I/O.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from kvtier.base import LookupResult, OffloadingEvent
from kvtier.errors import ConfigError, InvariantError
from kvtier.keys import OffloadKey
from kvtier.policies.retention import RetentionBook
from kvtier.tiers.disk.files import ChunkFiles, FileScan
from kvtier.tiers.disk.format import choose_direct_io
from kvtier.tiers.disk.index import DiskIndex, Spared
from kvtier.tiers.disk.reports import DiskJob, DiskReports, FailureLog
from kvtier.tiers.disk.root import make_directory
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.quotas import in_slots
from kvtier.tiers.secondary import SecondaryTier, TierJob, TierResult, TierStats
from kvtier.tiers.workers import Workers

__all__ = ["DiskTier"]

logger = logging.getLogger(__name__)

# a hand-off's rescans of the directory at most this often (`recheck`)
_RECHECK_EVERY_S = 0.02


class DiskTier(SecondaryTier):
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
        self.directory = directory
        self.file_bytes = self._files.file_bytes
        # for aligned buffers; stats count *_direct_chunks
        self.uses_direct_io = self._files.direct_io
        self.capacity_bytes = capacity_bytes
        self.capacity_files = capacity_bytes // self.file_bytes
        if self.capacity_files <= 0:
            self._files.close()
            raise ConfigError(
                f"disk capacity {capacity_bytes} bytes holds no chunk file of "
                f"{self._files.file_bytes} bytes; raise capacity_bytes"
            )
        self.namespace = namespace
        self.enable_events = enable_events
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index = DiskIndex(
            policy, self.capacity_files, self._cond, in_slots(tenant_quotas, self.file_bytes)
        )
        self._book = DiskReports(self.medium, enable_events, namespace.payload_bytes)
        self._counters = self._book.counters
        self._log = FailureLog(logger)
        # keys published while the start-up scan runs
        self._fresh: list[OffloadKey] = []
        self._generation = 0
        self._queued_store_bytes = 0
        # the start-up scan has built the index
        self.is_scanned = False
        self._is_rescanning = False
        self._rechecked_at = -math.inf
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

    def recheck(self, keys: Sequence[OffloadKey]) -> None:
        """Adopt what other engines wrote now, `keys` even into a full index (`DiskIndex.want`)."""
        with self._lock:
            is_known = not self._index.want(keys)
        if is_known or time.monotonic() - self._rechecked_at < _RECHECK_EVERY_S:
            return
        self._rechecked_at = time.monotonic()
        self._rescan_soon()

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
            state = DiskJob(job, self._generation)
            tasks = []
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
        if corrupt is not None:
            failure = "corrupt"
        # the file is bad or gone, not just slow
        is_lost = failure not in (None, "expired", "late")
        with self._lock:
            if state.generation == self._generation:
                self._index.unpin(key)
                # O(1): the policy's discard, not a pass over the index
                if is_lost:
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
        # a tier never raises into the manager
        except Exception as exc:
            return None, self._log.failure(exc, f"load of {key.hex()[:16]}…"), False
        # the manager gave up: it only frees the slot
        if corrupt is None and time.monotonic() > job.deadline:
            return None, "late", direct
        return corrupt, None, direct

    # -- stores -------------------------------------------------------------------------

    def submit_store(self, job: TierJob) -> None:
        victims: list[OffloadKey] = []
        with self._lock:
            state = DiskJob(job, self._generation)
            tasks = []
            index = self._index
            spared = Spared(set(job.keys), index.pinned)
            # before evicting: ARC's ghost hits
            index.prepare_store(job.keys)
            for key, bufs in zip(job.keys, job.buffers, strict=True):
                # present or being written: success without rewriting
                if index.holds(key):
                    continue
                if self._workers.is_closed or not self._book.fits(key, bufs):
                    self._counters["store_failures"] += 1
                    state.failed.add(key)
                    continue
                ticket = index.reserve(key, spared, victims)
                if ticket is None:
                    # everything else is being read: "no room now"
                    self._counters["rejected"] += 1
                    state.failed.add(key)
                    continue
                self._queued_store_bytes += sum(b.nbytes for b in bufs)
                tasks.append((key, bufs, ticket))
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
        kind = None
        direct = False
        published = False
        if time.monotonic() >= state.job.deadline:
            # never started: the manager has given up on it
            kind = "expired"
        else:
            try:
                tmp, direct = self._files.write_tmp(key, bufs)
                published = self._publish(key, tmp, ticket)
            # a tier never raises into the manager
            except Exception as exc:
                kind = self._log.failure(exc, f"store of {key.hex()[:16]}…")
        failure = None
        if not published:
            failure = kind or "discarded"
        with self._lock:
            self._queued_store_bytes -= nbytes
            # a failed write gives its reservation back
            self._index.give_back(key, ticket)
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
            # reset() forgot this store
            self._files.discard_tmp(tmp, key)
            return False
        try:
            return self._rename_claimed(key, tmp, ticket)
        # on every path: a claim left behind blocks every later store or delete of the key
        finally:
            index.release(key)

    def _rename_claimed(self, key: OffloadKey, tmp: str, ticket: int) -> bool:
        try:
            self._files.publish(tmp, key)
        except BaseException:
            try:
                self._files.discard_tmp(tmp, key)
            # EROFS, EIO: the start-up scan removes it once it is old
            except OSError as exc:
                self._log.failure(exc, f"removal of a temporary file of {key.hex()[:16]}…")
            raise
        with self._lock:
            if self._index.commit(key, ticket):
                if not self.is_scanned:
                    self._fresh.append(key)
                self._book.emit([key], removed=False)
                return True
        # reset() came during the rename: this file must not survive it
        self._files.unlink(key)
        return False

    # -- the directory: the start-up scan, rescans, the reset sweep, deletions ---------------

    def _scan_at_start(self, generation: int) -> None:
        found = FileScan()
        try:
            self._files.adopt_spares()
            found = self._files.scan()
        # an unreadable directory is an empty index, not a dead tier
        except OSError as exc:
            self._log.failure(exc, "start-up scan")
        kept = found.keys[: self.capacity_files]
        dropped = found.keys[self.capacity_files :]
        scanned = self._index.new_policy()
        # newest first: the newest file ends up the most recent
        scanned.insert(kept)
        with self._lock:
            self._book.count_scan(found)
            # (a reset since the scan began: its files are being deleted, none is installed)
            if generation == self._generation:
                # plus what was stored meanwhile
                victims = self._index.install(scanned, self._fresh)
                self._counters["evictions"] += len(victims)
                if self.enable_events and kept:
                    gone = set(victims)
                    self._book.events.append(
                        OffloadingEvent([k for k in kept if k not in gone], self.medium, False)
                    )
                dropped += victims
            self.is_scanned = True
            self._fresh = []
        self._scanned.set()
        for key in dropped:
            self._unlink_if_absent(key, True)

    def _rescan_soon(self) -> None:
        if self.is_scanned and not self._is_rescanning:
            self._is_rescanning = True
            self._workers.housekeep(self._rescan, self._generation)

    def _rescan(self, generation: int) -> None:
        """Adopt files other engines wrote, into free room only (never evicting ours for them)."""
        try:
            found = self._files.scan()
        finally:
            self._is_rescanning = False
        with self._lock:
            self._book.count_scan(found)
            if generation != self._generation:
                # a reset came during the scan: these files are being deleted
                return
            adopted, forgotten = self._index.adopt(found.keys)
            self._book.emit(forgotten, removed=True)
            self._book.emit(adopted, removed=False)

    def reset(self) -> None:
        with self._lock:
            self._generation += 1
            self._index.clear()
            self._fresh = []
            self._counters["resets"] += 1
        self._workers.housekeep(self._sweep)

    def _sweep(self) -> None:
        for key in self._files.scan().keys:
            self._unlink_if_absent(key)

    def _take_left_file(self, key: OffloadKey) -> bool:
        with self._lock:
            if key not in self._index.left_for_store or self._index.holds(key):
                return False
            self._index.left_for_store.discard(key)
            return True

    def _unlink_if_absent(self, key: OffloadKey, keep_as_spare: bool = False) -> None:
        """Delete `key`'s file unless the key is READY or being written again by then (the file is
        then left to that store to replace, and noted: if the store fails, `_store_one` deletes it
        — an evicted, corrupt or pre-reset file must not outlive the decision to delete it)."""
        index = self._index

        # called with the lock held
        def may_change() -> bool:
            if not index.holds(key):
                return True
            if key in index.pending:
                index.left_for_store.add(key)
            return False

        if not index.claim(key, may_change):
            return
        try:
            if keep_as_spare:
                self._files.retire(key)
            else:
                self._files.unlink(key)
        except OSError as exc:
            self._log.failure(exc, f"delete of {key.hex()[:16]}…")
        finally:
            self._index.release(key)

    def check(self) -> None:
        """Cross-check the index against the directory (tests and the stack fuzzer; only with no
        job in flight, as python-diskcache's `check`).

        Raises:
            InvariantError: naming the first difference.
        """
        on_disk = set(self._files.scan().keys)
        with self._lock:
            index = self._index
            if index.pending or index.pinned or index.busy:
                raise InvariantError("disk tier: a key is still being written, read or renamed")
            if not all(key in index.policy for key in on_disk):
                raise InvariantError("disk tier: a chunk file the index does not hold")
            if len(index.policy) != len(on_disk):
                raise InvariantError("disk tier: an indexed key without its chunk file")

    # -- lifecycle --------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        return self._workers.drain(timeout)

    def close(self) -> None:
        if self._workers.close():
            # no task uses the directories' descriptors any more
            self._files.close()
        # else a thread is stuck in I/O: its descriptors stay open (a closed number could be
        # reused by another open and written through); the process is ending anyway

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
