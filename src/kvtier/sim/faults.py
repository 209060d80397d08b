"""A `TransferEngine` paced by the simulation's steps, with injectable faults.

The simulator runs the real worker (`WorkerSide` + `TransferEngine` on small CPU tensors).
Real copies finish whenever their threads get to them; to make runs repeatable, this
subclass holds each store job back and starts it at the end of a chosen step, then
waits for it (`end_step`), as if the device took that long. Nothing about *how* bytes
move changes: held jobs go through the real engine, queue and copier once started.

Faults (`Faults`, mutable while a simulation runs):
- `store_delay_steps`: a store starts `n` steps after the one it was submitted in — so a
  store that is not flushed before its blocks are rewritten copies the new owner's KV,
  which the fake engine's content checks catch. A flush (`wait`) starts it at once.
- `stuck_stores`: stores never start; a flush waits for them in vain (its timeout, i.e.
  the job's deadline, passes at once in simulated time) and the worker cancels them.
- `fail_load(job)`: loads for which it returns True copy nothing and fail every chunk.
- `load_delay_steps`: a load starts `n` steps late (a slow tier or device); an asynchronous
  one keeps its request parked that long, a synchronous one starts when the step awaits it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.jobs import TransferJob
from kvtier.worker.transfer import TransferEngine

__all__ = ["Faults", "SimTransferEngine"]


def _never(job: TransferJob) -> bool:
    return False


@dataclass
class Faults:
    store_delay_steps: int = 0
    # a load starts this many steps late (a synchronous one: when awaited)
    load_delay_steps: int = 0
    stuck_stores: bool = False
    fail_load: Callable[[TransferJob], bool] = _never


@dataclass
class _Held:
    job: TransferJob
    # math.inf: stuck
    due_step: float
    # a load copied layer by layer
    slices: Sequence[frozenset[str]] | None = None


class SimTransferEngine(TransferEngine):
    """`TransferEngine` whose stores start at simulated step boundaries (see the module docstring)."""

    def __init__(self, *args: Any, faults: Faults, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.faults = faults
        self.step = 0
        # every load submitted, for tests
        self.loads: list[TransferJob] = []
        self._held: dict[int, _Held] = {}

    @property
    def held_store_ids(self) -> set[int]:
        return set(self._held)

    def submit(self, job: TransferJob, slices: Sequence[frozenset[str]] | None = None) -> None:
        if job.is_load:
            self.loads.append(job)
            if self.faults.fail_load(job):
                self._report(job.failed("injected load failure"))
                return
            if self.faults.load_delay_steps:
                self._held[job.job_id] = _Held(
                    job, self.step + self.faults.load_delay_steps, slices
                )
                return
        if job.is_store:
            due = self.step + self.faults.store_delay_steps
            if self.faults.stuck_stores:
                due = math.inf
            self._held[job.job_id] = _Held(job, due)
            return
        super().submit(job, slices)

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        wanted = set(job_ids)
        stuck = {i for i in wanted & self._held.keys() if self._held[i].due_step == math.inf}
        self._release(wanted & self._held.keys() - stuck)
        return super().wait(wanted - stuck, timeout) and not stuck

    def wait_layer(self, job_ids: Iterable[int], layer: str, timeout: float | None = None) -> bool:
        # a load held back starts when a layer of it is awaited (never stuck)
        wanted = set(job_ids)
        self._release(wanted & self._held.keys())
        return super().wait_layer(wanted, layer, timeout)

    def cancel(self, job_ids: Iterable[int], timeout: float = 5.0) -> bool:
        wanted = set(job_ids)
        held = wanted & self._held.keys()
        for job_id in held:
            self._report(self._held.pop(job_id).job.failed("cancelled"))
        return super().cancel(wanted - held, timeout)

    def end_step(self) -> None:
        """Start the stores due by now, wait for every started job, then move to the next step."""
        self._release({i for i, held in self._held.items() if held.due_step <= self.step})
        super().wait(list(self._open))
        self.step += 1

    def _release(self, job_ids: set[int]) -> None:
        for job_id in sorted(job_ids):
            held = self._held.pop(job_id)
            super().submit(held.job, held.slices)
