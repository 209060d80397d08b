"""What a shared tier reports to the manager (`kvtier.tiers.reports`), and how its jobs
end: one result per job, chunks, bytes and seconds counted per direction.

Thread-safety: not thread-safe; `RemoteTier` calls it with its lock held.
"""

from __future__ import annotations

import time

from kvtier.keys import OffloadKey
from kvtier.tiers.reports import TierReports
from kvtier.tiers.secondary import TierJob, TierResult

__all__ = ["RemoteReports"]


class RemoteReports(TierReports):
    """`TierReports` with how a shared tier's jobs end (one result per job, counted per direction)."""

    def count(
        self, direction: str, num_ok: int, num_failed: int, num_bytes: int, started: float
    ) -> None:
        """One job's chunks, bytes and seconds (since `started`, perf_counter) in `direction`."""
        self.counters[f"{direction}_chunks"] += num_ok
        self.counters[f"{direction}_failures"] += num_failed
        self.counters[f"{direction}_bytes"] += num_bytes
        self.counters[f"{direction}_seconds_us"] += int((time.perf_counter() - started) * 1e6)

    def finish(
        self,
        job: TierJob,
        failed: set[OffloadKey],
        num_bytes: int,
        seconds: float,
        error: str | None,
    ) -> None:
        """Record `job`'s result (reported once, by `take_finished`)."""
        if failed and error is None:
            error = f"{len(failed)} of {len(job.keys)} keys failed (see the tier's counters)"
        self.finished.append(
            TierResult(
                job_id=job.job_id,
                failed_keys=frozenset(failed),
                num_bytes=num_bytes,
                seconds=seconds,
                error=error,
            )
        )
