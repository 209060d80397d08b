"""What a shared tier reports to the manager: each job's result once, stored/removed events,
and counters (`TierStats.counters` names; see `kvtier.tiers.secondary`).

Thread-safety: not thread-safe; `RemoteTier` calls it with its lock held.
"""

from __future__ import annotations

import time
from collections import Counter

from kvtier.base import OffloadingEvent
from kvtier.keys import OffloadKey
from kvtier.tiers.secondary import TierJob, TierResult

__all__ = ["RemoteJobBook"]


class RemoteJobBook:
    """Args: medium: the tier's name in events; enable_events: record events (else drop them)."""

    def __init__(self, medium: str, enable_events: bool):
        self.medium, self.enable_events = medium, enable_events
        self.counters: Counter[str] = Counter()
        self._finished: list[TierResult] = []
        self._events: list[OffloadingEvent] = []

    def count(self, direction: str, num_ok: int, num_failed: int, num_bytes: int, started: float) -> None:
        """One job's chunks, bytes and seconds (since `started`, perf_counter) in `direction`."""
        self.counters[f"{direction}_chunks"] += num_ok
        self.counters[f"{direction}_failures"] += num_failed
        self.counters[f"{direction}_bytes"] += num_bytes
        self.counters[f"{direction}_seconds_us"] += int((time.perf_counter() - started) * 1e6)

    def finish(self, job: TierJob, failed: set[OffloadKey], num_bytes: int, seconds: float,
               error: str | None) -> None:
        """Record `job`'s result (reported once, by `take_finished`)."""
        if failed and error is None:
            error = f"{len(failed)} of {len(job.keys)} keys failed (see the tier's counters)"
        self._finished.append(TierResult(job_id=job.job_id, failed_keys=frozenset(failed), num_bytes=num_bytes,
                                         seconds=seconds, error=error))

    def emit(self, keys: list[OffloadKey], removed: bool) -> None:
        if self.enable_events and keys:
            self._events.append(OffloadingEvent(keys, self.medium, removed))

    def take_finished(self) -> list[TierResult]:
        finished, self._finished = self._finished, []
        return finished

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events
