"""What the disk tier reports: job results, events, counters, and the failures it logs.

- `DiskJob`: one submitted `TierJob` while its chunks are in flight.
- `DiskReports`: checks each chunk of a submitted job, counts how each chunk ended, records
  the job's `TierResult` once the last one has, and holds results, events and counters
  until the manager takes them. A job submitted before a `reset()` (an older generation)
  fails whole.
- `FailureLog`: names the kind of an I/O failure (the counter it goes to) and logs each
  kind at most once a minute: a full disk fails every store.

Thread-safety: `DiskReports` is not thread-safe; the tier calls it with its lock held.
`FailureLog` may be called from any thread (its own lock guards only the rate limit).
"""

from __future__ import annotations

import errno
import time
from collections.abc import Sequence

from kvtier.keys import OffloadKey
from kvtier.tiers.disk.files import FileScan
from kvtier.tiers.rate_limited_log import RateLimitedLog
from kvtier.tiers.reports import TierReports
from kvtier.tiers.secondary import TierJob, TierResult

__all__ = ["DiskJob", "DiskReports", "FailureLog"]

# what ValueHeader can hold
_MAX_KEY_BYTES = 64
_ERRNO_KINDS = {
    errno.ENOSPC: "enospc",
    errno.EDQUOT: "enospc",
    errno.EROFS: "erofs",
    errno.EACCES: "eacces",
    errno.EPERM: "eacces",
    errno.ENOENT: "missing",
    errno.EIO: "eio",
    # a symlink or file planted where the tier expects its own file or directory: never followed
    # (see `kvtier.tiers.disk.root`)
    errno.ELOOP: "unsafe_paths",
    errno.ENOTDIR: "unsafe_paths",
}


class DiskJob:
    """One submitted TierJob while its chunks are in flight."""

    __slots__ = ("failed", "generation", "job", "num_bytes", "remaining", "started")

    def __init__(self, job: TierJob, generation: int):
        self.job = job
        self.generation = generation
        self.failed: set[OffloadKey] = set()
        self.num_bytes = 0
        self.remaining = 0
        self.started = time.perf_counter()


class DiskReports(TierReports):
    """Finished results, events and counters of the disk tier, until the manager takes them.

    Args:
        medium: the tier's medium, named in its events.
        enable_events: record stored/removed events (else `emit` drops them).
        payload_bytes: the size of every chunk's payload (all ranks' buffers).
    """

    def __init__(self, medium: str, enable_events: bool, payload_bytes: int):
        super().__init__(medium, enable_events)
        self.payload_bytes = payload_bytes

    def fits(self, key: OffloadKey, bufs: Sequence[memoryview]) -> bool:
        """Whether a job's chunk has a key a header can hold and a whole payload (else: a bad job)."""
        if len(key) <= _MAX_KEY_BYTES and sum(b.nbytes for b in bufs) == self.payload_bytes:
            return True
        self.counters["bad_jobs"] += 1
        return False

    def start(self, state: DiskJob, num_tasks: int, generation: int) -> None:
        """`state` has `num_tasks` chunks in flight (its result is recorded now if none)."""
        state.remaining = num_tasks
        self._finish_if_done(state, generation)

    def chunk_done(
        self,
        state: DiskJob,
        key: OffloadKey,
        num_bytes: int,
        direct: bool,
        failure: str | None,
        generation: int,
    ) -> None:
        """One chunk of `state` ended: moved `num_bytes` (with O_DIRECT or not), or failed with
        `failure`, the counter of its kind. `generation` is the tier's current one."""
        direction = "store" if state.job.is_store else "load"
        counters = self.counters
        if failure is None:
            counters[f"{direction}_chunks"] += 1
            counters[f"{direction}_bytes"] += num_bytes
            counters[
                f"{direction}_direct_chunks" if direct else f"{direction}_buffered_chunks"
            ] += 1
            state.num_bytes += num_bytes
        else:
            counters[f"{direction}_failures"] += 1
            counters[failure] += 1
            state.failed.add(key)
        state.remaining -= 1
        self._finish_if_done(state, generation)

    def _finish_if_done(self, state: DiskJob, generation: int) -> None:
        if state.remaining:
            return
        job = state.job
        seconds = time.perf_counter() - state.started
        direction = "store" if job.is_store else "load"
        self.counters[f"{direction}_seconds_us"] += int(seconds * 1e6)
        failed = state.failed
        error = None
        if state.generation != generation:
            failed = set(job.keys)
            error = "reset while in flight"
        elif failed:
            error = f"{len(failed)} of {len(job.keys)} keys failed (see the tier's counters)"
        self.finished.append(
            TierResult(
                job_id=job.job_id,
                failed_keys=frozenset(failed),
                num_bytes=state.num_bytes,
                seconds=seconds,
                error=error,
            )
        )

    def count_scan(self, found: FileScan) -> None:
        self.counters["scanned_files"] += len(found.keys)
        self.counters["tmp_removed"] += found.num_tmp_removed
        self.counters["garbage_removed"] += found.num_garbage_removed


class FailureLog(RateLimitedLog):
    """Classifies and logs a tier's failures, each kind at most once a minute."""

    def failure(self, exc: Exception, what: str) -> str:
        """Log that `what` failed with `exc`; returns the failure's kind (a counter name)."""
        kind = _ERRNO_KINDS.get(getattr(exc, "errno", None) or 0, "io_error")
        if not isinstance(exc, OSError):
            kind = "error"
            self._logger.exception("disk tier: %s failed", what)
        self.log_once(kind, f"disk tier: {what} failed: {exc}")
        return kind
