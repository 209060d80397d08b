"""The disk tier: one file per chunk in a local directory, the index in memory.

The file layout and format are `kvtier.tiers.disk_files`; this module owns what is where.

- The index IS the `CachePolicy`: it holds exactly the READY keys (complete files under
  their final names), nothing else per key (LRU: 160 bytes a chunk at 1 M chunks, key
  included; benchmarks/bench_disk.py). Two small side tables: `_pending` (key -> ticket of
  the store writing it) and `_pinned` (key -> number of loads reading it). Capacity, in
  files, counts READY + pending keys.
- The manager's thread only does bookkeeping (lookups, reservations, evictions); a read
  pool and a write pool do the I/O, one task per chunk, and finished jobs queue up for
  `get_finished`. A housekeeping thread rebuilds the index from the directory at start
  (lookups answer MISS until it is done), deletes everything after `reset()`, and with
  `rescan_s` adopts files that other engines sharing the directory wrote.
- A final name changes (rename or unlink) only while its key is claimed in `_busy`, and
  a file is unlinked only if its key is neither READY nor pending at that moment. So the
  late unlink of an evicted key never deletes the newer file of the same key, and a store
  in flight at `reset()` (its ticket is gone) deletes its own file instead of publishing.
  Evicted files become spares that later stores overwrite (see `disk_files`); lost or
  corrupt files are unlinked.

Thread-safety: the public methods are called from one thread (the manager's). Pool
threads touch the shared state only under `_lock`, which is never held across I/O;
the manager's thread never waits for I/O.
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Container, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtier.base import LookupResult, OffloadingEvent
from kvtier.errors import ConfigError, InvariantError
from kvtier.keys import OffloadKey
from kvtier.policies import make_policy
from kvtier.tiers import disk_files
from kvtier.tiers.disk_files import ChunkFiles
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.secondary import SecondaryTier, TierJob, TierResult, TierStats

__all__ = ["DiskTier"]

logger = logging.getLogger(__name__)

_HIT, _MISS = LookupResult.HIT, LookupResult.MISS
_LOG_EVERY_S = 60.0  # one log line per failure kind per minute: a full disk fails every store
_ERRNO_KINDS = {errno.ENOSPC: "enospc", errno.EDQUOT: "enospc", errno.EROFS: "erofs", errno.EACCES: "eacces",
                errno.EPERM: "eacces", errno.ENOENT: "missing", errno.EIO: "eio"}
_MAX_KEY_BYTES = 64  # what ValueHeader can hold


class _Job:
    """One submitted TierJob while its chunks are in flight."""

    __slots__ = ("failed", "generation", "job", "num_bytes", "remaining", "started")

    def __init__(self, job: TierJob, generation: int):
        self.job, self.generation = job, generation
        self.failed: set[OffloadKey] = set()
        self.num_bytes = self.remaining = 0
        self.started = time.perf_counter()


class _Spared:
    """Keys an eviction must spare: the call's own keys and every key being read."""

    __slots__ = ("own", "pinned")

    def __init__(self, own: Container[OffloadKey], pinned: Container[OffloadKey]):
        self.own, self.pinned = own, pinned

    def __contains__(self, key: object) -> bool:
        return key in self.own or key in self.pinned


class _AllBut:
    """Spares every key but `keys`: makes `policy.evict` drop chosen keys (the policy
    interface has no remove; this is one O(n) pass, paid only for corrupt or lost files)."""

    __slots__ = ("keys",)

    def __init__(self, keys: set[OffloadKey]):
        self.keys = keys

    def __contains__(self, key: object) -> bool:
        return key not in self.keys


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
    Raises:
        ConfigError: the root is not a writable directory, the budget holds no file, or
            direct_io=True where the filesystem refuses O_DIRECT.
    """

    medium = "disk"

    def __init__(self, root: str | Path, namespace: Namespace, capacity_bytes: int, *, policy: str = "lru",
                 fsync: bool = False, direct_io: bool | None = None, num_read_threads: int = 4,
                 num_write_threads: int = 4, enable_events: bool = True, rescan_s: float | None = None):
        if min(num_read_threads, num_write_threads) < 1 or (rescan_s is not None and rescan_s <= 0):
            raise ConfigError("num_read_threads and num_write_threads must be >= 1, rescan_s > 0 or None")
        directory = _make_directory(Path(root), namespace)
        self._files = ChunkFiles(directory, namespace.id, namespace.payload_bytes,
                                 direct_io=_choose_direct_io(directory, direct_io), fsync=fsync)
        self.directory, self.file_bytes = directory, self._files.file_bytes
        self.uses_direct_io = self._files.direct_io  # for aligned buffers; stats count *_direct_chunks
        self.capacity_bytes = capacity_bytes
        self.capacity_files = capacity_bytes // self.file_bytes
        if self.capacity_files <= 0:
            raise ConfigError(f"disk capacity {capacity_bytes} bytes holds no chunk file of "
                              f"{self._files.file_bytes} bytes; raise capacity_bytes")
        self.namespace, self.enable_events = namespace, enable_events
        self._policy_spec = policy
        self._policy = make_policy(policy, self.capacity_files)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: dict[OffloadKey, int] = {}
        self._pinned: dict[OffloadKey, int] = {}
        self._busy: set[OffloadKey] = set()
        self._fresh: list[OffloadKey] = []  # keys published while the start-up scan runs
        self._finished: list[TierResult] = []
        self._events: list[OffloadingEvent] = []
        self._counters: Counter[str] = Counter()
        self._last_logged: dict[str, float] = {}
        self._tickets = itertools.count(1)
        self._generation = self._num_tasks = self._queued_store_bytes = 0
        self.is_scanned = self._is_closed = self._is_rescanning = False  # is_scanned: the index is built
        self._scanned = threading.Event()
        self._stop = threading.Event()
        self._readers = ThreadPoolExecutor(num_read_threads, "kvtier-disk-read")
        self._writers = ThreadPoolExecutor(num_write_threads, "kvtier-disk-write")
        self._housekeeper = ThreadPoolExecutor(1, "kvtier-disk-scan")
        self._spawn(self._housekeeper, self._scan_at_start, 0)
        self._rescanner = None
        if rescan_s is not None:
            self._rescanner = threading.Thread(target=self._rescan_loop, args=(rescan_s,), daemon=True,
                                               name="kvtier-disk-rescan")
            self._rescanner.start()

    # -- what the manager asks --------------------------------------------------------------

    def wait_scanned(self, timeout: float | None = None) -> bool:
        """Wait until the start-up scan has built the index; True when it has."""
        return self._scanned.wait(timeout)

    def lookup(self, key: OffloadKey) -> LookupResult:
        with self._lock:
            hit = self.is_scanned and key in self._policy
            self._counters["hits" if hit else "misses"] += 1
        return _HIT if hit else _MISS

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        with self._lock:
            self._policy.touch(keys)

    @property
    def queued_store_bytes(self) -> int:
        return self._queued_store_bytes

    def get_finished(self) -> list[TierResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def take_events(self) -> list[OffloadingEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.medium, self.capacity_bytes, used_bytes=len(self._policy) * self.file_bytes,
                             queued_store_bytes=self._queued_store_bytes, counters=Counter(self._counters))

    # -- loads --------------------------------------------------------------------------

    def submit_load(self, job: TierJob) -> None:
        with self._lock:
            state = _Job(job, self._generation)
            tasks = []
            for key, bufs in zip(job.keys, job.buffers, strict=True):
                if self.is_scanned and key in self._policy and self._fits(key, bufs) and not self._is_closed:
                    self._pinned[key] = self._pinned.get(key, 0) + 1
                    tasks.append((key, bufs))
                else:
                    self._counters["load_failures"] += 1
                    state.failed.add(key)
            state.remaining = len(tasks)
            self._finish_if_done(state)
        for key, bufs in tasks:
            self._spawn(self._readers, self._load_one, state, key, bufs)

    def _load_one(self, state: _Job, key: OffloadKey, bufs: tuple[memoryview, ...]) -> None:
        corrupt, kind, direct = None, None, False
        try:
            corrupt, direct = self._files.read(key, bufs)
        except Exception as exc:  # a tier never raises into the manager
            kind = self._failure(exc, f"load of {key.hex()[:16]}…")
        ok = corrupt is None and kind is None
        nbytes = sum(b.nbytes for b in bufs) if ok else 0
        with self._lock:
            current = state.generation == self._generation
            if current:
                self._unpin(key)
            if ok:
                self._count_io("load", direct, nbytes)
            else:
                self._counters["load_failures"] += 1
                self._counters["corrupt" if corrupt else kind] += 1  # type: ignore[index]
                if current:
                    self._forget([key])
            self._key_done(state, key, nbytes)
        if corrupt is not None:
            self._log_once("corrupt", f"disk tier: dropped corrupt chunk {key.hex()[:16]}… ({corrupt})")
        if not ok:
            self._unlink_if_absent(key)

    def _unpin(self, key: OffloadKey) -> None:
        count = self._pinned.get(key, 0)
        if count <= 1:
            self._pinned.pop(key, None)
        else:
            self._pinned[key] = count - 1

    # -- stores -------------------------------------------------------------------------

    def submit_store(self, job: TierJob) -> None:
        victims: list[OffloadKey] = []
        with self._lock:
            state = _Job(job, self._generation)
            tasks = []
            spared = _Spared(set(job.keys), self._pinned)
            new_keys = [k for k in job.keys if k not in self._policy and k not in self._pending]
            self._policy.prepare_insert(new_keys)  # before evicting: ARC's ghost hits
            for key, bufs in zip(job.keys, job.buffers, strict=True):
                if key in self._policy or key in self._pending:
                    continue  # present or being written: success without rewriting
                if self._is_closed or not self._fits(key, bufs):
                    self._counters["store_failures"] += 1
                elif not self._make_room(spared, victims):
                    self._counters["rejected"] += 1  # everything else is being read: "no room now"
                else:
                    self._pending[key] = next(self._tickets)
                    self._queued_store_bytes += sum(b.nbytes for b in bufs)
                    tasks.append((key, bufs, self._pending[key]))
                    continue
                state.failed.add(key)
            self._emit(victims, removed=True)
            state.remaining = len(tasks)
            self._finish_if_done(state)
        for key in victims:
            self._spawn(self._writers, self._unlink_if_absent, key, True)
        for task in tasks:
            self._spawn(self._writers, self._store_one, state, *task)

    def _make_room(self, spared: _Spared, victims: list[OffloadKey]) -> bool:
        if len(self._policy) + len(self._pending) < self.capacity_files:
            return True
        evicted = self._policy.evict(1, spared)
        if not evicted:
            return False
        self._counters["evictions"] += 1
        victims.extend(evicted)
        return True

    def _store_one(self, state: _Job, key: OffloadKey, bufs: tuple[memoryview, ...], ticket: int) -> None:
        nbytes = sum(b.nbytes for b in bufs)
        kind, direct = None, False
        try:
            tmp, direct = self._files.write_tmp(key, bufs)
            published = self._publish(key, tmp, ticket)
        except Exception as exc:  # a tier never raises into the manager
            kind, published = self._failure(exc, f"store of {key.hex()[:16]}…"), False
        with self._lock:
            self._queued_store_bytes -= nbytes
            if self._pending.get(key) == ticket:
                del self._pending[key]  # a failed write gives its reservation back
            if published:
                self._count_io("store", direct, nbytes)
            else:
                self._counters["store_failures"] += 1
                self._counters[kind or "discarded"] += 1
            self._key_done(state, key, nbytes if published else 0)

    def _publish(self, key: OffloadKey, tmp: str, ticket: int) -> bool:
        """Rename `tmp` to `key`'s final name if the store still owns the key; READY on success."""
        if not self._claim(key, lambda: self._pending.get(key) == ticket):
            self._files.discard(tmp)  # reset() forgot this store
            return False
        try:
            self._files.publish(tmp, key)
        except BaseException:
            self._files.discard(tmp)
            self._release(key)
            raise
        with self._lock:
            if self._pending.get(key) == ticket:
                del self._pending[key]
                self._policy.insert([key])
                if not self.is_scanned:
                    self._fresh.append(key)
                self._emit([key], removed=False)
                self._busy.discard(key)
                self._cond.notify_all()
                return True
        self._files.unlink(key)  # reset() came during the rename: this file must not survive it
        self._release(key)
        return False

    # -- final names: claims, deletions -----------------------------------------------------

    def _claim(self, key: OffloadKey, may_change: Callable[[], bool]) -> bool:
        """Wait until no other thread renames or unlinks `key`'s file, then claim it if `may_change()`."""
        with self._cond:
            self._cond.wait_for(lambda: key not in self._busy)
            if not may_change():
                return False
            self._busy.add(key)
            return True

    def _release(self, key: OffloadKey) -> None:
        with self._cond:
            self._busy.discard(key)
            self._cond.notify_all()

    def _unlink_if_absent(self, key: OffloadKey, keep_as_spare: bool = False) -> None:
        """Delete `key`'s file unless the key is READY or being written again by then."""
        if not self._claim(key, lambda: key not in self._policy and key not in self._pending):
            return
        try:
            (self._files.retire if keep_as_spare else self._files.unlink)(key)
        except OSError as exc:
            self._failure(exc, f"delete of {key.hex()[:16]}…")
        finally:
            self._release(key)

    def _forget(self, keys: Sequence[OffloadKey]) -> None:
        """Drop READY `keys` from the index (their files are lost or bad). Caller holds the lock."""
        present = {key for key in keys if key in self._policy}
        if present and self._policy.evict(len(present), _AllBut(present)) is None:
            raise InvariantError("the policy could not drop keys it holds")
        self._emit(list(present), removed=True)

    # -- the directory: start-up scan, rescans, reset -------------------------------------------

    def _scan_at_start(self, generation: int) -> None:
        found = disk_files.ScanResult()
        try:
            self._files.adopt_spares()
            found = self._files.scan()
        except OSError as exc:  # an unreadable directory is an empty index, not a dead tier
            self._failure(exc, "start-up scan")
        kept, dropped = found.keys[:self.capacity_files], found.keys[self.capacity_files:]
        index = make_policy(self._policy_spec, self.capacity_files)
        index.insert(kept)  # newest first: the newest file ends up the most recent
        with self._lock:
            self._count_scan(found)
            if generation == self._generation:
                dropped += self._merge_scanned(index, kept)
            self.is_scanned, self._fresh = True, []
        self._scanned.set()
        for key in dropped:
            self._unlink_if_absent(key, True)

    def _merge_scanned(self, index: Any, kept: list[OffloadKey]) -> list[OffloadKey]:
        """Install the scanned index, plus what was stored meanwhile; returns the evicted keys."""
        fresh = [key for key in reversed(self._fresh) if key in self._policy]
        index.insert(fresh)  # stored during the scan: more recent than any scanned file
        excess = len(index) + len(self._pending) - self.capacity_files
        victims = (index.evict(excess, _Spared(set(fresh), self._pinned)) or []) if excess > 0 else []
        self._counters["evictions"] += len(victims)
        self._policy = index
        if self.enable_events and kept:
            gone = set(victims)
            self._events.append(OffloadingEvent([k for k in kept if k not in gone], self.medium, False))
        return victims

    def _rescan_loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            if self.is_scanned and not self._is_rescanning:
                self._is_rescanning = True
                self._spawn(self._housekeeper, self._rescan, self._generation)

    def _rescan(self, generation: int) -> None:
        """Adopt files other engines wrote, into free room only (never evicting ours for them)."""
        try:
            found = self._files.scan()
        finally:
            self._is_rescanning = False
        with self._lock:
            self._count_scan(found)
            if generation != self._generation:
                return  # a reset came during the scan: these files are being deleted
            room = self.capacity_files - len(self._policy) - len(self._pending)
            busy = self._busy
            new = [k for k in found.keys if k not in self._policy and k not in self._pending and k not in busy]
            adopted = new[:max(room, 0)]
            self._policy.insert(adopted)
            self._emit(adopted, removed=False)

    def reset(self) -> None:
        with self._lock:
            self._generation += 1
            self._policy.clear()
            self._pending.clear()
            self._pinned.clear()
            self._fresh = []
            self._counters["resets"] += 1
        self._spawn(self._housekeeper, self._sweep)

    def _sweep(self) -> None:
        for key in self._files.scan().keys:
            self._unlink_if_absent(key)

    # -- task and job bookkeeping -----------------------------------------------------------

    def _spawn(self, pool: ThreadPoolExecutor, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._num_tasks += 1
        pool.submit(self._run, fn, args)

    def _run(self, fn: Callable[..., None], args: tuple) -> None:
        try:
            fn(*args)
        except Exception:  # a bug, not an I/O failure: say so, keep the tier alive
            logger.exception("disk tier: %s failed", fn.__name__)
        finally:
            with self._cond:
                self._num_tasks -= 1
                self._cond.notify_all()

    def _key_done(self, state: _Job, key: OffloadKey, num_bytes: int) -> None:
        """One chunk of `state` ended: moved `num_bytes`, or failed when that is 0."""
        if num_bytes:
            state.num_bytes += num_bytes
        else:
            state.failed.add(key)
        state.remaining -= 1
        self._finish_if_done(state)

    def _finish_if_done(self, state: _Job) -> None:
        if state.remaining:
            return
        job, seconds = state.job, time.perf_counter() - state.started
        direction = "store" if job.is_store else "load"
        self._counters[f"{direction}_seconds_us"] += int(seconds * 1e6)
        failed, error = state.failed, None
        if state.generation != self._generation:
            failed, error = set(job.keys), "reset while in flight"
        elif failed:
            error = f"{len(failed)} of {len(job.keys)} keys failed (see the tier's counters)"
        self._finished.append(TierResult(job_id=job.job_id, failed_keys=frozenset(failed),
                                         num_bytes=state.num_bytes, seconds=seconds, error=error))

    def _fits(self, key: OffloadKey, bufs: Sequence[memoryview]) -> bool:
        if len(key) <= _MAX_KEY_BYTES and sum(b.nbytes for b in bufs) == self.namespace.payload_bytes:
            return True
        self._counters["bad_jobs"] += 1
        return False

    def _count_io(self, direction: str, direct: bool, num_bytes: int) -> None:
        counters = self._counters
        counters[f"{direction}_chunks"] += 1
        counters[f"{direction}_bytes"] += num_bytes
        counters[f"{direction}_direct_chunks" if direct else f"{direction}_buffered_chunks"] += 1

    def _count_scan(self, found: disk_files.ScanResult) -> None:
        self._counters["scanned_files"] += len(found.keys)
        self._counters["tmp_removed"] += found.num_tmp_removed
        self._counters["garbage_removed"] += found.num_garbage_removed

    def _emit(self, keys: list[OffloadKey], removed: bool) -> None:
        if self.enable_events and keys:
            self._events.append(OffloadingEvent(keys, self.medium, removed))

    def _failure(self, exc: Exception, what: str) -> str:
        kind = _ERRNO_KINDS.get(getattr(exc, "errno", None) or 0, "io_error")
        if not isinstance(exc, OSError):
            kind = "error"
            logger.exception("disk tier: %s failed", what)
        self._log_once(kind, f"disk tier: {what} failed: {exc}")
        return kind

    def _log_once(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_logged.get(kind, -_LOG_EVERY_S) < _LOG_EVERY_S:
                return
            self._last_logged[kind] = now
        logger.warning("%s (such failures are logged once a minute; counted in stats())", message)

    # -- lifecycle --------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._num_tasks == 0, timeout)

    def close(self) -> None:
        if self._is_closed:
            return
        with self._lock:
            self._is_closed = True
        self._stop.set()
        if self._rescanner is not None:
            self._rescanner.join()
        for pool in (self._housekeeper, self._readers, self._writers):
            pool.shutdown(wait=True)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_directory(root: Path, namespace: Namespace) -> str:
    directory = root / namespace.id_hex
    try:
        directory.mkdir(parents=True, exist_ok=True)
        disk_files.write_namespace_json(str(directory), namespace.describe())
    except OSError as exc:
        raise ConfigError(f"disk tier root {str(root)!r} is not a writable directory ({exc}); "
                          f"point the disk tier at a directory kvtier may create and write") from exc
    return str(directory)


def _choose_direct_io(directory: str, direct_io: bool | None) -> bool:
    if direct_io is False:
        return False
    allowed = disk_files.probe_direct_io(directory)
    if direct_io and not allowed:
        raise ConfigError(f"the filesystem of {directory!r} refuses O_DIRECT; set direct_io=None or False")
    return allowed
