"""The disk tier's upkeep of its directory: the start-up scan, rescans, the reset sweep, the
index cross-check, and deleting a key's file only while no store wants the key.

`DirectoryUpkeep` is a part of `kvtier.tiers.disk.tier.DiskTier` (a mixin): it shares the
tier's lock, index, files and reports, so it is not a class of its own. Its methods run on
the tier's housekeeping and pool threads, except `check` (see the tier's thread-safety).

- Start-up: spares a previous run left are adopted, the directory is scanned (lookups answer
  MISS until it is done), the newest `capacity_files` files are indexed (with what was stored
  meanwhile) and the rest become spares.
- Rescans (`rescan_s`) adopt files other engines sharing the directory wrote, into free room
  only; the sweep after `reset()` deletes every file. A scan that a reset overtook changes
  nothing.
- A file is deleted only while the key is neither READY nor being written: else it is left
  to that store to replace, and noted, so that an evicted, corrupt or pre-reset file never
  outlives the decision to delete it (`_unlink_if_absent`, `_take_left_file`).
"""

from __future__ import annotations

import threading
from collections import Counter

from kvtier.base import OffloadingEvent
from kvtier.errors import InvariantError
from kvtier.keys import OffloadKey
from kvtier.tiers.disk.files import ChunkFiles, FileScan
from kvtier.tiers.disk.index import DiskIndex
from kvtier.tiers.disk.reports import DiskReports, FailureLog
from kvtier.tiers.workers import Workers

__all__ = ["DirectoryUpkeep"]


class DirectoryUpkeep:
    """The directory side of `DiskTier`; see the module docstring."""

    # the tier's state this part reads and changes (set by DiskTier.__init__)
    medium: str
    capacity_files: int
    enable_events: bool
    is_scanned: bool
    _lock: threading.Lock
    _index: DiskIndex
    _files: ChunkFiles
    _book: DiskReports
    _counters: Counter[str]  # the book's
    _log: FailureLog
    _workers: Workers
    _generation: int
    _fresh: list[OffloadKey]
    _is_rescanning: bool
    _scanned: threading.Event

    def _scan_at_start(self, generation: int) -> None:
        found = FileScan()
        try:
            self._files.adopt_spares()
            found = self._files.scan()
        except OSError as exc:  # an unreadable directory is an empty index, not a dead tier
            self._log.failure(exc, "start-up scan")
        kept, dropped = found.keys[: self.capacity_files], found.keys[self.capacity_files :]
        scanned = self._index.new_policy()
        scanned.insert(kept)  # newest first: the newest file ends up the most recent
        with self._lock:
            self._book.count_scan(found)
            if generation == self._generation:  # else a reset came: these files are being deleted
                victims = self._index.install(
                    scanned, self._fresh
                )  # plus what was stored meanwhile
                self._counters["evictions"] += len(victims)
                if self.enable_events and kept:
                    gone = set(victims)
                    self._book.events.append(
                        OffloadingEvent([k for k in kept if k not in gone], self.medium, False)
                    )
                dropped += victims
            self.is_scanned, self._fresh = True, []
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
                return  # a reset came during the scan: these files are being deleted
            self._book.emit(self._index.adopt(found.keys), removed=False)

    def _sweep(self) -> None:
        for key in self._files.scan().keys:
            self._unlink_if_absent(key)

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

        def may_change() -> bool:  # called with the lock held
            if not index.holds(key):
                return True
            if key in index.pending:
                index.left_for_store.add(key)
            return False

        if not index.claim(key, may_change):
            return
        try:
            (self._files.retire if keep_as_spare else self._files.unlink)(key)
        except OSError as exc:
            self._log.failure(exc, f"delete of {key.hex()[:16]}…")
        finally:
            self._index.release(key)
