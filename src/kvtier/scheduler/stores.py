"""When and what the scheduler stores: every whole, computed chunk after a request's store
cursor, offered to the manager — at once ("eager"), when the engine is about to evict its
blocks ("lazy", `kvtier.scheduler.lazy`), and a finished request's last chunks.

In lazy mode the requests that computed the chunks may have ended long before: each step's
evict-time stores belong to an owner of their own, named after `EVICTIONS_REQ_ID`, which ends
(for the manager, `on_request_finished`) with its jobs.

`StorePlanning` is a part of `kvtier.scheduler.core.OffloadScheduler` (a mixin): it shares the
scheduler's requests, job book, ledger and next plan. Thread-safety: the scheduler's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from kvtier.base import OffloadingManager, ReqContext
from kvtier.jobs import StepPlan
from kvtier.keys import OffloadKey
from kvtier.scheduler.config import SchedulerOffloadConfig
from kvtier.scheduler.jobs import TransferJobBook
from kvtier.scheduler.lazy import EvictionLedger
from kvtier.scheduler.state import RequestOffloadState
from kvtier.scheduler.stats import SchedulerStats
from kvtier.scheduler.types import RequestView

__all__ = ["EVICTIONS_REQ_ID", "StoreObserver", "StorePlanning"]

logger = logging.getLogger("kvtier.scheduler.core")  # the scheduler's logger, as before this part moved here

EVICTIONS_REQ_ID = "\x00kvtier:evictions"  # owns lazy mode's stores (no engine request id starts with NUL)

# (request, its context, keys, (group, chunk) of each key): the chunks of this step a request offers to the
# tiers, at once (eager) or later (lazy); an adapter reads what its events need from the request here
StoreObserver = Callable[[RequestView, ReqContext, list[OffloadKey], list[tuple[int, int]]], None]


class StorePlanning:
    """The store side of `OffloadScheduler`; see the module docstring."""

    # the scheduler's state this part reads and changes (set by OffloadScheduler.__init__)
    config: SchedulerOffloadConfig
    manager: OffloadingManager
    stats: SchedulerStats
    _requests: dict[str, RequestOffloadState]
    _jobs: TransferJobBook
    _next_plan: StepPlan
    _step: int
    _is_supported: bool
    _lazy: bool
    _ledger: EvictionLedger
    store_observer: StoreObserver | None

    def _plan_stores(self, state: RequestOffloadState, num_tokens: int, window_from: int, plan: StepPlan) -> None:
        """Offer every whole, computed chunk after the store cursor to the manager."""
        if not self._is_supported:
            return  # nothing stored could ever be loaded
        if self.config.offload_prompt_only:
            num_tokens = min(num_tokens, state.req.num_prompt_tokens)
        end = min(num_tokens // self.config.tokens_per_chunk, state.num_hashed_chunks(),
                  *(gs.num_allocated_chunks() for gs in state.group_states))
        if all(gs.next_store_chunk >= end for gs in state.group_states):
            return  # most decode steps: no chunk completed since the last store (no candidates either)
        keys, chunks = self._jobs.store_candidates(state, end, window_from)
        if not keys:
            return
        if self.store_observer is not None:
            try:  # describing chunks for events must never fail a step: without it, events go on undescribed
                self.store_observer(state.req, state.req_context, keys, chunks)
            except Exception:
                logger.exception("kvtier: describing chunks for KV events failed; they are published by hash alone")
                self.store_observer = None
        groups = [group for group, _ in chunks]
        blocks = [state.group_states[group].chunk_blocks(chunk) for group, chunk in chunks]
        if self._lazy:  # stored when the engine is about to evict them (`plan_evictions`)
            for key, (group, chunk), chunk_blocks in zip(keys, chunks, blocks, strict=True):
                self._ledger.record(key, group, chunk_blocks, state.req_id, chunk)
        elif not self._store(state, keys, groups, blocks, plan):
            return  # no room now: the cursor stays, retried next step
        for gs in state.group_states:
            gs.next_store_chunk = max(gs.next_store_chunk, end)

    def plan_evictions(self, evictable: Iterable[int]) -> None:
        """Lazy store mode: store the computed chunks held by `evictable` — cached engine blocks
        no request holds, which the engine's next allocations (at least one step's worth)
        would evict. Call it at the end of a step, after the engine freed the blocks of the
        requests that ended; the stores go out with the next step's plan. Eager mode: no-op."""
        if not self._lazy:
            return
        plan = self._next_plan
        entries = self._ledger.take(evictable)
        if not entries:
            return
        owner = RequestOffloadState(self.config, RequestView(req_id=f"{EVICTIONS_REQ_ID}:{self._step}",
                                                             block_hashes=(), num_tokens=0, num_prompt_tokens=0))
        owner.is_finished, owner.finished_at_step = True, self._step
        self._requests[owner.req_id] = owner
        if self._store(owner, [e.key for e in entries], [e.group for e in entries], [e.blocks for e in entries],
                       plan):
            self.stats.lazy_offered_chunks += len(entries)
        else:
            self._ledger.restore(entries)  # no room now: retried next step, unless the blocks go first
        self._release_if_done(owner)

    def _store(self, state: RequestOffloadState, keys: list[OffloadKey], groups: list[int],
               blocks: list[Sequence[int]], plan: StepPlan) -> bool:
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

    def _store_final_chunks(self, state: RequestOffloadState) -> None:
        """Plan the last stores of a finished request, from blocks the engine has just freed.

        Only before the next plan: until then no new owner can have written those blocks,
        and that plan flushes the stores if it hands the blocks over (a load reported later
        than that — never the case with vLLM's per-step reports — leaves them unstored).
        """
        if state.finished_at_step != self._step:
            logger.debug("request %s: its load was reported after its blocks were freed; last chunks not stored",
                         state.req_id)
            return
        if state.params.store and state.group_states[0].block_ids:
            computed = state.req.num_computed_tokens
            self._plan_stores(state, computed, computed, self._next_plan)
