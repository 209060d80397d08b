"""The tier jobs a `TieredManager` has in flight, and their deadlines.

Every tier job (`kvtier.tiers.secondary.TierJob`) gets a deadline when it is submitted:
`submitted + timeout_s`. Past it the manager stops waiting for the job (`expire`): a promotion
gives back its share of the promotion budget and its chunk reads as a miss (no request waits
for it any more). What the job holds — a slab slot being read into, a pinned slot or a
staging row being written from — stays held until the tier reports the job, however late:
a read stuck in the kernel may still write its slot, so that slot is never handed to another
chunk before then (docs/architecture.md, "Jobs": a late completion only frees what it held).

Thread-safety: not thread-safe; the manager calls it from one thread.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from kvtier.base import ReqContext
from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey

__all__ = ["READS", "Flight", "FlightKind", "Flights"]


class FlightKind(enum.Enum):
    """Why a tier job runs. A promotion and an exploration are loads (`TierJob.is_store` False), the
    others stores."""

    # secondary -> a PENDING CPU slot
    PROMOTION = "promotion"
    # secondary -> a scratch buffer, to measure the tier (nothing keeps it)
    EXPLORATION = "exploration"
    # a pinned READY CPU slot -> secondary
    CASCADE = "cascade"
    # a staging row (an evicted chunk's bytes) -> an on_evict secondary
    EVICTED = "evicted"
    # a pinned READY CPU slot -> the hand-off tier, for another engine (`kvtier.tiers.handoff`)
    HANDOFF = "handoff"


# the kinds that read from a tier
READS = (FlightKind.PROMOTION, FlightKind.EXPLORATION)


@dataclass(slots=True)
class Flight:
    """A tier job in flight, and what its end releases."""

    kind: FlightKind
    tier: int
    keys: tuple[OffloadKey, ...]
    ctx: ReqContext
    num_bytes: int
    submitted_at: float
    deadline: float
    staging_rows: tuple[int, ...] = ()
    # past its deadline: nobody waits for it; what it holds is still held
    is_expired: bool = False


class Flights:
    """Tier jobs by id, until their tier reports them.

    Args:
        timeout_s: how long after its submission a job is given up on.
    """

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ConfigError(f"the tier job timeout must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._by_id: dict[int, Flight] = {}
        # (deadline, job id), deadlines ascending
        self._due: deque[tuple[float, int]] = deque()

    def __len__(self) -> int:
        return len(self._by_id)

    def deadline_for(self, now: float) -> float:
        return now + self.timeout_s

    def add(self, job_id: int, flight: Flight) -> None:
        """Record a job just submitted (its deadline is `deadline_for(submitted_at)`)."""
        self._by_id[job_id] = flight
        self._due.append((flight.deadline, job_id))

    def pop(self, job_id: int) -> Flight | None:
        """The job its tier just reported (None: not ours)."""
        return self._by_id.pop(job_id, None)

    def expire(self, now: float) -> list[Flight]:
        """The jobs whose deadline passed since the last call (still in flight, now `is_expired`).
        O(1) per job: deadlines come in submission order."""
        expired = []
        due = self._due
        while due and due[0][0] <= now:
            flight = self._by_id.get(due.popleft()[1])
            if flight is not None:
                flight.is_expired = True
                expired.append(flight)
        return expired
