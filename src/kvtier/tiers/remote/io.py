"""What a shared tier's job does on a pool thread: whether it may still start, the load (every
value checked before a byte counts as loaded, bad ones deleted), the store (only names that do
not exist yet are written), and what a failed operation does (counted, fed to the breaker).

`RemoteIO` is a part of `kvtier.tiers.remote.tier.RemoteTier` (a mixin): it shares the tier's
lock, known keys, reports, breaker and reset sweep, so it is not a class of its own. The
tier's thread decides and submits (`RemoteTier.submit_load` / `submit_store`); these methods
run on its read and write pools and touch the shared state only under `_cond`, never across I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvtier.keys import OffloadKey
from kvtier.policies.retention import RetentionBook
from kvtier.tiers.rate_limited_log import RateLimitedLog
from kvtier.tiers.remote.breaker import CircuitBreaker
from kvtier.tiers.remote.credentials import redact
from kvtier.tiers.remote.keys import KnownKeys
from kvtier.tiers.remote.reports import RemoteReports
from kvtier.tiers.remote.reset import ResetSweep
from kvtier.tiers.remote.store import ItemsFailed, RemoteStore
from kvtier.tiers.remote.values import ValueCodec
from kvtier.tiers.secondary import TierJob

__all__ = ["RemoteIO"]

logger = logging.getLogger(
    "kvtier.tiers.remote.tier"
)  # the tier's logger, as before this part moved here


class RemoteIO:
    """The pool side of `RemoteTier`; see the module docstring."""

    # the tier's state this part reads and changes (set by RemoteTier.__init__)
    medium: str
    store: RemoteStore
    codec: ValueCodec
    breaker: CircuitBreaker
    _cond: threading.Condition
    _keys: KnownKeys
    _book: RemoteReports
    _counters: Counter[str]  # the book's
    _queued_store_bytes: int
    _log: RateLimitedLog
    _reset: ResetSweep
    _retention: RetentionBook | None

    def _job(self, run: Callable[..., None], job: TierJob, *args: object) -> None:
        """`run(job, *args)` on a pool thread; the reset's sweep is told when it is over, whatever happens."""
        try:
            run(job, *args)
        finally:
            self._reset.job_over()

    def _may_start(self, job: TierJob, generation: int, queued_bytes: int) -> bool:
        """Whether `job` may start its I/O: not past its deadline (else counted `expired`) nor from before
        a reset. If not, its keys fail now and a store gives back its `queued_bytes`."""
        with self._cond:
            is_expired = time.monotonic() >= job.deadline
            if not is_expired and generation == self._reset.generation:
                return True
            self._counters["expired"] += len(job.keys) if is_expired else 0
            self._queued_store_bytes -= queued_bytes
            self._book.finish(
                job,
                set(job.keys),
                0,
                0.0,
                "deadline passed before its I/O started" if is_expired else "reset while in flight",
            )
            return False

    def _load(self, job: TierJob, generation: int, started: float) -> None:
        if not self._may_start(job, generation, 0):
            return
        error = None
        parts = [self.codec.receiving_parts(bufs) for bufs in job.buffers]
        names = [self.codec.name(k) for k in job.keys]
        unread: set[int] = set()  # the items whose GET failed: that says nothing about their keys
        try:  # each value's header (and tag) into buffers of its own, its payload straight into the slab rows
            sizes = self.store.get_into(names, parts)
            self.breaker.record_success()
        except ItemsFailed as exc:
            sizes, unread, error = exc.results, set(exc.errors), self._failed(exc, "load")
        except Exception as exc:
            sizes, unread, error = (
                [None] * len(job.keys),
                set(range(len(job.keys))),
                self._failed(exc, "load"),
            )
        read = [i for i in range(len(job.keys)) if i not in unread]
        gone: set[OffloadKey] = set()  # absent or bad values: forgotten
        corrupt = self._refuse_bad_values(
            [job.keys[i] for i in read], [sizes[i] for i in read], [parts[i] for i in read], gone
        )
        failed = gone | {job.keys[i] for i in unread}
        with self._cond:
            self._counters["corrupt"] += len(corrupt)
            self._counters["load_missing"] += len(gone) - len(corrupt)
            self._keys.forget(list(gone))
            if generation == self._reset.generation:  # (a reset dropped them all already)
                self._book.emit(sorted(gone), removed=True)
            if generation != self._reset.generation:
                failed, error = set(job.keys), "reset while in flight"
            elif (
                time.monotonic() > job.deadline
            ):  # the manager has given up on it: it only frees the slots
                self._counters["late"] += len(job.keys)
                failed, error = set(job.keys), "finished after its deadline"
            num_bytes = self.codec.payload_bytes * (len(job.keys) - len(failed))
            self._book.count("load", len(job.keys) - len(failed), len(failed), num_bytes, started)
            self._book.finish(job, failed, num_bytes, time.perf_counter() - started, error)
        self._renew(
            [key for key in job.keys if key not in failed]
        )  # used again: another TTL (after the report)

    def _refuse_bad_values(
        self,
        keys: Sequence[OffloadKey],
        sizes: Sequence[int | None],
        parts: Sequence[tuple[memoryview, ...]],
        failed: set[OffloadKey],
    ) -> list[str]:
        """Add the keys whose value is absent or fails a check to `failed`; delete the bad values (their names
        are returned)."""
        corrupt: list[str] = []
        for key, size, received in zip(keys, sizes, parts, strict=True):
            why = "absent" if size is None else self.codec.check(key, size, received)
            if why is not None:
                failed.add(key)
                if size is not None:
                    corrupt.append(self.codec.name(key))
                    self._log.log_once(
                        "corrupt",
                        f"{self.medium} tier: dropped a bad value of {key.hex()[:16]}…: {why}",
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
        failed, error, written = set(bad), None, [False] * len(todo)
        try:
            if todo:
                written = self.store.put(
                    [(self.codec.name(k), self.codec.pack(k, bufs)) for k, bufs in todo],
                    self._keep_s([k for k, _ in todo]),
                )
                self.breaker.record_success()
        except ItemsFailed as exc:  # the others were written (or found): their keys are stored
            written = [bool(is_new) for is_new in exc.results]
            failed.update(todo[i][0] for i in exc.errors)
            error = self._failed(exc, "store")
        except Exception as exc:
            failed.update(k for k, _ in todo)
            error = self._failed(exc, "store")
        new_keys = [
            k for (k, _), is_new in zip(todo, written, strict=True) if is_new and k not in failed
        ]
        num_existing = sum(
            1
            for (k, _), is_new in zip(todo, written, strict=True)
            if not is_new and k not in failed
        )
        with self._cond:
            self._queued_store_bytes -= len(todo) * self.codec.payload_bytes
            self._counters["store_existing"] += (
                num_existing  # written by another replica: never rewritten
            )
            if (
                generation != self._reset.generation
            ):  # what it wrote, the sweep deletes (it waits for this job)
                failed, error, new_keys = set(job.keys), "reset while in flight", []
            else:  # only what this job wrote or found: a key skipped as known may have been forgotten since
                for key, _ in todo:
                    if key not in failed:
                        self._keys.remember(key)
                self._book.emit(new_keys, removed=False)
            num_bytes = len(new_keys) * self.codec.payload_bytes
            self._book.count("store", len(new_keys), len(failed), num_bytes, started)
            self._book.finish(job, failed, num_bytes, time.perf_counter() - started, error)
        if (
            error is None
        ):  # values stored again (here or by another replica): another TTL, and the new hints
            self._renew(
                [*known, *(k for (k, _), is_new in zip(todo, written, strict=True) if not is_new)]
            )

    def _renew(self, keys: Sequence[OffloadKey]) -> None:
        """Give these values another TTL where the store's values expire (no more than one round trip,
        never failing the job: a failure is logged once and counted, the breaker is not told)."""
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
        message = (
            f"{what} failed ({'timeout' if is_timeout else type(exc).__name__}): {redact(str(exc))}"
        )
        with self._cond:
            self._counters["timeouts" if is_timeout else "errors"] += 1
        if self.breaker.record_failure():
            logger.warning(
                "kvtier: %s tier at %s is failing (%s); answering misses and retrying in the background",
                self.medium,
                self.store.describe(),
                message,
            )
            with self._cond:
                self._cond.notify_all()
        else:
            self._log.log_once(what, f"{self.medium} tier: {message}")
        return message

    def _delete(self, names: list[str]) -> None:
        try:
            self.store.delete(names)
        except Exception as exc:
            self._log.log_once("delete", f"{self.medium} tier: delete failed: {redact(str(exc))}")
