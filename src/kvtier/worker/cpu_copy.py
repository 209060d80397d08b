"""The CPU path: a planning thread that plans batches while copy threads move earlier ones.

The planning thread takes a batch of queued tasks (`TaskQueue.pop_batch`), turns it into byte
runs with numpy, and hands the runs to `MemmoveCopier`; while they copy, it plans the next
batches (up to `_MAX_IN_FLIGHT` started), none conflicting with one in flight. Planning per
task and waking threads per task cost as much as copying 1 MiB here; batches and the overlap
hide both.

Cancelling (issue #20): `cancel` drains a job's queued tasks and cuts short every batch in
flight that holds one of its tasks (`CopyHandle.cancel`: the copy stops within about a MiB).
A batch cut short reports every task in it failed — which bytes of which task were copied is
not known, and a half-written slot or block must never count as moved. That includes tasks of
other jobs batched with the cancelled one: they fail too (a store is dropped, a load
recomputed), counted in `num_cut_tasks`. A cancel is rare (a job past its deadline) and a
batch holds at most `_BATCH_MAX_TASKS` tasks; waiting for the batch instead would hold the
forward pass for up to `_BATCH_MAX_BYTES` of copying, or far more on the slow host that made
the job late.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.worker.layouts import GroupLayout
from kvtier.worker.memmove import CopyHandle, MemmoveCopier
from kvtier.worker.pointers import copy_pointers, plane_pointers
from kvtier.worker.queue import TaskQueue
from kvtier.worker.results import CANCELLED
from kvtier.worker.tasks import CopyTask, DoneCallback

__all__ = ["CpuBackend"]

# A batch amortizes planning and thread hand-offs; its cap bounds how long a load that
# arrives meanwhile waits behind it (32 MiB is ~2-3 ms here).
_BATCH_MAX_TASKS = 64
_BATCH_MAX_BYTES = 32 << 20
# Batches started and not yet reported. More than two keeps the copy threads busy while the task
# thread waits for the GIL beside a busy Python thread (~5 ms, the switch interval; measured
# with `bench_transfer.py --gil`); each one more lets a load wait behind one more batch.
_MAX_IN_FLIGHT = 3


@dataclass(slots=True, eq=False)
class _Running:
    """A batch taken from the queue, until reported: being planned (`handle` None), then copying."""

    batch: list[CopyTask]
    handle: CopyHandle | None = None
    started_at: float = 0.0
    cancelled_job_ids: set[int] = field(default_factory=set)


class CpuBackend:
    """Runs tasks on background threads, in `TaskQueue` order, batched, with `MemmoveCopier`.

    Thread-safety: `submit`, `cancel` and `shutdown` may be called from any thread; `on_done`
    is called from the planning thread, outside this backend's lock.
    """

    def __init__(
        self,
        layouts: Sequence[GroupLayout],
        slab: torch.Tensor,
        on_done: DoneCallback,
        num_threads: int = 2,
    ) -> None:
        self._layouts = layouts
        self._slab_ptr = slab.data_ptr()
        self._slot_bytes = slab.shape[1]
        self._plane_ptrs = plane_pointers(layouts)
        self._on_done = on_done
        self._copier = MemmoveCopier(num_threads)
        self._queue = TaskQueue()
        self._cond = threading.Condition()
        # taken from the queue, not reported; oldest first
        self._in_flight: deque[_Running] = deque()
        self._stopping = False
        # tasks failed because a cancel of another job cut their batch short
        self.num_cut_tasks = 0
        self._thread = threading.Thread(target=self._loop, name="kvtier-transfer", daemon=True)
        self._thread.start()

    def submit(self, task: CopyTask) -> bool:
        """Queue `task`; False once shut down (the caller reports it failed)."""
        with self._cond:
            if self._stopping:
                return False
            self._queue.push(task)
            self._cond.notify()
        return True

    def poll(self) -> None:
        """Nothing to do: the planning thread reports through `on_done`."""

    def cancel(self, job_ids: Container[int]) -> list[CopyTask]:
        """Take the queued tasks of `job_ids` out of the queue and return them (never started);
        cut short the batches in flight that hold any of their tasks (reported failed, whole).

        Never blocks on a copy: the caller waits for the cut batches' reports.
        """
        with self._cond:
            for running in self._in_flight:
                hit = {task.job_id for task in running.batch if task.job_id in job_ids}
                if hit:
                    running.cancelled_job_ids |= hit
                    # else `_start` cancels it once started
                    if running.handle is not None:
                        running.handle.cancel()
            return self._queue.drain(job_ids)

    def shutdown(self) -> list[CopyTask]:
        """Let started tasks finish, stop the threads, and return the tasks never started."""
        with self._cond:
            self._stopping = True
            never_run = self._queue.drain()
            self._cond.notify_all()
        self._thread.join()
        self._copier.close()
        return never_run

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._in_flight and not self._stopping and not self._queue:
                    self._cond.wait()
                running = self._pop_batch()
            # only this thread adds to or removes from `_in_flight`: its length is read unlocked
            if running is None and not self._in_flight:
                # stopping, and nothing queued or in flight
                return
            if running is not None:
                self._start(running)
            if self._in_flight and (running is None or len(self._in_flight) >= _MAX_IN_FLIGHT):
                self._finish(self._in_flight[0])

    def _pop_batch(self) -> _Running | None:
        """The next batch that may run beside those in flight, now in flight too; None when none
        may (lock held: a task is always either queued or in flight, where `cancel` finds it)."""
        if len(self._in_flight) >= _MAX_IN_FLIGHT or not self._queue:
            return None
        busy = [task for running in self._in_flight for task in running.batch]
        batch = self._queue.pop_batch(_BATCH_MAX_TASKS, _BATCH_MAX_BYTES, running=busy)
        if not batch:
            return None
        self._in_flight.append(_Running(batch))
        return self._in_flight[-1]

    def _start(self, running: _Running) -> None:
        """Plan and start a batch; a planning error fails the batch, never the thread."""
        try:
            running.started_at = time.perf_counter()
            pointers = copy_pointers(
                running.batch, self._layouts, self._plane_ptrs, self._slab_ptr, self._slot_bytes
            )
            handle = self._copier.start(*pointers)
        except Exception as e:
            with self._cond:
                self._in_flight.remove(running)
            self._on_done(
                [
                    (task, task.outcome(0, 0.0, error=f"copy failed: {e!r}"))
                    for task in running.batch
                ]
            )
            return
        with self._cond:
            running.handle = handle
            # cancelled while being planned
            if running.cancelled_job_ids:
                handle.cancel()

    def _finish(self, running: _Running) -> None:
        """Wait for a batch and report each task, charged its share of the time by bytes."""
        # set by `_start`, which ran first
        handle: CopyHandle = running.handle  # type: ignore[assignment]
        error = None
        try:
            is_complete = handle.wait()
        except Exception as e:
            error = f"copy failed: {e!r}"
            is_complete = False
        with self._cond:
            self._in_flight.popleft()
            cancelled = set(running.cancelled_job_ids)
        if error is not None:
            self._on_done([(task, task.outcome(0, 0.0, error=error)) for task in running.batch])
        elif not is_complete:
            self._report_cut(running.batch, cancelled)
        else:
            seconds = handle.finished_at - running.started_at
            total = sum(task.num_bytes for task in running.batch) or 1
            self._on_done(
                [(t, t.outcome(t.num_bytes, seconds * t.num_bytes / total)) for t in running.batch]
            )

    def _report_cut(self, batch: list[CopyTask], cancelled: set[int]) -> None:
        """A batch a cancel cut short: every task failed, whichever of its bytes were copied."""
        cut = f"copy cut short: job(s) {sorted(cancelled)} of its batch were cancelled"
        self.num_cut_tasks += sum(task.job_id not in cancelled for task in batch)
        self._on_done(
            [
                (task, task.outcome(0, 0.0, error=CANCELLED if task.job_id in cancelled else cut))
                for task in batch
            ]
        )
