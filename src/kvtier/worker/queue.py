"""The order in which queued tasks run.

Loads are urgent (the engine waits for them before its forward pass) and stores are
not, so a load may run before stores submitted earlier, unless it conflicts with one
of them: no task starts before an earlier-submitted task that touches the same slot or
engine block where one of the two writes it (a store reads blocks and writes slots, a
load reads slots and writes blocks). Within a direction, tasks run first-in first-out. A
slice of a part (some of its layers: `kvtier.worker.layered`) is a batch of its own, so that
it is reported as soon as it is copied.

Why the head store can always run when the head load cannot: the load is blocked by
an earlier store, so the head store is older than every queued load, and only an older
load could block it. So `pop_next` never deadlocks.

Not thread-safe: the caller holds its lock around every call.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Container, Sequence

from kvtier.worker.tasks import CopyTask

__all__ = ["TaskQueue"]


class TaskQueue:
    """Queued tasks of both directions, handed out one at a time in a safe order."""

    def __init__(self) -> None:
        self._loads: deque[CopyTask] = deque()
        self._stores: deque[CopyTask] = deque()
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._loads) + len(self._stores)

    def push(self, task: CopyTask) -> None:
        """Queue `task` behind every task submitted before it."""
        task.seq = self._next_seq
        self._next_seq += 1
        if task.is_store:
            self._stores.append(task)
        else:
            self._loads.append(task)

    def pop_next(self) -> CopyTask | None:
        """Remove and return the task to run now, or None when the queue is empty.

        Only call it when no task popped before is still running.
        """
        side = self._next_side()
        if not side:
            return None
        return side.popleft()

    def pop_batch(
        self, max_tasks: int, max_bytes: int, running: Sequence[CopyTask] = ()
    ) -> list[CopyTask]:
        """Remove tasks that may run together, and beside `running` (tasks popped earlier and not
        finished yet): `pop_next` order, stopping before a task that conflicts with one taken or
        running, or when the batch reaches `max_tasks` or `max_bytes`; a slice of layers alone.

        Returns:
            The batch; at least one task if any is queued and nothing is running.
        """
        batch: list[CopyTask] = []
        num_bytes = 0
        while len(batch) < max_tasks and num_bytes < max_bytes:
            side = self._next_side()
            if not side or any(
                side[0].conflicts_with(other) for other in itertools.chain(batch, running)
            ):
                break
            if batch and (side[0].layers is not None or batch[-1].layers is not None):
                break
            batch.append(side.popleft())
            num_bytes += batch[-1].num_bytes
        return batch

    def _next_side(self) -> deque[CopyTask] | None:
        if self._loads:
            load = self._loads[0]
            if not any(
                store.seq < load.seq and store.conflicts_with(load) for store in self._stores
            ):
                return self._loads
        return self._stores or None

    def drain(self, job_ids: Container[int] | None = None) -> list[CopyTask]:
        """Remove and return the queued tasks of `job_ids` (None: every task), oldest first.

        Removing a task never makes a remaining one unsafe: the order rule only ever holds
        tasks back, behind earlier ones.
        """
        taken = [
            t
            for t in itertools.chain(self._loads, self._stores)
            if job_ids is None or t.job_id in job_ids
        ]
        if taken:
            gone = {id(t) for t in taken}
            self._loads = deque(t for t in self._loads if id(t) not in gone)
            self._stores = deque(t for t in self._stores if id(t) not in gone)
        return sorted(taken, key=lambda task: task.seq)
