"""A shared tier's probe thread: it asks the store which keys exist, so that lookups never block,
and pings the store while the circuit breaker is open, so that the tier serves again once the
server answers.

Lookups queue the keys they know nothing about (`kvtier.tiers.remote.keys.KnownKeys`) and
notify the tier's condition; this thread takes up to `probe_batch` of them per round trip
and records the answers, unless a reset came meanwhile (the answers are then dropped). While
the breaker is open it drops the queue (lookups answer MISS then) and pings when due. On a
store that cannot list it also reads the namespace's epoch record every `epoch_check_s`, and
follows another replica's reset when the epoch changed (`kvtier.tiers.remote.reset`).

Thread-safety: one thread of its own; it shares state with the tier only under the tier's lock
(`cond`), never held across a round trip.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable

from kvtier.keys import OffloadKey
from kvtier.tiers.rate_limited_log import RateLimitedLog
from kvtier.tiers.remote.breaker import CircuitBreaker
from kvtier.tiers.remote.credentials import redact
from kvtier.tiers.remote.keys import KnownKeys
from kvtier.tiers.remote.reports import RemoteReports
from kvtier.tiers.remote.reset import ResetSweep
from kvtier.tiers.remote.store import RemoteStore

__all__ = ["ProbeThread"]

logger = logging.getLogger(__name__)


class ProbeThread:
    """Args:
    cond: the tier's condition (lookups notify it when they queue a key).
    keys: what the tier knows of the store's keys (under `cond`'s lock).
    store, name: the store, and the name of a key in it.
    breaker: the tier's circuit breaker.
    reset: the tier's generation (answers from before a reset are dropped).
    counters: the tier's counters (`probed_keys`).
    failed: the tier's handler of a failed operation (counts it, feeds the breaker).
    log: the tier's rate-limited log.
    probe_batch: keys per round trip at most.
    epoch_check_s: how often the epoch record is read (a store that cannot list).
    reports: the tier's reports (the keys it forgets when it follows another replica's reset).
    """

    def __init__(
        self,
        cond: threading.Condition,
        keys: KnownKeys,
        store: RemoteStore,
        name: Callable[[OffloadKey], str],
        breaker: CircuitBreaker,
        reset: ResetSweep,
        counters: Counter[str],
        failed: Callable[[Exception, str], str],
        log: RateLimitedLog,
        probe_batch: int,
        epoch_check_s: float,
        reports: RemoteReports,
    ):
        self._cond = cond
        self._reports = reports
        self._keys = keys
        self._store = store
        self._name = name
        self._breaker = breaker
        self._reset = reset
        self._counters = counters
        # the tier's method, held weakly: a tier nobody closed ends this thread when it is collected
        self._failed = weakref.WeakMethod(failed)  # type: ignore[arg-type]
        self._log = log
        self._probe_batch = probe_batch
        self._epoch_check_s = epoch_check_s
        self._next_epoch_check = 0.0
        # the longest wait for a lookup's key while the breaker is closed
        self._idle_s = 1.0
        if reset.epoch_record is not None:
            self._idle_s = min(self._idle_s, epoch_check_s)
        self._stop = False
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name=f"kvtier-{store.medium}-probe"
        )
        self._thread.start()

    def stop(self) -> bool:
        """Stop the thread and wait for it; False when it was stopped already."""
        with self._cond:
            if self._stop:
                return False
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                # sleep until the next ping is due
                if self._breaker.is_open:
                    self._cond.wait_for(
                        lambda: self._stop, timeout=self._breaker.seconds_to_next_probe()
                    )
                else:
                    self._cond.wait_for(
                        lambda: self._stop or self._keys.has_queued or self._breaker.is_open,
                        timeout=self._idle_s,
                    )
                # closed, or the tier is gone
                if self._stop or self._failed() is None:
                    return
                batch = self._keys.take_queued(self._probe_batch)
                generation = self._reset.generation
            if self._breaker.is_open:
                self._forget(batch)
                self._ping_if_due()
            else:
                if batch:
                    self._probe(batch, generation)
                self._check_epoch()

    def _probe(self, keys: list[OffloadKey], generation: int) -> None:
        try:
            found = self._store.exists([self._name(k) for k in keys])
        except Exception as exc:
            failed = self._failed()
            if failed is not None:
                failed(exc, "existence probe")
            self._forget(keys)
            return
        self._breaker.record_success()
        with self._cond:
            self._counters["probed_keys"] += len(keys)
            self._keys.record_probe(keys, found, is_current=generation == self._reset.generation)

    def _check_epoch(self, due: bool = False) -> bool:
        """A store that cannot list: read the epoch record when due (or `due`), and follow another
        replica's reset (the tier forgets what it knew, announcing each key it knew as removed,
        and names values under the new epoch once the jobs from before are over); see
        `kvtier.tiers.remote.reset`. False: the record could not be read."""
        now = time.monotonic()
        if self._reset.epoch_record is None:
            return True
        if not due and now < self._next_epoch_check:
            return True
        self._next_epoch_check = now + self._epoch_check_s
        with self._cond:
            if self._reset.is_sweeping:
                return True
            generation = self._reset.generation
        try:
            epoch = self._reset.epoch_record.read()
        except Exception as exc:
            failed = self._failed()
            if failed is not None:
                failed(exc, "epoch read")
            return False
        self._breaker.record_success()
        with self._cond:
            following = self._reset.follow_locked(epoch, generation)
            if following is None:
                return True
            # nothing else tells the engine's routers: unlike after its own reset, the tier
            # does not look these keys up again to find them gone
            self._reports.emit(list(self._keys), removed=True)
            self._keys.clear()
            self._counters["epoch_changes"] += 1
        logger.info(
            "kvtier: %s tier: another replica reset the namespace; following it", self._store.medium
        )
        self._reset.rejoin_soon(following)
        return True

    def _forget(self, keys: list[OffloadKey]) -> None:
        with self._cond:
            self._keys.unprobe(keys)

    def _ping_if_due(self) -> None:
        if not self._breaker.should_probe():
            return
        medium = self._store.medium
        endpoint = self._store.describe()
        try:
            self._store.ping()
        except Exception as exc:
            self._log.log_once(
                "ping", f"{medium} tier: {endpoint} still unreachable: {redact(str(exc))}"
            )
            return
        # a store that cannot list: the keys the tier knew may be of an epoch another replica
        # reset while this one could not reach the store; they are not served before the record
        # is read (the breaker stays open if it cannot be)
        if not self._check_epoch(due=True):
            return
        if self._breaker.probe_succeeded():
            logger.warning("kvtier: %s tier at %s answers again; serving from it", medium, endpoint)
