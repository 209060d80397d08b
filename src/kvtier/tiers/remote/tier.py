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
  `corrupt`, and deleted.
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
  values are wrong for all of them.

What a job does on the pools (loads, stores, failures) is `kvtier.tiers.remote.io`.

Thread-safety: the public methods are called from one thread (the manager's). The probe
thread and the pools share state with it only under `_lock`, never held across I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence

from kvtier.base import LookupResult, OffloadingEvent
from kvtier.errors import InvariantError
from kvtier.keys import OffloadKey
from kvtier.policies.retention import RetentionBook
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.rate_limited_log import RateLimitedLog
from kvtier.tiers.remote.breaker import CircuitBreaker
from kvtier.tiers.remote.io import RemoteIO
from kvtier.tiers.remote.keys import KnownKeys
from kvtier.tiers.remote.probes import ProbeThread
from kvtier.tiers.remote.reports import RemoteReports
from kvtier.tiers.remote.reset import ResetSweep
from kvtier.tiers.remote.store import RemoteStore
from kvtier.tiers.remote.values import ValueCodec
from kvtier.tiers.secondary import SecondaryTier, TierJob, TierResult, TierStats
from kvtier.tiers.workers import Workers

__all__ = ["RemoteTier"]

logger = logging.getLogger(__name__)

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


class RemoteTier(RemoteIO, SecondaryTier):
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
    ):
        self.store, self.medium = store, store.medium
        self.codec = ValueCodec(namespace, prefix, store.separator, key_secret)
        self.breaker = breaker or CircuitBreaker()
        self.enable_events = enable_events
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._keys = KnownKeys(max_known, absent_ttl_s)  # under _lock
        self._book = RemoteReports(self.medium, enable_events)  # under _lock
        self._counters = self._book.counters
        self._queued_store_bytes = 0
        self._retention: RetentionBook | None = (
            None  # the manager's hints: values kept longer (a TTL)
        )
        self._log = RateLimitedLog(logger)
        self._workers = Workers(self._cond, io_threads, io_threads, logger, self.medium)
        self._reset = ResetSweep(
            self._cond,
            store,
            self.codec.name_prefix,
            self._workers,
            self._log,
            self.breaker.retry_s,
        )  # under _lock
        if start_open:
            self.breaker.open_now()
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
            self._cond.notify_all()  # the probe thread (`kvtier.tiers.remote.probes`)
        return result

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """The server's eviction policy orders a shared store's values; nothing to record here."""

    # -- jobs ---------------------------------------------------------------------------------

    def submit_load(self, job: TierJob) -> None:
        with self._cond:
            if self._rejected_locked(job):
                return
            generation = self._reset.admit_locked()
        self._workers.read(self._job, self._load, job, generation, time.perf_counter())

    def _rejected_locked(self, job: TierJob) -> bool:
        """Fail `job` at once, without I/O, while the breaker is open (or the tier closed), or while
        a reset's sweep runs (see `kvtier.tiers.remote.reset`)."""
        if self.breaker.is_open or self._workers.is_closed:
            counter, why = "breaker_rejects", "tier unavailable (breaker open)"
        elif self._reset.is_sweeping:
            counter, why = "reset_rejects", "tier resetting (deleting its values)"
        else:
            return False
        self._counters[counter] += len(job.keys)
        self._book.finish(job, set(job.keys), 0, 0.0, why)
        return True

    def use_retention(self, book: RetentionBook) -> None:
        self._retention = book

    def submit_store(self, job: TierJob) -> None:
        with self._cond:
            if self._rejected_locked(job):
                return
            generation = self._reset.admit_locked()
            bad = {
                k
                for k, bufs in zip(job.keys, job.buffers, strict=True)
                if not self.codec.fits(k, bufs)
            }
            self._counters["bad_jobs"] += len(bad)
            todo = [
                (k, bufs)
                for k, bufs in zip(job.keys, job.buffers, strict=True)
                if k not in self._keys and k not in bad
            ]
            known = (
                [k for k in job.keys if k in self._keys and k not in bad]
                if self.store.expires
                else []
            )
            self._queued_store_bytes += len(todo) * self.codec.payload_bytes
        self._workers.write(
            self._job, self._store, job, generation, todo, bad, known, time.perf_counter()
        )

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
            counters["breaker_opens"], counters["breaker_closes"] = (
                self.breaker.num_opens,
                self.breaker.num_closes,
            )
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
        found = self.store.exists([self.codec.name(k) for k in known]) if known else []
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
