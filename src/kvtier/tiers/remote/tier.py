"""`RemoteTier`: a secondary tier on a shared remote store (Redis / Valkey, S3), shared by every
engine replica that uses the same store and namespace.

Only the tier decides; the `RemoteStore` it wraps only moves bytes (`kvtier.tiers.remote.store`).

- **Lookups never block.** The tier remembers which keys it knows to be present (its own
  stores, answered probes) and which were absent a moment ago (`kvtier.tiers.remote.keys`).
  Anything else is queued for the probe thread (`kvtier.tiers.remote.probes`), which asks
  the store about up to `probe_batch` keys in one round trip; the lookup answers RETRY
  meanwhile (the scheduler bounds the request's wait). Capacity is the server's (`maxmemory`
  and its eviction policy, an optional TTL): a known key the server has dropped is a failed
  load, and is forgotten.
- **Jobs** run on a read pool and a write pool. A store skips keys known present and writes the
  others only where their names do not exist yet (a value is never rewritten); a load checks
  every value (`kvtier.tiers.remote.values`; in keyed mode, its tag too) before a byte reaches
  the slab: a value that is short, long, foreign, corrupt or forged is a failed key, counted as
  `corrupt`, and deleted. A failed operation is counted and fed to the breaker (`_failed`).
- **Deadlines** (`TierJob.deadline`): a job whose I/O has not started by then never starts it
  (its keys fail, counted `expired`); a load that ends after it reports its keys failed
  (counted `late`): the manager has given up on it and only frees what it held.
- **Circuit breaker** (`kvtier.tiers.remote.breaker`): failed operations in a row open it; while
  open, lookups answer MISS and jobs fail at once, and the probe thread pings the store
  until it answers. No request waits on a dead server beyond the store's timeouts.
- **reset()** forgets everything and deletes the namespace's values in the background
  (`kvtier.tiers.remote.reset`); until that sweep is over, lookups answer MISS and jobs fail at
  once (`reset_rejects`), so that the sweep never deletes a value the tier calls present. It
  deletes for every replica sharing the namespace: after a reset (e.g. new weights) the old
  values are wrong for all of them. On a store that cannot list, values are named under the
  namespace's epoch instead, which a reset replaces and every replica follows.

Thread-safety: the public methods are called from one thread (the manager's); they decide and
submit, and a job's I/O (`_load`, `_store`) runs on the read and write pools. The probe thread
and the pools share state with it only under `_lock`, never held across I/O.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvtier.base import LookupResult, OffloadingEvent
from kvtier.errors import ConfigError, InvariantError
from kvtier.keys import OffloadKey
from kvtier.policies.retention import RetentionBook
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.rate_limited_log import RateLimitedLog
from kvtier.tiers.remote.breaker import CircuitBreaker
from kvtier.tiers.remote.credentials import redact
from kvtier.tiers.remote.keys import KnownKeys
from kvtier.tiers.remote.probes import ProbeThread
from kvtier.tiers.remote.reports import RemoteReports
from kvtier.tiers.remote.reset import ResetSweep
from kvtier.tiers.remote.store import ItemsFailed, RemoteStore
from kvtier.tiers.remote.values import ValueCodec
from kvtier.tiers.secondary import SecondaryTier, TierJob, TierResult, TierStats
from kvtier.tiers.workers import Workers

__all__ = ["RemoteTier"]

logger = logging.getLogger(__name__)

# the epoch record is read at most this often (a store that cannot list): more is a busy loop
_MIN_EPOCH_CHECK_S = 0.01
_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY


class RemoteTier(SecondaryTier):
    """Args:
    store: the remote store's byte operations.
    namespace: what the values' bytes mean.
    prefix: the first part of every name.
    key_secret: the keyed mode's deployment secret (None: plain names; see `values`).
    io_threads: size of the read pool and of the write pool.
    probe_batch: keys per existence round trip at most.
    absent_ttl_s: how long a key found absent is answered MISS without asking again.
    max_known: keys remembered as present at most (the oldest are forgotten first).
    breaker: the circuit breaker (default: 5 failures, retry every 1 s).
    enable_events: record stored/removed events for `take_events`.
    start_open: the store did not answer at start: begin with the breaker open.
    epoch_check_s: a store that cannot list: how often the namespace's epoch is read again (a
        reset by another replica is followed within it; see `kvtier.tiers.remote.reset`).
    """

    def __init__(
        self,
        store: RemoteStore,
        namespace: Namespace,
        *,
        prefix: str = "kvtier",
        key_secret: bytes | None = None,
        io_threads: int = 4,
        probe_batch: int = 256,
        absent_ttl_s: float = 0.5,
        max_known: int = 1 << 18,
        breaker: CircuitBreaker | None = None,
        enable_events: bool = True,
        start_open: bool = False,
        epoch_check_s: float = 1.0,
    ):
        if not _MIN_EPOCH_CHECK_S <= epoch_check_s < math.inf:
            raise ConfigError(
                f"epoch_check_s must be at least {_MIN_EPOCH_CHECK_S} s and finite (how long a "
                f"replica may serve values from before another's reset), got {epoch_check_s!r}"
            )
        self.store = store
        self.medium = store.medium
        self.codec = ValueCodec(namespace, prefix, store.separator, key_secret)
        self.breaker = breaker or CircuitBreaker()
        self.enable_events = enable_events
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # under _lock: the known keys, the reports and counters, the queued bytes, the reset
        self._keys = KnownKeys(max_known, absent_ttl_s)
        self._book = RemoteReports(self.medium, enable_events)
        self._counters = self._book.counters
        self._queued_store_bytes = 0
        # the manager's hints: values kept longer (a TTL)
        self._retention: RetentionBook | None = None
        self._log = RateLimitedLog(logger)
        self._workers = Workers(self._cond, io_threads, io_threads, logger, self.medium)
        self._reset = ResetSweep(
            self._cond,
            store,
            self.codec,
            self._workers,
            self._log,
            self.breaker.retry_s,
        )
        if start_open:
            self.breaker.open_now()
        if not store.lists:
            # no value is named before the namespace's epoch is read (lookups MISS until then)
            with self._cond:
                generation = self._reset.start_locked()
            self._reset.rejoin_soon(generation)
        self._prober = ProbeThread(
            self._cond,
            self._keys,
            store,
            self.codec.name,
            self.breaker,
            self._reset,
            self._counters,
            self._failed,
            self._log,
            probe_batch,
            epoch_check_s,
            self._book,
        )

    # -- lookups ------------------------------------------------------------------------------

    def probe(self, keys: Sequence[OffloadKey]) -> None:
        with self._cond:
            for key in keys:
                self._answer_locked(key)

    def lookup(self, key: OffloadKey) -> LookupResult:
        with self._cond:
            result = self._answer_locked(key)
            self._counters[{_HIT: "hits", _MISS: "misses", _RETRY: "retries"}[result]] += 1
            return result

    def _answer_locked(self, key: OffloadKey) -> LookupResult:
        if self.breaker.is_open or self._reset.is_sweeping:
            return _MISS
        result = self._keys.answer(key)
        if result is _RETRY and self._keys.has_queued:
            # the probe thread (`kvtier.tiers.remote.probes`)
            self._cond.notify_all()
        return result

    def recheck(self, keys: Sequence[OffloadKey]) -> None:
        with self._cond:
            self._keys.recheck(keys)

    @property
    def is_reachable(self) -> bool:
        with self._cond:
            return not (self.breaker.is_open or self._reset.is_sweeping)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """The server's eviction policy orders a shared store's values; nothing to record here."""

    def use_retention(self, book: RetentionBook) -> None:
        self._retention = book

    # -- jobs: what the manager's thread decides and submits -------------------------------------

    def submit_load(self, job: TierJob) -> None:
        with self._cond:
            if self._rejected_locked(job):
                return
            generation = self._reset.admit_locked()
        self._workers.read(self._job, self._load, job, generation, time.perf_counter())

    def submit_store(self, job: TierJob) -> None:
        with self._cond:
            if self._rejected_locked(job):
                return
            generation = self._reset.admit_locked()
            items = list(zip(job.keys, job.buffers, strict=True))
            bad = {k for k, bufs in items if not self.codec.fits(k, bufs)}
            self._counters["bad_jobs"] += len(bad)
            todo = [(k, bufs) for k, bufs in items if k not in self._keys and k not in bad]
            # values known present get another TTL where they expire
            known = []
            if self.store.expires:
                known = [k for k in job.keys if k in self._keys and k not in bad]
            self._queued_store_bytes += len(todo) * self.codec.payload_bytes
        self._workers.write(
            self._job, self._store, job, generation, todo, bad, known, time.perf_counter()
        )

    def _rejected_locked(self, job: TierJob) -> bool:
        """Fail `job` at once, without I/O, while the breaker is open (or the tier closed), or while
        a reset's sweep runs (see `kvtier.tiers.remote.reset`)."""
        if self.breaker.is_open or self._workers.is_closed:
            counter, why = "breaker_rejects", "tier unavailable (breaker open)"
        elif self._reset.is_sweeping:
            counter, why = "reset_rejects", f"tier resetting ({self._reset.activity})"
        else:
            return False
        self._counters[counter] += len(job.keys)
        self._book.finish(job, set(job.keys), 0, 0.0, why)
        return True

    # -- jobs: their I/O, on the pools ---------------------------------------------------------

    def _job(self, run: Callable[..., None], job: TierJob, *args: object) -> None:
        """`run(job, *args)` on a pool thread; the reset's sweep is told when it is over, whatever
        happens."""
        try:
            run(job, *args)
        finally:
            self._reset.job_over()

    def _may_start(self, job: TierJob, generation: int, queued_bytes: int) -> bool:
        """Whether `job` may start its I/O: not past its deadline (else counted `expired`) nor from
        before a reset. If not, its keys fail now and a store gives back its `queued_bytes`."""
        with self._cond:
            is_expired = time.monotonic() >= job.deadline
            if not is_expired and generation == self._reset.generation:
                return True
            if is_expired:
                self._counters["expired"] += len(job.keys)
                why = "deadline passed before its I/O started"
            else:
                why = "reset while in flight"
            self._queued_store_bytes -= queued_bytes
            self._book.finish(job, set(job.keys), 0, 0.0, why)
            return False

    def _load(self, job: TierJob, generation: int, started: float) -> None:
        if not self._may_start(job, generation, 0):
            return
        error = None
        parts = [self.codec.receiving_parts(bufs) for bufs in job.buffers]
        names = [self.codec.name(k) for k in job.keys]
        # the items whose GET failed: that says nothing about their keys
        unread: set[int] = set()
        # each value's header (and tag) into buffers of its own, its payload straight into the slab
        try:
            sizes = self.store.get_into(names, parts)
            self.breaker.record_success()
        except ItemsFailed as exc:
            sizes = exc.results
            unread = set(exc.errors)
            error = self._failed(exc, "load")
        except Exception as exc:
            sizes = [None] * len(job.keys)
            unread = set(range(len(job.keys)))
            error = self._failed(exc, "load")
        read = [i for i in range(len(job.keys)) if i not in unread]
        # absent or bad values: forgotten
        gone: set[OffloadKey] = set()
        corrupt = self._refuse_bad_values(
            [job.keys[i] for i in read], [sizes[i] for i in read], [parts[i] for i in read], gone
        )
        failed = gone | {job.keys[i] for i in unread}
        with self._cond:
            self._counters["corrupt"] += len(corrupt)
            self._counters["load_missing"] += len(gone) - len(corrupt)
            self._keys.forget(list(gone))
            if generation != self._reset.generation:
                # (the reset dropped every key already: no event)
                failed = set(job.keys)
                error = "reset while in flight"
            else:
                self._book.emit(sorted(gone), removed=True)
                # the manager has given up on it: it only frees the slots
                if time.monotonic() > job.deadline:
                    self._counters["late"] += len(job.keys)
                    failed = set(job.keys)
                    error = "finished after its deadline"
            num_bytes = self.codec.payload_bytes * (len(job.keys) - len(failed))
            self._book.count("load", len(job.keys) - len(failed), len(failed), num_bytes, started)
            self._book.finish(job, failed, num_bytes, time.perf_counter() - started, error)
        # used again: another TTL (after the report)
        self._renew([key for key in job.keys if key not in failed])

    def _refuse_bad_values(
        self,
        keys: Sequence[OffloadKey],
        sizes: Sequence[int | None],
        parts: Sequence[tuple[memoryview, ...]],
        failed: set[OffloadKey],
    ) -> list[str]:
        """Add the keys whose value is absent or fails a check to `failed`; delete the bad values
        (their names are returned)."""
        corrupt: list[str] = []
        for key, size, received in zip(keys, sizes, parts, strict=True):
            if size is None:
                failed.add(key)
                continue
            why = self.codec.check(key, size, received)
            if why is None:
                continue
            failed.add(key)
            corrupt.append(self.codec.name(key))
            self._log.log_once(
                "corrupt", f"{self.medium} tier: dropped a bad value of {key.hex()[:16]}…: {why}"
            )
        if corrupt:
            self._delete(corrupt)
        return corrupt

    def _store(
        self,
        job: TierJob,
        generation: int,
        todo: list[tuple[OffloadKey, tuple[memoryview, ...]]],
        bad: set[OffloadKey],
        known: list[OffloadKey],
        started: float,
    ) -> None:
        if not self._may_start(job, generation, len(todo) * self.codec.payload_bytes):
            return
        failed = set(bad)
        error = None
        written = [False] * len(todo)
        try:
            if todo:
                written = self.store.put(
                    [(self.codec.name(k), self.codec.pack(k, bufs)) for k, bufs in todo],
                    self._keep_s([k for k, _ in todo]),
                )
                self.breaker.record_success()
        # the others were written (or found): their keys are stored
        except ItemsFailed as exc:
            written = [bool(is_new) for is_new in exc.results]
            failed.update(todo[i][0] for i in exc.errors)
            error = self._failed(exc, "store")
        except Exception as exc:
            failed.update(k for k, _ in todo)
            error = self._failed(exc, "store")
        outcomes = list(zip((k for k, _ in todo), written, strict=True))
        new_keys = [k for k, is_new in outcomes if is_new and k not in failed]
        num_existing = sum(1 for k, is_new in outcomes if not is_new and k not in failed)
        with self._cond:
            self._queued_store_bytes -= len(todo) * self.codec.payload_bytes
            # written by another replica: never rewritten
            self._counters["store_existing"] += num_existing
            if generation != self._reset.generation:
                # what it wrote, the sweep deletes (it waits for this job)
                failed = set(job.keys)
                error = "reset while in flight"
                new_keys = []
            else:
                # only what this job wrote or found: a key skipped as known may have been forgotten
                for key, _ in todo:
                    if key not in failed:
                        self._keys.remember(key)
                self._book.emit(new_keys, removed=False)
            num_bytes = len(new_keys) * self.codec.payload_bytes
            self._book.count("store", len(new_keys), len(failed), num_bytes, started)
            self._book.finish(job, failed, num_bytes, time.perf_counter() - started, error)
        # values stored again (here or by another replica): another TTL, and the new hints
        if error is None:
            self._renew([*known, *(k for k, is_new in outcomes if not is_new)])

    def _renew(self, keys: Sequence[OffloadKey]) -> None:
        """Give these values another TTL where the store's values expire (no more than one round
        trip, never failing the job: a failure is logged once and counted, the breaker is not
        told)."""
        if not keys or not self.store.expires:
            return
        try:
            self.store.renew([self.codec.name(k) for k in keys], self._keep_s(keys))
        except Exception as exc:
            with self._cond:
                self._counters["errors"] += 1
            self._log.log_once(
                "renew", f"{self.medium} tier: renewing values' TTL failed: {redact(str(exc))}"
            )

    def _keep_s(self, keys: Sequence[OffloadKey]) -> list[float] | None:
        """How long each value is to be kept at least, by the requests' hints (None: no book)."""
        book = self._retention
        if book is None or not len(book):
            return None
        now = book.clock()
        return [max(0.0, (book.kept_until(key) or now) - now) for key in keys]

    def _failed(self, exc: Exception, what: str) -> str:
        """Count a failed operation (timeouts apart), feed the breaker; the message to report."""
        is_timeout = self.store.is_timeout(exc)
        kind = "timeout" if is_timeout else type(exc).__name__
        message = f"{what} failed ({kind}): {redact(str(exc))}"
        with self._cond:
            self._counters["timeouts" if is_timeout else "errors"] += 1
        if not self.breaker.record_failure():
            self._log.log_once(what, f"{self.medium} tier: {message}")
            return message
        logger.warning(
            "kvtier: %s tier at %s is failing (%s); answering misses and retrying in the background",
            self.medium,
            self.store.describe(),
            message,
        )
        with self._cond:
            self._cond.notify_all()
        return message

    def _delete(self, names: list[str]) -> None:
        try:
            self.store.delete(names)
        except Exception as exc:
            self._log.log_once("delete", f"{self.medium} tier: delete failed: {redact(str(exc))}")

    # -- what the manager reads -------------------------------------------------------------------

    @property
    def queued_store_bytes(self) -> int:
        return self._queued_store_bytes

    def get_finished(self) -> list[TierResult]:
        with self._cond:
            return self._book.take_finished()

    def take_events(self) -> list[OffloadingEvent]:
        with self._cond:
            return self._book.take_events()

    def stats(self) -> TierStats:
        with self._cond:
            counters = Counter(self._counters)
            counters["breaker_opens"] = self.breaker.num_opens
            counters["breaker_closes"] = self.breaker.num_closes
            return TierStats(
                self.medium,
                0,
                used_bytes=len(self._keys) * self.codec.value_bytes,
                queued_store_bytes=self._queued_store_bytes,
                counters=counters,
                gauges={"breaker_open": float(self.breaker.is_open)},
            )

    # -- reset and lifecycle ------------------------------------------------------------------------

    def reset(self) -> None:
        with self._cond:
            generation = self._reset.start_locked()
            self._keys.clear()
            self._counters["resets"] += 1
        self._workers.housekeep(self._reset.sweep, generation)

    def drain(self, timeout: float) -> bool:
        return self._workers.drain(timeout)

    def check(self) -> None:
        """Every key the tier calls present exists in the store (tests and the stack fuzzer; only
        with no job in flight and a server that kept its values: its own evictions or a restart
        drop values legitimately).

        Raises:
            InvariantError: a phantom, a key that would answer HIT and then fail its load.
        """
        with self._cond:
            known = list(self._keys)
        if not known:
            return
        found = self.store.exists([self.codec.name(k) for k in known])
        phantoms = [k for k, is_there in zip(known, found, strict=True) if not is_there]
        if phantoms:
            raise InvariantError(
                f"{self.medium} tier: {len(phantoms)} key(s) known present are not in the store"
            )

    def close(self) -> None:
        if not self._prober.stop():
            return
        self._workers.close()
        self.store.close()
