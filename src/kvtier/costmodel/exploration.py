"""Exploration: when a tier the load-or-recompute decision wrote off is tried again.

An estimate fed only by the jobs it lets run stops being measured once it says "slower than
recomputing": no job starts, and one slow spell disables a tier (or RAM) for good (issue 32). So a
decision whose head stops before a chunk found in tier T still tries T, when T's estimate is
stale:

- nothing in flight will measure it (a read, or while the tier's writes stand in for its reads, a
  write: each ends or is given up on within its deadline, and feeds the estimate either way), and
  no read given up on is still unanswered (the tier is hung: another read would hang too);
- its newest job ended, and its last exploration started, at least `wait_s` ago: `EXPLORE_AFTER_S`
  after a fast job, longer after a slow one (`_EXPLORE_SHARE`: a tier that really is slow spends at
  most that share of its time on explorations), never more than `_EXPLORE_MAX_WAIT_S`.

How a tier is tried is the caller's: a secondary tier reads the chunk in the background into a
scratch buffer (`TieredManager.explore`: no RAM slot, nothing evicted, no request waits; the
request recomputes as decided, and exploring costs it nothing but a chunk of that tier's
bandwidth); RAM is tried by one decision loading its RAM head anyway (a copy into the engine
needs the request's blocks).

Thread-safety: not thread-safe; one owner calls it from one thread.
"""

from __future__ import annotations

import math

from kvtier.costmodel.estimates import TransferRate

__all__ = ["EXPLORE_AFTER_S", "Exploration"]

# at most one exploration of a tier a second: a recovered tier is trusted again after three
# (`kvtier.costmodel.estimates`'s _MIN_SAMPLES newest jobs), within seconds
EXPLORE_AFTER_S = 1.0
# after an exploration that took s seconds, none for 3 s more: a slow tier spends at most a quarter
# of its time on them (a 2 MB/s link reading 2 MiB chunks: one every ~4 s)
_EXPLORE_SHARE = 0.25
# a read given up on at the default 10 s deadline (`job_timeout_s`) is tried again 10 s later, not
# 30 s: a tier whose stall ended is loaded from again within seconds, and a tier slower than any
# deadline costs one chunk per 20 s
_EXPLORE_MAX_WAIT_S = 10.0


class Exploration:
    """When one tier was last explored, and whether it may be now."""

    def __init__(self) -> None:
        self.started_at = -math.inf

    def is_due(self, rate: TransferRate, now: float) -> bool:
        """Whether a tier whose estimate is `rate` (nothing in flight to measure it: the caller's
        check) may be explored at `now`."""
        wait_s = min(
            max(EXPLORE_AFTER_S, rate.last_seconds * (1 / _EXPLORE_SHARE - 1)), _EXPLORE_MAX_WAIT_S
        )
        return now - max(rate.last_ended_at, self.started_at) >= wait_s

    def started(self, now: float) -> None:
        self.started_at = now
