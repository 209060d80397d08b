"""The CPU path: a planning thread that plans batches while copy threads move earlier ones.

The planning thread takes a batch of queued tasks (`TaskQueue.pop_batch`), turns it into byte
runs with numpy, and hands the runs to `MemmoveCopier`; while they copy, it plans the next
batches (up to `_MAX_IN_FLIGHT` started), none conflicting with one in flight. Planning per
task and waking threads per task cost as much as copying 1 MiB here; batches and the overlap
hide both.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.worker.layouts import GroupLayout
from kvtier.worker.memmove import CopyHandle, MemmoveCopier
from kvtier.worker.queue import TaskQueue
from kvtier.worker.tasks import CopyTask, DoneCallback, plan_copies

__all__ = ["CpuBackend"]

# A batch amortizes planning and thread hand-offs; its cap bounds how long a load that
# arrives meanwhile waits behind it (32 MiB is ~2-3 ms here).
_BATCH_MAX_TASKS = 64
_BATCH_MAX_BYTES = 32 << 20
# Batches started and not yet reported. More than two keeps the copy threads busy while the task
# thread waits for the GIL beside a busy Python thread (~5 ms, the switch interval; measured
# with `bench_transfer.py --gil`); each one more lets a load wait behind one more batch.
_MAX_IN_FLIGHT = 3


@dataclass(slots=True)
class _Running:
    batch: list[CopyTask]
    handle: CopyHandle
    started_at: float


class CpuBackend:
    """Runs tasks on background threads, in `TaskQueue` order, batched, with `MemmoveCopier`.

    Thread-safety: `submit` and `shutdown` may be called from any thread; `on_done` is called
    from the planning thread, outside this backend's lock.
    """

    def __init__(
        self,
        layouts: Sequence[GroupLayout],
        slab: torch.Tensor,
        on_done: DoneCallback,
        num_threads: int = 2,
    ) -> None:
        self._layouts = layouts
        self._slab_ptr, self._slot_bytes = slab.data_ptr(), slab.shape[1]
        self._plane_ptrs = [np.array([p.storage.data_ptr() for p in g.planes], dtype=np.int64) for g in layouts]
        self._on_done = on_done
        self._copier = MemmoveCopier(num_threads)
        self._queue = TaskQueue()
        self._cond = threading.Condition()
        self._stopping = False
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
        """Take the queued tasks of `job_ids` out of the queue and return them (never started).

        Tasks already copying are not interrupted: they end with their batch.
        """
        with self._cond:
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
        in_flight: deque[_Running] = deque()
        while True:
            with self._cond:
                while not in_flight and not self._stopping and not self._queue:
                    self._cond.wait()
                batch = self._pop_batch(in_flight)
            if not in_flight and not batch:
                return  # stopping, and nothing queued or in flight
            started = self._start(batch) if batch else None
            if started is not None:
                in_flight.append(started)
            if in_flight and (not batch or len(in_flight) >= _MAX_IN_FLIGHT):
                self._finish(in_flight.popleft())

    def _pop_batch(self, in_flight: deque[_Running]) -> list[CopyTask]:
        """The next batch that may run beside those in flight; empty when none may (lock held)."""
        if len(in_flight) >= _MAX_IN_FLIGHT or not self._queue:
            return []
        busy = [task for running in in_flight for task in running.batch]
        return self._queue.pop_batch(_BATCH_MAX_TASKS, _BATCH_MAX_BYTES, running=busy)

    def _start(self, batch: list[CopyTask]) -> _Running | None:
        """Plan and start a batch; a planning error fails the batch, never the thread."""
        try:
            started_at = time.perf_counter()
            return _Running(batch, self._copier.start(*self._addresses(batch)), started_at)
        except Exception as e:
            self._on_done([(task, task.outcome(0, 0.0, error=f"copy failed: {e!r}")) for task in batch])
            return None

    def _finish(self, running: _Running) -> None:
        """Wait for a batch and report each task, charged its share of the time by bytes."""
        try:
            running.handle.wait()
        except Exception as e:
            self._on_done([(task, task.outcome(0, 0.0, error=f"copy failed: {e!r}")) for task in running.batch])
            return
        seconds = running.handle.finished_at - running.started_at
        total = sum(task.num_bytes for task in running.batch) or 1
        self._on_done([(t, t.outcome(t.num_bytes, seconds * t.num_bytes / total)) for t in running.batch])

    def _addresses(self, batch: list[CopyTask]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dst, src, nbytes) of every run of the batch, planned once per direction and group."""
        parts = []
        for is_store, group in {(task.is_store, task.group) for task in batch}:
            tasks = [task for task in batch if task.is_store == is_store and task.group == group]
            block_ids = np.concatenate([task.block_ids for task in tasks])
            slot_ids = np.concatenate([task.slot_ids for task in tasks])
            first_pages = np.concatenate([task.first_pages() for task in tasks])
            runs = plan_copies(block_ids, slot_ids, self._layouts[group], self._slot_bytes, first_pages)
            engine = self._plane_ptrs[group][runs.plane] + runs.engine_offset
            slab = self._slab_ptr + runs.slab_offset
            parts.append((slab, engine, runs.nbytes) if is_store else (engine, slab, runs.nbytes))
        if len(parts) == 1:
            return parts[0]
        return tuple(np.concatenate(column) for column in zip(*parts, strict=True))  # type: ignore[return-value]
