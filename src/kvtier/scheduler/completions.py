"""How the scheduler's jobs end: the workers' results (a job completes once every worker
reported it), jobs not every worker reported in time (failed, and released one step later),
and a request forgotten once it has ended and has no job left.

`JobCompletion` is a collaborator of `kvtier.scheduler.core.OffloadScheduler`: it shares the
scheduler's requests and job book (passed to it), holds the jobs expired in this step until the
workers' next output, and asks the store planner (`kvtier.scheduler.stores`) for a finished
request's last stores once its load ended. Thread-safety: the scheduler's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kvtier.base import OffloadingManager
from kvtier.jobs import JobResult, StepPlan
from kvtier.scheduler.jobs import TransferJobBook
from kvtier.scheduler.load_cost import LoadCosts
from kvtier.scheduler.requests import RequestTable
from kvtier.scheduler.state import JobRecord
from kvtier.scheduler.stats import SchedulerStats
from kvtier.scheduler.stores import StorePlanning

__all__ = ["JobCompletion"]

logger = logging.getLogger(__name__)


class JobCompletion:
    """How the scheduler's jobs end; see the module docstring.

    Args:
        manager: told of each job's end (`complete_load`, `complete_store`).
        stats: where completed, failed, expired and stale jobs are counted.
        costs: told of the workers' load results and of each load that ended.
        requests: the scheduler's requests; one is forgotten once its last job ended.
        jobs: the scheduler's job book.
        stores: plans a finished request's last stores once its load ended.
        clock: monotonic seconds (job expiry, load timing).
    """

    def __init__(
        self,
        manager: OffloadingManager,
        stats: SchedulerStats,
        costs: LoadCosts,
        requests: RequestTable,
        jobs: TransferJobBook,
        stores: StorePlanning,
        clock: Callable[[], float],
    ):
        self.manager = manager
        self.stats = stats
        self.costs = costs
        self._requests = requests
        self._jobs = jobs
        self._stores = stores
        self._clock = clock
        # failed at this step's expiry, completed at its output
        self._expired: list[JobRecord] = []

    def num_expired(self) -> int:
        """Jobs failed at this step's expiry and not released yet (they are still in flight)."""
        return len(self._expired)

    def update_connector_output(self, results: Iterable[JobResult]) -> None:
        """Record the workers' results; a job completes once every worker reported it.

        Failed loads need nothing here: each worker reports the blocks it could not load
        to the engine itself (`WorkerSide.take_load_errors`), which recomputes them.
        """
        results = list(results)
        self.costs.worker_results(
            ((r, r.job_id in self._jobs and not self._jobs[r.job_id].is_store) for r in results),
            self._clock(),
        )
        for record in self._jobs.acknowledge(results):
            self._complete(record)
        expired = self._expired
        self._expired = []
        # every worker has now run the step that cancels them: nothing copies
        for record in expired:
            self._complete(record)

    def expire_jobs(self, plan: StepPlan) -> None:
        """Fail jobs not every worker reported in time (see `kvtier.scheduler.jobs`).

        Failed now (loads recomputed from this step on), but what a job holds — the slots of a
        store, the pins of a load — is released only by `update_connector_output`: a worker that
        still copies it stops in this step's `handle_preemptions` (it cancels every job past its
        deadline and waits for its copies to stop), and not before; freeing a slot here would let
        a promotion write it while a late copy still does (issue 20, S1)."""
        for record in self._jobs.expire(self._clock()):
            self.stats.expired_jobs += 1
            logger.warning(
                "kvtier: job %d of request %s was not reported by every worker in time; failed",
                record.job.job_id,
                record.job.req_id,
            )
            state = self._requests[record.job.req_id]
            # an asynchronous load's request is parked until its workers report it (they fail
            # it themselves at its deadline); blocks reported here would reach nobody
            blocks: set[int] = set()
            if not (record.is_store or record.is_async):
                blocks = self._jobs.failed_load_blocks(record)
            if not state.is_finished and blocks <= state.held_block_ids():
                # the engine recomputes them
                plan.failed_load_block_ids |= blocks
            self._expired.append(record)

    def _complete(self, record: JobRecord) -> None:
        state = self._requests[record.job.req_id]
        state.transfer_jobs.discard(record.job.job_id)
        ok, failed = self._jobs.split_keys(record)
        stale = record.generation != self._jobs.generation
        self.stats.stale_completions += stale
        if record.is_store:
            # a stale one is freed
            self.manager.complete_store(ok, state.req_context, success=True)
            self.manager.complete_store(failed, state.req_context, success=False)
            self.stats.stored_chunks += 0 if stale else len(ok)
            self.stats.failed_store_chunks += len(failed)
        else:
            state.load_job_id = None
            self.costs.loaded(state, record.job.job_id)
            self.manager.complete_load(record.keys, state.req_context)
            self.stats.failed_load_chunks += len(failed)
            state.had_failed_load |= bool(failed)
            if state.is_finished and not failed:
                self._stores.store_final_chunks(state)
        self._requests.release_if_done(state)
