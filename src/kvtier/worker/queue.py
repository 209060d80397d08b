"""The order in which queued jobs run.

Loads are urgent (the engine waits for them before its forward pass) and stores are
not, so a load may run before stores submitted earlier, unless it conflicts with one
of them: no job starts before an earlier-submitted job that touches the same slot or
engine block where one of the two writes it (a store reads blocks and writes slots, a
load reads slots and writes blocks). Within a direction, jobs run first-in first-out.

Why the head store can always run when the head load cannot: the load is blocked by
an earlier store, so the head store is older than every queued load, and only an older
load could block it. So `pop_next` never deadlocks.

Not thread-safe: the caller holds its lock around every call.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

from kvtier.worker.jobs import TransferJob

__all__ = ["JobQueue"]


class JobQueue:
    """Queued jobs of both directions, handed out one at a time in a safe order."""

    def __init__(self) -> None:
        self._loads: deque[TransferJob] = deque()
        self._stores: deque[TransferJob] = deque()
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._loads) + len(self._stores)

    def push(self, job: TransferJob) -> None:
        """Queue `job` behind every job submitted before it."""
        job.seq = self._next_seq
        self._next_seq += 1
        (self._stores if job.is_store else self._loads).append(job)

    def pop_next(self) -> TransferJob | None:
        """Remove and return the job to run now, or None when the queue is empty.

        Only call it when no job popped before is still running.
        """
        side = self._next_side()
        return side.popleft() if side else None

    def pop_batch(self, max_jobs: int, max_bytes: int, running: Sequence[TransferJob] = ()) -> list[TransferJob]:
        """Remove jobs that may run together, and beside `running` (jobs popped earlier and not
        finished yet): `pop_next` order, stopping before a job that conflicts with one taken or
        running, or when the batch reaches `max_jobs` or `max_bytes`.

        Returns:
            The batch; at least one job if any is queued and nothing is running.
        """
        batch: list[TransferJob] = []
        num_bytes = 0
        while len(batch) < max_jobs and num_bytes < max_bytes:
            side = self._next_side()
            if not side or any(side[0].conflicts_with(other) for other in itertools.chain(batch, running)):
                break
            batch.append(side.popleft())
            num_bytes += batch[-1].num_bytes
        return batch

    def _next_side(self) -> deque[TransferJob] | None:
        if self._loads:
            load = self._loads[0]
            if not any(store.seq < load.seq and store.conflicts_with(load) for store in self._stores):
                return self._loads
        return self._stores or None

    def drain(self) -> list[TransferJob]:
        """Remove and return every queued job, oldest first."""
        jobs = sorted([*self._loads, *self._stores], key=lambda job: job.seq)
        self._loads.clear()
        self._stores.clear()
        return jobs
