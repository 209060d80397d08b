"""`WorkerSide`: the worker half of kvtier for one engine worker (one parallel rank).

It runs each step's `StepPlan` on a `TransferEngine`, in the engine's order, and makes no
policy decision. Per engine step:

1. `handle_preemptions(plan)`: before the forward pass. Jobs past their deadline are
   cancelled; the plan's flushed jobs end here — a store of this very plan that is flushed
   (it reads blocks the step hands to a new owner) is started here first, so it copies the
   old owner's KV before the new owner's forward pass overwrites it.
2. `start_load_kv(plan)`: the loads run and end before the forward pass reads their blocks;
   the asynchronous loads start and run in the background (their requests are parked).
3. (the engine's forward pass; before each layer's attention, `wait_for_layer_load(layer)`)
4. `wait_for_save(plan)`: the plan's other stores start; they run in the background.
5. `take_finished_loads()`: requests whose asynchronous load ended (and those of them that
   failed); `take_results()`, `take_load_errors()`, `take_stats()`: what goes back to the
   scheduler.

Once a pass was seen asking for every layer, step 2's loads are copied layer by layer
(`kvtier.worker.layered`), each `wait_for_layer_load` waiting for its own layer only; the
pass's end (`finish_layered_loads`: in `wait_for_save`, or before any result is taken) ends them.

A failed load's blocks are reported as load errors (the engine recomputes from the first
one), except for an asynchronous load of a model with several KV-cache groups: block ids
repeat across groups there, so the whole request is reported failed instead (vLLM refuses
block-level errors for such models).

Deadlines: a job is abandoned at `job.deadline`. Waiting for it (a load, a flush) stops
there and the job is cancelled: a part that has not started never starts, a copy already
running is cut short, every chunk fails, and `TransferEngine.cancel` returns only once no copy
of the job runs any more — so nothing here proceeds (to the forward pass, to reporting) while
a late copy could still write blocks the engine recomputes or read blocks a new owner writes
(issue #20). Jobs running in the background are checked at each step. The scheduler fails a
job itself only later (see `kvtier.scheduler.jobs`), after every worker had the chance to
report it.

Thread-safety: one engine thread calls it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvtier.errors import ConfigError
from kvtier.jobs import JobResult, StepPlan, TransferJob
from kvtier.slab import HostSlab
from kvtier.worker.affinity import copy_threads_off_compute_cores
from kvtier.worker.layered import ForwardOrder
from kvtier.worker.layouts import build_group_layouts, slot_bytes_of
from kvtier.worker.transfer import TransferEngine

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)

# how long a step with nothing to compute waits for its asynchronous loads
IDLE_STEP_WAIT_S = 0.05


class WorkerSide:
    """Runs the scheduler's plans against this worker's KV tensors and host slab.

    Args:
        num_slots: slots of the host slab (must equal the scheduler's; reported in results).
        blocks_per_chunk: engine blocks per chunk.
        layer_groups: the layers of each KV-cache group (None: every layer in group 0).
        clock: monotonic seconds, the clock job deadlines are written in.
        transfer_factory: builds the `TransferEngine` (the simulator injects faults here).
        slab_name: this rank's shared-memory slab (`kvtier.slab`), mapped when the KV
            caches are registered (their layout gives the slot size); None: a private slab.
    """

    def __init__(
        self,
        *,
        num_slots: int,
        blocks_per_chunk: int,
        layer_groups: Sequence[Sequence[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        transfer_factory: Callable[..., TransferEngine] = TransferEngine,
        slab_name: str | None = None,
    ):
        if num_slots < 1:
            raise ConfigError(
                f"the host slab needs at least one slot, got {num_slots}; raise cpu_bytes"
            )
        self.num_slots = num_slots
        self.blocks_per_chunk = blocks_per_chunk
        self.layer_groups = layer_groups
        self.slab_name = slab_name
        self.slab: HostSlab | None = None
        self.transfer: TransferEngine | None = None
        self._clock = clock
        self._transfer_factory = transfer_factory
        # submitted, result not taken yet
        self._running: dict[int, TransferJob] = {}
        # this plan's flushed stores, started before the forward
        self._started_early: set[int] = set()
        self._results: list[JobResult] = []
        self._load_errors: set[int] = set()
        self._async_load_ids: set[int] = set()
        # requests whose asynchronous load ended
        self._finished_loads: set[str] = set()
        # ... and failed (reported whole)
        self._failed_loads: set[str] = set()
        self._stats: Counter[str] = Counter()
        # the forward pass's layers (where the transfer engine can slice loads by layers)
        self._order: ForwardOrder | None = None
        # this step's loads, copied layer by layer
        self._layered: list[TransferJob] = []
        # ... whose pass did not ask for every layer: they fail
        self._unasked: set[int] = set()
        # cancelled, result not taken yet (a later layer's wait must not cancel again)
        self._cut: set[int] = set()

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Map this rank's slab (creating it if the scheduler side has not yet) and start copying.

        Raises:
            ConfigError: the slab exists with another size than these KV caches need, or does not fit.
        """
        if self.slab_name is not None:
            slot_bytes = slot_bytes_of(
                build_group_layouts(kv_caches, self.blocks_per_chunk, self.layer_groups)
            )
            # owner: the worker unlinks the name too when it shuts down, in case the scheduler side
            # never came up to do it (an engine that failed to start); a second unlink is harmless
            self.slab = HostSlab(self.slab_name, self.num_slots, slot_bytes, owner=True)
        try:
            # its copy threads start here
            with copy_threads_off_compute_cores() as cores:
                self.transfer = self._transfer_factory(
                    kv_caches,
                    self.blocks_per_chunk,
                    self.num_slots,
                    layer_groups=self.layer_groups,
                    slab=self.slab,
                )
        except BaseException:
            self._close_slab()
            raise
        # once per worker: summed over workers it counts the pinned slabs (pinned=1; 0: pageable)
        if self.slab is not None and self.slab.is_pinned:
            self._stats["pinned_slabs"] += 1
        self._order = ForwardOrder(list(kv_caches)) if self.transfer.can_slice else None
        where = f"shared memory {self.slab.path}" if self.slab is not None else "private memory"
        logger.info(
            "kvtier: host slab of %d slots x %d bytes in %s; copy threads on %s",
            self.num_slots,
            self.transfer.slot_bytes,
            where,
            sorted(cores) if cores else "the engine's cores",
        )

    # -- the step ---------------------------------------------------------------------

    def handle_preemptions(self, plan: StepPlan) -> None:
        """Before the forward pass: report failed loads, cancel expired jobs, end flushed jobs."""
        self._load_errors |= plan.failed_load_block_ids
        self._cancel_expired()
        for job in plan.stores_to_flush():
            self._submit(job)
            self._started_early.add(job.job_id)
        self._await([self._running[i] for i in plan.flush_job_ids if i in self._running])

    def start_load_kv(self, plan: StepPlan, layer_waits: bool = True) -> None:
        """Run the plan's loads and wait for them (until their deadline); start its asynchronous
        ones (and, in a step where the engine computes nothing, wait for them a little too).
        `layer_waits` False: this pass will not call `wait_for_layer_load` (vLLM replays it as one
        FULL CUDA graph), so its loads are waited for whole, never sliced."""
        for job in plan.async_load_jobs:
            self._async_load_ids.add(job.job_id)
            self._submit(job)
        slices = self._order.slices if self._order is not None and layer_waits else None
        for job in plan.load_jobs:
            self._submit(job, slices)
        loads = [self._running[job.job_id] for job in plan.load_jobs if job.job_id in self._running]
        # each layer awaited by `wait_for_layer_load`, all by `finish_layered_loads`
        if slices and loads:
            self._layered = loads
            return
        self._await(loads)
        if plan.engine_idle and plan.async_load_jobs and self.transfer is not None:
            # nothing else runs in this step: reporting the loads now saves the engine empty
            # round trips (each ~1-3 ms on vLLM); a load that is slower is reported later
            self.transfer.wait(
                [job.job_id for job in plan.async_load_jobs], timeout=IDLE_STEP_WAIT_S
            )
        self._collect()

    def wait_for_layer_load(self, layer: str) -> None:
        """Before `layer`'s attention: wait (until their deadline) for this step's loads of it."""
        if self._order is None:
            return
        self._order.saw(layer)
        transfer = self.transfer
        if not self._layered or transfer is None:
            return

        def wait_for_layer(job_ids: list[int], timeout: float) -> bool:
            return transfer.wait_layer(job_ids, layer, timeout)

        self._await(self._layered, wait_for_layer)

    def finish_layered_loads(self) -> None:
        """After the forward pass: end this step's layered loads; if the pass did not ask for
        every layer, fail them whole (a layer may have been read before its copy) and load whole
        from now on. Their results are collected here, never before."""
        if self._order is None:
            return
        # the pass ends here whether or not it had layered loads
        asked_all = self._order.step_ended()
        if not self._layered:
            return
        self._await(self._layered)
        if not asked_all:
            self._unasked |= {job.job_id for job in self._layered}
            self._order.turn_off(
                "a forward pass with layer-by-layer loads did not ask for every layer"
            )
        self._layered = []
        self._collect()

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """(requests whose asynchronous load ended since the last call, those of them that failed
        whole); a load past its deadline is cancelled first, so a parked request is always released."""
        self._cancel_expired()
        self._collect()
        finished, self._finished_loads = self._finished_loads, set()
        failed, self._failed_loads = self._failed_loads, set()
        return finished, failed

    def wait_for_save(self, plan: StepPlan) -> None:
        """After the forward pass: end its layered loads, start the plan's stores (in the background)."""
        self.finish_layered_loads()
        for job in plan.store_jobs:
            if job.job_id not in self._started_early:
                self._submit(job)
        self._started_early.clear()

    def take_results(self) -> list[JobResult]:
        """Every job that ended since the last call, each once (expired ones cancelled first)."""
        self._cancel_expired()
        self._collect()
        results, self._results = self._results, []
        return results

    def take_load_errors(self) -> set[int]:
        """Engine blocks whose load failed since the last call: the engine recomputes them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> dict[str, float]:
        """Bytes and seconds per direction, cancelled jobs, and tasks of other jobs failed with
        them (`cancel_cut_tasks`: batched with a cancelled job's copy, which was cut short), since
        the last call; `pinned_slabs` 1 once, after a CUDA worker page-locked its slab."""
        if not self._stats:
            return {}
        stats, self._stats = dict(self._stats), Counter()
        return stats

    def shutdown(self) -> None:
        """Stop the copies, then unmap the slab (idempotent)."""
        if self.transfer is not None:
            self.transfer.shutdown()
        self._close_slab()

    # -- helpers ----------------------------------------------------------------------

    def _close_slab(self) -> None:
        if self.slab is not None:
            # the transfer engine's view keeps the mapping until it is gone
            self.slab.close()

    def _submit(self, job: TransferJob, slices: list[frozenset[str]] | None = None) -> None:
        self._running[job.job_id] = job
        # no KV caches registered: nothing can move, the job fails
        if self.transfer is None:
            self._end(job, job.failed("no KV caches registered"))
        else:
            self.transfer.submit(job, slices)

    def _await(
        self, jobs: Iterable[TransferJob], wait: Callable[[list[int], float], bool] | None = None
    ) -> None:
        """Wait for `jobs` (`wait(ids, timeout)`: all of them, by default), each until its deadline;
        cancel those still running at it."""
        left = list(jobs)
        while left and self.transfer is not None:
            wait_for = wait if wait is not None else self.transfer.wait
            now = self._clock()
            first = min(job.deadline for job in left)
            is_done = wait_for([job.job_id for job in left], max(0.0, first - now))
            if is_done:
                return
            # the wait ran to `first`: every job due by then is abandoned
            due = [job for job in left if job.deadline <= first]
            self._cancel(due)
            left = [job for job in left if job.deadline > first]

    def _cancel_expired(self) -> None:
        # the usual step: nothing in flight, nothing to check (called 3x a step)
        if not self._running:
            return
        now = self._clock()
        due = [job for job in self._running.values() if job.deadline <= now]
        if due:
            # those that did end in time are reported as they ended
            self._collect()
            self._cancel([job for job in due if job.job_id in self._running])

    def _cancel(self, jobs: list[TransferJob]) -> None:
        if self.transfer is None:
            return
        # a job cancelled in an earlier wait is not cancelled (nor counted) again
        to_cancel = [job for job in jobs if job.job_id not in self._cut]
        if not to_cancel:
            return
        self._cut |= {job.job_id for job in to_cancel}
        logger.warning(
            "kvtier: %d transfer job(s) past their deadline; cancelled (loads are recomputed, "
            "stores dropped)",
            len(to_cancel),
        )
        self._stats["cancelled_jobs"] += len(to_cancel)
        num_cut = self.transfer.num_cut_tasks
        # returns only once none of them copies any more: the caller may then reuse their blocks
        self.transfer.cancel([job.job_id for job in to_cancel])
        if self.transfer.num_cut_tasks > num_cut:
            self._stats["cancel_cut_tasks"] += self.transfer.num_cut_tasks - num_cut

    def _collect(self) -> None:
        # vLLM may take results before wait_for_save (speculative decoding): end the pass's loads
        if self._layered:
            # first, or a layered load whose pass skipped a layer would count as loaded
            self.finish_layered_loads()
        # a result of no running job would be dropped anyway
        if self.transfer is None or not self._running:
            return
        for result in self.transfer.get_finished():
            job = self._running.get(result.job_id)
            if job is not None:
                self._end(job, result)

    def _end(self, job: TransferJob, result: JobResult) -> None:
        del self._running[job.job_id]
        self._cut.discard(job.job_id)
        # copied, but maybe after the forward pass read it
        if job.job_id in self._unasked:
            self._unasked.remove(job.job_id)
            result = dataclasses.replace(
                result,
                failed_chunks=tuple(range(job.num_chunks)),
                num_bytes=0,
                error="loaded by layer, but the forward pass did not ask for every layer",
            )
        direction = "load" if job.is_load else "store"
        self._stats[f"{direction}_bytes"] += result.num_bytes
        self._stats[f"{direction}_seconds"] += result.seconds
        is_async = job.job_id in self._async_load_ids
        if is_async:
            self._async_load_ids.discard(job.job_id)
            self._finished_loads.add(job.req_id)
        if job.is_load and result.failed_chunks:
            if is_async and len(self.layer_groups or ()) > 1:
                self._failed_loads.add(job.req_id)
            else:
                self._load_errors |= job.written_blocks(set(result.failed_chunks))
        if result.error:
            logger.debug("kvtier: job %d: %s", job.job_id, result.error)
        self._results.append(result)
