"""What a secondary tier holds for the manager until it asks: finished jobs' results, each
once; stored/removed events; counters (`TierStats.counters` names, see `kvtier.base`).
The disk tier's `DiskReports` and the shared tiers' `RemoteReports` add how their jobs end.

Thread-safety: not thread-safe; the owning tier calls it with its lock held.
"""

from __future__ import annotations

from collections import Counter

from kvtier.base import OffloadingEvent
from kvtier.keys import OffloadKey
from kvtier.tiers.secondary import TierResult

__all__ = ["TierReports"]


class TierReports:
    """Args: medium: the tier's name in its events; enable_events: record events (else `emit` drops them)."""

    def __init__(self, medium: str, enable_events: bool):
        self.medium = medium
        self.enable_events = enable_events
        self.finished: list[TierResult] = []
        self.events: list[OffloadingEvent] = []
        self.counters: Counter[str] = Counter()

    def take_finished(self) -> list[TierResult]:
        finished, self.finished = self.finished, []
        return finished

    def take_events(self) -> list[OffloadingEvent]:
        events, self.events = self.events, []
        return events

    def emit(self, keys: list[OffloadKey], removed: bool) -> None:
        if self.enable_events and keys:
            self.events.append(OffloadingEvent(keys, self.medium, removed))
