"""The CUDA path: pinned host slab, one stream per direction, events per task.

UNVERIFIED: written for a GPU and never run on one yet (the development machines have
none); the CPU-only test suite covers the shared planning and validation code only.
Importing this module needs no GPU: CUDA is touched only when a backend is built.

How ordering is kept without a task thread:
- every task first waits for the engine's current (compute) stream: a store reads KV the
  forward pass wrote, a load overwrites blocks the compute stream may still read or zero;
- each direction has its own stream, so tasks of one direction run first-in first-out;
- a task whose slots or blocks conflict with an unfinished task of the other direction
  (see `CopyTask.conflicts_with`) waits for that task's end event.
Copies are per byte run (`plan_copies`), `non_blocking` between the pinned slab and
device memory; completion is seen by polling end events, never by blocking the caller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Container, Sequence
from dataclasses import dataclass

import torch

from kvtier.worker.layouts import GroupLayout
from kvtier.worker.tasks import CopyTask, DoneCallback, plan_copies

__all__ = ["CudaBackend", "cuda_usable"]


def cuda_usable(device: torch.device) -> bool:
    """True when `device` is a CUDA device this process can drive."""
    return device.type == "cuda" and torch.cuda.is_available()


@dataclass(slots=True)
class _InFlight:
    task: CopyTask
    start: torch.cuda.Event
    end: torch.cuda.Event
    num_bytes: int


class CudaBackend:
    """Enqueues each task's copies on a dedicated stream at submit time (unverified on GPU).

    Thread-safety: call `submit`, `poll` and `shutdown` from one thread (the engine's worker
    thread, whose current stream is the compute stream).
    """

    def __init__(
        self,
        layouts: Sequence[GroupLayout],
        slab: torch.Tensor,
        on_done: DoneCallback,
        device: torch.device,
    ) -> None:
        self._layouts = layouts
        self._slab_bytes = slab.view(-1)
        self._slot_bytes = slab.shape[1]
        self._on_done = on_done
        self._device = device
        self._store_stream = torch.cuda.Stream(device=device)
        self._load_stream = torch.cuda.Stream(device=device)
        self._in_flight: list[_InFlight] = []
        self._closed = False
        # a CUDA copy is never cut short (see `cancel`)
        self.num_cut_tasks = 0

    def submit(self, task: CopyTask) -> bool:
        """Enqueue `task`'s copies; False once shut down. Raises on a CUDA error (the task fails)."""
        if self._closed:
            return False
        layout = self._layouts[task.group]
        runs = plan_copies(
            task.block_ids, task.slot_ids, layout, self._slot_bytes, task.first_pages()
        )
        planes = layout.planes
        stream = self._store_stream if task.is_store else self._load_stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            # see the module docstring
            stream.wait_stream(torch.cuda.current_stream(self._device))
            for other in self._in_flight:
                if other.task.conflicts_with(task):
                    stream.wait_event(other.end)
            start.record(stream)
            columns = [runs.plane, runs.engine_offset, runs.slab_offset, runs.nbytes]
            for p, engine_at, slab_at, n in zip(*(c.tolist() for c in columns), strict=True):
                engine = planes[p].storage[engine_at : engine_at + n]
                slab = self._slab_bytes[slab_at : slab_at + n]
                dst, src = (slab, engine) if task.is_store else (engine, slab)
                dst.copy_(src, non_blocking=True)
            end.record(stream)
        self._in_flight.append(_InFlight(task, start, end, int(runs.nbytes.sum())))
        return True

    def poll(self) -> None:
        """Report every task whose end event has completed."""
        still = []
        done = []
        for flight in self._in_flight:
            try:
                if not flight.end.query():
                    still.append(flight)
                    continue
                # elapsed_time is in ms
                seconds = flight.start.elapsed_time(flight.end) / 1000.0
                done.append((flight.task, flight.task.outcome(flight.num_bytes, seconds)))
            # a sticky CUDA error: the task failed, the engine goes on
            except Exception as e:
                done.append(
                    (flight.task, flight.task.outcome(0, 0.0, error=f"CUDA copy failed: {e!r}"))
                )
        self._in_flight = still
        if done:
            self._on_done(done)

    def cancel(self, job_ids: Container[int]) -> list[CopyTask]:
        """Nothing waits in a queue here (tasks go to their stream at submit): returns [].

        A copy enqueued on a stream cannot be interrupted, nor taken back once enqueued:
        `TransferEngine.cancel` waits (polling end events) until the stream has run it, i.e.
        until everything enqueued on that stream before it ran too, and fails its chunks.
        Only then may the forward pass rewrite its blocks or the scheduler free its slots.
        Unverified on a GPU, like the rest of this module.
        """
        return []

    def shutdown(self) -> list[CopyTask]:
        """Wait for in-flight tasks (reporting them) and refuse new ones; nothing is left unstarted."""
        self._closed = True
        for flight in self._in_flight:
            # poll() below reports it as a failed task
            with contextlib.suppress(Exception):
                flight.end.synchronize()
        self.poll()
        # only after a CUDA error that query() did not raise
        if self._in_flight:
            error = "did not complete before shutdown"
            self._on_done(
                [
                    (flight.task, flight.task.outcome(0, 0.0, error=error))
                    for flight in self._in_flight
                ]
            )
        self._in_flight = []
        return []
