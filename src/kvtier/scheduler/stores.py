"""When and what the scheduler stores: every whole, computed chunk after a request's store
cursor, offered to the manager — at once ("eager"), when the engine is about to evict its
blocks ("lazy", `kvtier.scheduler.lazy`), and a finished request's last chunks.

In lazy mode the requests that computed the chunks may have ended long before: each step's
evict-time stores belong to owners of their own, one per request whose chunks they are, named
after `EVICTIONS_REQ_ID`, which end (for the manager, `on_request_finished`) with their jobs.
Each owner's context acts `on_behalf_of` its request (`ReqContext`): the tiers charge the store
to that request's tenant and hint it as the request asked, exactly as an eager store would be
(issue 32, defects 1 and 3).

`StorePlanning` is a collaborator of `kvtier.scheduler.core.OffloadScheduler`: it shares the
scheduler's requests, job book and next plan (passed to it), owns lazy mode's ledger, and the
scheduler calls it as each step is planned, as a request ends (`store_final_chunks`: also from
`kvtier.scheduler.completions`, once a finished request's load ended) and after each step
(`plan_evictions`). Thread-safety: the scheduler's.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence

from kvtier.base import OffloadingManager, ReqContext
from kvtier.jobs import StepPlan
from kvtier.keys import OffloadKey
from kvtier.scheduler.config import SchedulerOffloadConfig
from kvtier.scheduler.jobs import NextPlan, TransferJobBook
from kvtier.scheduler.lazy import EvictionLedger
from kvtier.scheduler.requests import RequestTable
from kvtier.scheduler.state import RequestOffloadState
from kvtier.scheduler.stats import SchedulerStats
from kvtier.scheduler.types import RequestView

__all__ = ["EVICTIONS_REQ_ID", "StoreObserver", "StorePlanning"]

logger = logging.getLogger(__name__)

# owns lazy mode's stores, one owner per step and request stored for (no engine request id starts
# with NUL)
EVICTIONS_REQ_ID = "\x00kvtier:evictions"

# (request, its context, keys, (group, chunk) of each key): the chunks of this step a request offers
# to the tiers, at once (eager) or later (lazy); an adapter reads what its events need from the
# request here
StoreObserver = Callable[[RequestView, ReqContext, list[OffloadKey], list[tuple[int, int]]], None]


class StorePlanning:
    """What the scheduler stores, and when; see the module docstring.

    Args:
        config: the offload rules (`store_mode`, `offload_prompt_only`, the groups).
        manager: offered the chunks (`prepare_store`).
        stats: where store jobs, refusals and lazy offers are counted.
        requests: the scheduler's requests; eviction owners join them and leave once their
            stores ended.
        jobs: the scheduler's job book, where store jobs are made.
        ledger: lazy mode's computed chunks not stored yet (only this planner uses it).
        next_plan: the plan of the next step, and the number of the step planned last.
    """

    def __init__(
        self,
        config: SchedulerOffloadConfig,
        manager: OffloadingManager,
        stats: SchedulerStats,
        requests: RequestTable,
        jobs: TransferJobBook,
        ledger: EvictionLedger,
        next_plan: NextPlan,
    ):
        self.config = config
        self.manager = manager
        self.stats = stats
        self.ledger = ledger
        # the adapter's: told of the chunks offered to the tiers (for its events)
        self.observer: StoreObserver | None = None
        self._requests = requests
        self._jobs = jobs
        self._next = next_plan
        self._is_supported = config.is_supported
        self._lazy = config.store_mode == "lazy"
        self._prompt_only = config.offload_prompt_only
        self._tokens_per_chunk = config.tokens_per_chunk

    def plan_stores(
        self, state: RequestOffloadState, num_tokens: int, window_from: int, plan: StepPlan
    ) -> None:
        """Offer every whole, computed chunk after the store cursor to the manager."""
        if not self._is_supported:
            # nothing stored could ever be loaded
            return
        if self._prompt_only:
            num_tokens = min(num_tokens, state.req.num_prompt_tokens)
        num_chunks = num_tokens // self._tokens_per_chunk
        # Most decode steps complete no chunk: every cursor is at or past the computed chunks
        # already, and so past `end` below. Checked first: this runs for every running request in
        # every step (issue 37: 0.2 µs a call here, 2 µs counting hashes and blocks first).
        for gs in state.group_states:
            if gs.next_store_chunk < num_chunks:
                break
        else:
            return
        end = min(
            num_chunks,
            state.num_hashed_chunks(),
            *(gs.num_allocated_chunks() for gs in state.group_states),
        )
        if all(gs.next_store_chunk >= end for gs in state.group_states):
            # the chunks computed are not all hashed or allocated yet (no candidates either)
            return
        keys, chunks = self._jobs.store_candidates(state, end, window_from)
        if not keys:
            return
        self._describe(state, keys, chunks)
        groups = [group for group, _ in chunks]
        blocks = [state.group_states[group].chunk_blocks(chunk) for group, chunk in chunks]
        if self._lazy and not state.params.remote_decode:
            # stored when the engine is about to evict them (`plan_evictions`); a hand-off's at
            # once: its decode engine waits for them
            for key, (group, chunk), chunk_blocks in zip(keys, chunks, blocks, strict=True):
                self.ledger.record(key, group, chunk_blocks, state.req_context, chunk)
        else:
            is_offered = self._store(state, keys, groups, blocks, plan)
            if not is_offered:
                # no room now: the cursor stays, retried next step
                return
        for gs in state.group_states:
            gs.next_store_chunk = max(gs.next_store_chunk, end)

    def _describe(
        self, state: RequestOffloadState, keys: list[OffloadKey], chunks: list[tuple[int, int]]
    ) -> None:
        """Tell the observer, if any, of the chunks `state` offers. Describing chunks for events must
        never fail a step: after a failure, events go on undescribed."""
        observer = self.observer
        if observer is None:
            return
        try:
            observer(state.req, state.req_context, keys, chunks)
        except Exception:
            logger.exception(
                "kvtier: describing chunks for KV events failed; they are published by hash alone"
            )
            self.observer = None

    def forget_blocks(self, blocks: list[int]) -> None:
        """The engine will write `blocks`: the chunks they held are no longer there to store
        lazily."""
        if self._lazy:
            self.ledger.forget(blocks)

    def reset(self) -> None:
        """Forget every chunk not stored yet (`reset_cache`)."""
        self.ledger.clear()

    def plan_evictions(self, evictable: Iterable[int]) -> None:
        """Lazy store mode: store the computed chunks held by `evictable`; the stores go out with
        the next step's plan (see `OffloadScheduler.plan_evictions`). Eager mode: no-op."""
        if not self._lazy:
            return
        plan = self._next.plan
        # One store per request whose chunks these are (`take` lists them request by request):
        # each under its own owner, so that quotas and hints are that request's.
        for _, group in itertools.groupby(self.ledger.take(evictable), key=lambda e: id(e.owner)):
            entries = list(group)
            owner = self._eviction_owner(entries[0].owner)
            is_offered = self._store(
                owner,
                [e.key for e in entries],
                [e.group for e in entries],
                [e.blocks for e in entries],
                plan,
            )
            if is_offered:
                self.stats.lazy_offered_chunks += len(entries)
            else:
                # no room now: retried next step, unless the blocks go first
                self.ledger.restore(entries)
            self._requests.release_if_done(owner)

    def _eviction_owner(self, computed_by: ReqContext) -> RequestOffloadState:
        """A finished request of kvtier's own that stores, in this step, chunks the request with
        context `computed_by` computed: the manager sees its tenant and hints, and whose use it is
        (`ReqContext.on_behalf_of`), under a request id of its own (its pins and chain are not the
        request's, which may still run: a preempted request, a sliding window's dropped blocks)."""
        step = self._next.step
        base = f"{EVICTIONS_REQ_ID}:{step}:{computed_by.req_id}"
        req_id = base
        num_taken = 0
        # taken only if `plan_evictions` ran twice in one step, or for a request id an engine reused
        while req_id in self._requests:
            num_taken += 1
            req_id = f"{base}:{num_taken}"
        owner = RequestOffloadState(
            self.config,
            RequestView(req_id=req_id, block_hashes=(), num_tokens=0, num_prompt_tokens=0),
        )
        # not the context its view would give (its own, acting for nobody): every manager call for
        # its store says whose chunks these are. A request that still runs (preempted, or past a
        # sliding window) has not ended its session yet: its own end does, as in eager mode
        hints = computed_by.hints
        running = self._requests.get(computed_by.req_id)
        if hints.end_session and running is not None and not running.is_finished:
            hints = dataclasses.replace(hints, end_session=False)
        owner.req_context = ReqContext(
            req_id,
            computed_by.kv_transfer_params,
            hints,
            computed_by.tenant,
            on_behalf_of=computed_by.req_id,
        )
        owner.is_finished = True
        owner.finished_at_step = step
        self._requests.add(owner)
        return owner

    def _store(
        self,
        state: RequestOffloadState,
        keys: list[OffloadKey],
        groups: list[int],
        blocks: list[Sequence[int]],
        plan: StepPlan,
    ) -> bool:
        """Offer chunks to the manager and plan a store job for those it takes; False when it
        has no room for them now."""
        out = self.manager.prepare_store(list(dict.fromkeys(keys)), state.req_context)
        if out is None:
            self.stats.store_alloc_failures += 1
            return False
        if out.keys_to_store:
            plan.store_jobs.append(self._jobs.new_store(state, keys, groups, blocks, out))
            self.stats.store_jobs += 1
        return True

    def store_final_chunks(self, state: RequestOffloadState) -> None:
        """Plan the last stores of a finished request, from blocks the engine has just freed.

        Only before the next plan: until then no new owner can have written those blocks,
        and that plan flushes the stores if it hands the blocks over (a load reported later
        than that — never the case with vLLM's per-step reports — leaves them unstored).
        """
        if state.finished_at_step != self._next.step:
            logger.debug(
                "request %s: its load was reported after its blocks were freed; "
                "last chunks not stored",
                state.req_id,
            )
            return
        if state.params.store and state.group_states[0].block_ids:
            computed = state.req.num_computed_tokens
            self.plan_stores(state, computed, computed, self._next.plan)
