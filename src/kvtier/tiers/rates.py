"""How fast each secondary tier reads, as the `TieredManager` sees its jobs end — what the
load-or-recompute decision weighs (`kvtier.costmodel`).

Every tier job that ends feeds its tier's `TransferRate` for its direction: promotions and
explorations are reads, cascades and evicted-chunk writes are writes. A tier's read estimate is measured from
its reads; until it has read enough, from its writes (the same link and server carry both, and
write-through stores start with the first request); until then, its prior. A job given up on
(past its deadline) counts as taking the whole timeout: the tier was that slow for it. Reads
queued ahead of a new one are the reads in flight from that tier.

A tier's estimate ages on the manager's clock (the scheduler's): each job is stamped when the
manager sees it end. `may_explore` says whether a tier the decision wrote off may be read once
more to measure it (`kvtier.costmodel.exploration`): not while a job that feeds its estimate is in
flight (it will feed it, in time or at its deadline), nor while a read given up on is still
unanswered, and not sooner than the exploration rules allow after its newest job and its last
exploration.

Thread-safety: not thread-safe; the manager calls it from one thread.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvtier.costmodel.estimates import ReadEstimate, TransferRate, read_prior
from kvtier.costmodel.exploration import Exploration
from kvtier.tiers.flights import READS, Flight
from kvtier.tiers.secondary import SecondaryTier, TierResult

__all__ = ["TierRates"]

# fewer measured reads: the tier's writes stand in
_MIN_READS = 3


class TierRates:
    """A read and a write `TransferRate` per secondary tier, in the manager's tier order."""

    def __init__(self, tiers: Sequence[SecondaryTier], clock: Callable[[], float] = time.monotonic):
        self._media = [t.medium for t in tiers]
        self._reads = [TransferRate(read_prior(t.medium)) for t in tiers]
        self._writes = [TransferRate(read_prior(t.medium)) for t in tiers]
        # tier index -> bytes of reads in flight
        self._queued = Counter[int]()
        # tier index -> writes in flight
        self._writing = Counter[int]()
        # tier index -> reads given up on, not reported yet
        self._unanswered = Counter[int]()
        self._explorations = [Exploration() for _ in tiers]
        self._clock = clock

    def use_clock(self, clock: Callable[[], float]) -> None:
        """The clock estimates age on (the scheduler's; monotonic seconds)."""
        self._clock = clock

    def submitted(self, flight: Flight) -> None:
        if flight.kind in READS:
            self._queued[flight.tier] += flight.num_bytes
        else:
            self._writing[flight.tier] += 1

    def ended(self, flight: Flight, result: TierResult) -> None:
        """`flight` ended with `result` (one given up on was counted by `expired` already). A job with
        a failed key is not measured: a rejected or missing read takes no time for no bytes, and
        would make the tier look faster than it reads."""
        if flight.is_expired:
            if flight.kind in READS:
                self._unanswered[flight.tier] -= 1
            return
        self._unqueue(flight)
        if not result.failed_keys and result.num_bytes > 0:
            self._rate(flight).add(
                result.num_bytes, flight.submitted_at, result.seconds, ended_at=self._clock()
            )

    def expired(self, flight: Flight, timeout_s: float) -> None:
        """`flight` passed its deadline: it is counted as having taken `timeout_s`."""
        self._unqueue(flight)
        if flight.kind in READS:
            self._unanswered[flight.tier] += 1
        self._rate(flight).add(
            flight.num_bytes, flight.submitted_at, timeout_s, ended_at=self._clock()
        )

    def estimates(self) -> dict[str, ReadEstimate]:
        """Each tier's read estimate, with its promotions in flight queued ahead (first tier of a
        medium wins: media are unique in practice)."""
        out: dict[str, ReadEstimate] = {}
        for index, medium in enumerate(self._media):
            out.setdefault(medium, self._estimated_by(index).estimate(self._queued[index]))
        return out

    def may_explore(self, index: int) -> bool:
        """Whether tier `index` may be read now to measure it again (see the module docstring)."""
        rate = self._estimated_by(index)
        by_writes = rate is self._writes[index]
        if self._queued[index] or self._unanswered[index] or (by_writes and self._writing[index]):
            return False
        return self._explorations[index].is_due(rate, self._clock())

    def explored(self, index: int) -> None:
        """A read of tier `index` was started to measure it."""
        self._explorations[index].started(self._clock())

    def _estimated_by(self, index: int) -> TransferRate:
        """The rate tier `index`'s read estimate stands on: its reads once it read enough, else its writes."""
        reads = self._reads[index]
        return reads if reads.num_samples >= _MIN_READS else self._writes[index]

    def _rate(self, flight: Flight) -> TransferRate:
        return (self._reads if flight.kind in READS else self._writes)[flight.tier]

    def _unqueue(self, flight: Flight) -> None:
        if flight.kind in READS:
            self._queued[flight.tier] -= flight.num_bytes
        else:
            self._writing[flight.tier] -= 1
