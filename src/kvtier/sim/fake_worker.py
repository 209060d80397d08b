"""A worker that moves symbolic block contents instead of tensors.

Each engine block holds a *content* token (what the forward pass computed for it);
a slot holds the contents of one chunk. Loads copy slot -> blocks before the forward
pass, stores copy blocks -> slot after it — reading the blocks when the store
*completes*, like a real asynchronous copy. A store that is delayed while its blocks
get a new owner therefore copies the wrong content, and the engine's checks catch it:
that is how the tests prove the scheduler's fences.

Faults for tests: `fail_load(job)` predicates, stores delayed by N steps, or stuck
forever (`stuck_stores=True`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.scheduler.types import JobReport, StepPlan, TransferJob

__all__ = ["FakeWorker"]


@dataclass
class FakeWorker:
    """Executes `StepPlan`s against `blocks[block_id]` contents (one pool for every group)."""

    blocks: list[Any]
    store_delay_steps: int = 0
    stuck_stores: bool = False
    fail_load: Callable[[TransferJob], bool] = lambda job: False
    slots: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    pending_stores: dict[int, tuple[TransferJob, int]] = field(default_factory=dict)  # job id -> (job, due step)
    step_index: int = 0
    executed_loads: list[TransferJob] = field(default_factory=list)

    def before_forward(self, plan: StepPlan) -> list[JobReport]:
        """Flush, then run this step's loads; returns their reports."""
        reports = [self._finish_store(j) for j in sorted(plan.flush_job_ids) if j in self.pending_stores]
        for job in plan.load_jobs:
            reports.append(self._load(job))
        return reports

    def after_forward(self, plan: StepPlan) -> list[JobReport]:
        """Queue this step's stores; returns reports of stores that are due."""
        self.step_index += 1
        for job in plan.store_jobs:
            self.pending_stores[job.job_id] = (job, self.step_index + self.store_delay_steps)
        if self.stuck_stores:
            return []
        due = [j for j, (_, at) in self.pending_stores.items() if at <= self.step_index]
        return [self._finish_store(j) for j in due]

    def _load(self, job: TransferJob) -> JobReport:
        self.executed_loads.append(job)
        if self.fail_load(job):
            return JobReport(job.job_id, success=False)
        for part in job.parts:
            for i, slot in enumerate(part.slot_ids.tolist()):
                for page, block in part.chunk_pages(i):
                    self.blocks[block] = self.slots[slot][page]
        return JobReport(job.job_id, success=True)

    def _finish_store(self, job_id: int) -> JobReport:
        job, _ = self.pending_stores.pop(job_id)
        for part in job.parts:
            for i, slot in enumerate(part.slot_ids.tolist()):
                self.slots[slot] = tuple(self.blocks[block] for _, block in part.chunk_pages(i))
        return JobReport(job.job_id, success=True)
