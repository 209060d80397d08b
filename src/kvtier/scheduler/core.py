"""`OffloadScheduler`: what to load and what to store, per request and per engine step.

Engine-agnostic: an adapter (vLLM's connector, the fake engine of the tests and the
simulator) calls it in the order of docs/architecture.md's scheduler protocol:

1. `get_num_new_matched_tokens(req, num_local)`   -> (tokens | None, load_async)
2. `update_state_after_alloc(req_id, block_ids, num_external_tokens)`
3. `build_connector_meta(step)`                    -> StepPlan for the workers
4. (workers run the plan: `kvtier.worker.WorkerSide`)
5. `request_finished(req)` for requests that ended in the step, then
   `update_connector_output(results)` with the workers' job results (vLLM's order), then
   (lazy store mode) `plan_evictions(blocks)` once the engine freed the ended requests' blocks
6. `reset_cache()` at any time

Waiting is bounded per request: a request that would wait for a pending write or a
probe is asked again at most `max_deferrals` times and for at most `max_defer_s`
seconds; then it proceeds with its confirmed hits and `deferral_timeouts` counts it.
An asynchronous load (`load_mode="async"`) parks its request too: its deadline is what is
left of that budget (at least `_MIN_ASYNC_LOAD_S`), so waiting for a probe and then for the
load never adds up to more than the request was allowed.
Jobs are bounded too: one that not every worker reported by its expiry is failed here
(see `kvtier.scheduler.jobs`) — loads are recomputed, stores rolled back.

When chunks are stored is `store_mode`: "eager" as soon as they are computed, "lazy" when the
engine is about to evict their blocks (`kvtier.scheduler.lazy`; the adapter reports them at
the end of each step, `plan_evictions`, and the stores run in the next step's plan, under
the same fences as a finished request's last stores).

`OffloadScheduler` is this module (lookups, loads, the step plan, request end, reset) and two
collaborators it builds and hands what they share (the requests, `kvtier.scheduler.requests`;
the job book and the next step's plan, `kvtier.scheduler.jobs`): `StorePlanning`
(`kvtier.scheduler.stores`: what to store, and when) and `JobCompletion`
(`kvtier.scheduler.completions`: how jobs end).

Thread-safety: not thread-safe; the engine's scheduler calls it from one thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvtier.base import OffloadingManager
from kvtier.costmodel.decision import CostSnapshot
from kvtier.errors import KVTierError
from kvtier.jobs import BlockIds, JobResult, StepPlan
from kvtier.scheduler.completions import JobCompletion
from kvtier.scheduler.config import SchedulerOffloadConfig
from kvtier.scheduler.handoff import Handoffs
from kvtier.scheduler.jobs import NextPlan, TransferJobBook
from kvtier.scheduler.lazy import EvictionLedger
from kvtier.scheduler.load_cost import LoadCosts
from kvtier.scheduler.lookup import count_query, may_defer, scan_hits
from kvtier.scheduler.requests import RequestTable
from kvtier.scheduler.state import LookupAnswer, PendingLoad, RequestOffloadState
from kvtier.scheduler.stats import SchedulerStats
from kvtier.scheduler.stores import EVICTIONS_REQ_ID, StoreObserver, StorePlanning
from kvtier.scheduler.types import RequestView, StepView

__all__ = ["EVICTIONS_REQ_ID", "OffloadScheduler", "StoreObserver"]

logger = logging.getLogger(__name__)

# a load started after the budget was spent on waits still gets this long
_MIN_ASYNC_LOAD_S = 0.25


class OffloadScheduler:
    """The scheduler side of kvtier for one engine.

    Args:
        config: groups and offload rules.
        manager: the offloading manager (a tier or a cascade of tiers).
        clock: monotonic seconds; injectable for tests.
        costs: fixed figures for the load-or-recompute decision (the simulator's cost model);
            None: measured online.
    """

    def __init__(
        self,
        config: SchedulerOffloadConfig,
        manager: OffloadingManager,
        clock: Callable[[], float] = time.monotonic,
        costs: CostSnapshot | None = None,
    ):
        self.config = config
        self.manager = manager
        self.stats = SchedulerStats()
        self.costs = LoadCosts(config, manager, self.stats, costs)
        self._clock = clock
        manager.use_clock(clock)
        self._requests = RequestTable(manager)
        self._jobs = TransferJobBook(config.num_workers, config.job_timeout_s)
        self._next = NextPlan()
        self._is_supported = config.is_supported
        # the ledger is built here, where benchmarks/fuzz_mutations.py swaps in a defective one
        self._stores = StorePlanning(
            config,
            manager,
            self.stats,
            requests=self._requests,
            jobs=self._jobs,
            ledger=EvictionLedger(),
            next_plan=self._next,
        )
        self._handoffs = Handoffs(config, manager, self.stats, clock)
        self._completions = JobCompletion(
            manager,
            self.stats,
            self.costs,
            requests=self._requests,
            jobs=self._jobs,
            stores=self._stores,
            clock=clock,
        )
        for g in config.unsupported_groups():
            logger.warning(
                "kvtier: KV-cache group %d cannot be offloaded (%s); this model gets no kvtier hits",
                g,
                config.groups[g].reason or "unsupported kind",
            )

    @property
    def store_observer(self) -> StoreObserver | None:
        """The adapter's: told of the chunks each request offers to the tiers (for its events);
        dropped after it fails once."""
        return self._stores.observer

    @store_observer.setter
    def store_observer(self, observer: StoreObserver | None) -> None:
        self._stores.observer = observer

    # -- 1. lookup --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, req: RequestView, num_local: int
    ) -> tuple[int | None, bool]:
        """Tokens kvtier can load after the engine's own `num_local` hits.

        Returns:
            (tokens, load_async); tokens is None for "ask again next step". load_async is
            True when tokens are offered and `load_mode` is "async": the engine parks the
            request until the workers report its load (else it ends before its first forward).
        """
        state = self._state_for(req)
        state.pending_load = None
        state.num_locally_computed_tokens = num_local
        if not (self._is_supported and state.params.load) or state.had_failed_load:
            # after a failed load the engine asks again (an asynchronous one restarts the request
            # from its last valid block): offering the same load again could fail forever
            return self._answer(state, num_local, 0)
        if state.load_job_id is not None:
            # its previous load is still in flight
            if may_defer(state, self.config, self._clock(), self.stats):
                return None, False
            return self._answer(state, num_local, 0)
        size = self.config.tokens_per_chunk
        start = num_local // size
        max_chunks = min(state.num_hashed_chunks(), (req.num_tokens - 1) // size)
        # a hand-off's chunks are loaded, whatever the cost model says: a decode engine is not
        # there to prefill (`kvtier.scheduler.handoff`)
        promised = self._handoffs.promised_chunks(state, max_chunks)
        if state.params.max_load_tokens is not None:
            # the request's cap on what it loads
            max_chunks = min(max_chunks, (num_local + state.params.max_load_tokens) // size)
        if start < max_chunks and not promised:
            # load or recompute: how far the scan may look
            max_chunks = self.costs.scan_end(state, start, max_chunks, self._clock())
            if max_chunks is None:
                return None, False
        if start >= max_chunks:
            return self._answer(state, num_local, 0)
        scan = scan_hits(state, self.manager, self._jobs.loading_keys, start, max_chunks)
        target = min(promised, max_chunks)
        if scan.end_chunk < target:
            if self._handoffs.may_wait(state, scan.end_chunk, target):
                return None, False
        elif scan.must_wait and may_defer(state, self.config, self._clock(), self.stats):
            return None, False
        # recency for every chunk the request reuses, also those the engine's cache served
        self.manager.touch(state.chain_keys(scan.end_chunk), state.req_context)
        if scan.end_chunk <= start:
            return self._answer(state, num_local, 0)
        state.pending_load = PendingLoad(start, scan.end_chunk, num_local, state.decided_load)
        return self._answer(state, num_local, scan.end_chunk * size - num_local)

    def _answer(
        self, state: RequestOffloadState, num_local: int, hit_tokens: int
    ) -> tuple[int, bool]:
        # kept across "ask again" only: the next question decides afresh
        state.decided_load = None
        state.answer = LookupAnswer(num_local, max(0, state.req.num_tokens - 1 - num_local))
        return hit_tokens, hit_tokens > 0 and self.config.load_mode == "async"

    # -- 2. allocation -> load job ----------------------------------------------------

    def update_state_after_alloc(
        self, req_id: str, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        """The engine allocated `block_ids` (all of the request's blocks, per group)."""
        state = self._requests.get(req_id)
        if state is None:
            return
        self._on_written(state.set_block_ids(block_ids, replace=True), self._next.plan)
        # before loads: promotions still known
        count_query(state, self.manager, self.config.tokens_per_chunk)
        pending = state.pending_load
        state.pending_load = None
        loaded = 0
        if pending is not None and num_external_tokens > 0:
            expected = pending.end_chunk * self.config.tokens_per_chunk - pending.num_local_tokens
            if num_external_tokens != expected:
                logger.warning(
                    "request %s: engine accepted %d external tokens, kvtier offered %d; not loading",
                    req_id,
                    num_external_tokens,
                    expected,
                )
                self._fail_offered_blocks(state, pending)
            else:
                is_loading = self._start_load(state, pending)
                if is_loading:
                    loaded = num_external_tokens
                    # a hand-off's wait was over to get here: asked again, it waits for it no more
                    state.handoff_over = True
        self.stats.count_admission(state.answer, loaded)
        state.answer = None

    def _start_load(self, state: RequestOffloadState, pending: PendingLoad) -> bool:
        keys, blocks = self._jobs.load_parts_for(state, pending)
        try:
            spec = self.manager.prepare_load([k for part in keys for k in part], state.req_context)
        except KVTierError as exc:
            # a broken contract below: recompute, never crash
            logger.warning(
                "request %s: prepare_load failed (%s); its blocks will be recomputed",
                state.req_id,
                exc,
            )
            self.stats.load_prepare_failures += 1
            self._fail_offered_blocks(state, pending)
            return False
        job = self._jobs.new_load(state, keys, blocks, spec.slot_ids)
        state.load_job_id = job.job_id
        self.costs.load_started(state, pending.decided, self._clock())
        if self.config.load_mode == "async":
            self._next.plan.async_load_jobs.append(job)
            self._jobs.cap_deadline(job.job_id, self._budget_end(state))
        else:
            self._next.plan.load_jobs.append(job)
        for gs in state.group_states:
            gs.num_hit_chunks = pending.end_chunk - pending.start_chunk
            gs.next_store_chunk = max(gs.next_store_chunk, pending.end_chunk)
        self.stats.load_jobs += 1
        self.stats.loaded_chunks += job.num_chunks
        return True

    def _budget_end(self, state: RequestOffloadState) -> float:
        """When the request's waiting budget ends (for an asynchronous load's deadline)."""
        now = self._clock()
        waited = 0.0 if state.first_deferred_at is None else now - state.first_deferred_at
        return now + max(self.config.max_defer_s - waited, _MIN_ASYNC_LOAD_S)

    def _fail_offered_blocks(self, state: RequestOffloadState, pending: PendingLoad) -> None:
        """The engine counts the offered tokens as computed: report their blocks failed
        (recompute)."""
        self._next.plan.failed_load_block_ids |= state.blocks_between(
            pending.num_local_tokens, pending.end_chunk
        )

    # -- 3. the step plan -------------------------------------------------------------

    def build_connector_meta(self, step: StepView) -> StepPlan:
        """Plan this step's transfers: new loads, stores of newly computed chunks, flushes."""
        plan = self._next.take()
        self.costs.step_planned(step, self._clock())
        self._completions.expire_jobs(plan)
        for req_id in step.preempted_req_ids:
            self._on_preempted(req_id, plan)
        # every running request, every step: names bound once
        get_state = self._requests.get
        plan_stores = self._stores.plan_stores
        for req_id, new_ids, is_new, computed, num in step.scheduled.rows():
            state = get_state(req_id)
            if state is None:
                continue
            if new_ids is not None:
                written = state.set_block_ids(new_ids, replace=is_new)
                self._on_written(written, plan)
            if state.load_job_id is None and state.params.store:
                plan_stores(state, computed + num, computed, plan)
        self.stats.flushed_jobs += len(plan.flush_job_ids)
        self._jobs.dispatch(plan, self._clock())
        return plan

    def _on_written(self, written: list[int], plan: StepPlan) -> None:
        """The engine will write `written`: stores still reading them end first (a fence),
        and the chunks they held are no longer there to store lazily."""
        plan.flush_job_ids |= self._jobs.stores_reading(written)
        self._stores.forget_blocks(written)

    def _on_preempted(self, req_id: str, plan: StepPlan) -> None:
        state = self._requests.get(req_id)
        if state is None:
            return
        # (a job expired in this very step is no longer in the book: it is failed, nothing to flush)
        plan.flush_job_ids |= {
            j for j in state.transfer_jobs if j in self._jobs and self._jobs[j].is_store
        }
        state.clear_block_ids()
        state.pending_load = None
        state.decided_load = None

    def plan_evictions(self, evictable: Iterable[int]) -> None:
        """Lazy store mode: store the computed chunks held by `evictable` — cached engine blocks
        no request holds, which the engine's next allocations (at least one step's worth)
        would evict. Call it at the end of a step, after the engine freed the blocks of the
        requests that ended; the stores go out with the next step's plan. Eager mode: no-op."""
        self._stores.plan_evictions(evictable)

    # -- 5. completions ---------------------------------------------------------------

    def update_connector_output(self, results: Iterable[JobResult]) -> None:
        """Record the workers' results; a job completes once every worker reported it.

        Failed loads need nothing here: each worker reports the blocks it could not load
        to the engine itself (`WorkerSide.take_load_errors`), which recomputes them.
        """
        self._completions.update_connector_output(results)

    # -- 6. request end, reset --------------------------------------------------------

    def request_finished(self, req: RequestView) -> dict[str, Any] | None:
        """The request ended (finished, aborted): store its last chunks, then forget it.

        Its engine blocks may be freed at once: stores still reading them are flushed
        before a new owner writes them (see `StepPlan.flush_job_ids`). A request that ends
        in the step its load ran stores once that load is reported
        (`StorePlanning.store_final_chunks`).

        Returns:
            A request handed off to a decode engine: its promise, the `kv_transfer_params` for
            that engine (`kvtier.scheduler.handoff`); else None.
        """
        state = self._requests.get(req.req_id)
        if state is None:
            return None
        state.req = req
        state.is_finished = True
        state.pending_load = None
        state.finished_at_step = self._next.step
        if state.load_job_id is None:
            self._stores.store_final_chunks(state)
        promise = self._handoffs.promise(state)
        self._requests.release_if_done(state)
        return promise

    def reset_cache(self) -> bool:
        """Forget every offloaded chunk; jobs in flight are flushed and their results ignored."""
        self.manager.reset()
        self._stores.reset()
        self._next.plan.flush_job_ids |= self._jobs.start_new_generation()
        for state in self._requests.values():
            state.reset_store_cursors()
            state.decided_load = None
        return True

    def take_events(self):
        return self.manager.take_events()

    def has_jobs_in_flight(self) -> bool:
        return bool(self._jobs) or self._completions.num_expired() > 0

    def num_jobs_in_flight(self) -> int:
        """Transfer jobs not yet reported by every worker (nor expired and released)."""
        return len(self._jobs) + self._completions.num_expired()

    def _state_for(self, req: RequestView) -> RequestOffloadState:
        state = self._requests.get(req.req_id)
        if state is None:
            state = RequestOffloadState(self.config, req)
            self._requests.add(state)
            self.stats.hinted_requests += not state.params.hints.is_empty
        else:
            state.req = req
        return state

    def num_requests(self) -> int:
        """Requests (and lazy mode's eviction owners) the scheduler still tracks (for tests)."""
        return len(self._requests)

    def request_state(self, req_id: str) -> RequestOffloadState | None:
        """The live state of a request (for adapters and tests)."""
        return self._requests.get(req_id)
