"""Disaggregated prefill through a shared tier: the prefill engine's promise, the decode engine's
bounded wait for it.

A store connector alone is only a shared prefix cache: the prefill engine answers while its
writes are still in flight, and a decode request sent at once finds nothing and recomputes the
prompt. kvtier makes the hand-off a promise:

- **The producer** (`kv_role` "kv_producer", or "kv_both"): a request marked for remote decode
  (kvtier's own `{"kvtier": {"remote_decode": true}}`; on a "kv_producer" also vLLM's
  `{"do_remote_decode": true}`, which on a "kv_both" engine belongs to a transfer connector
  beside kvtier, NIXL under `MultiConnector`, whose decode engine must not wait for kvtier)
  is stored eagerly and past the CPU tier's admission rule, and when it ends every chunk of its
  prompt that a decode engine can use goes to the hand-off tier (`OffloadingManager.hand_off`,
  `kvtier.tiers.handoff`: past that tier's admission rule and backpressure, also chunks that
  were in RAM already). `request_finished` returns the promise under kvtier's own key, which no
  other connector's parameters clash with under vLLM's `MultiConnector`:

      {"kvtier": {"handoff": {"tokens": 896, "chunks": 56, "tier": "redis",
                              "deadline_s": 30.0, "key": "<hex of the last promised chunk>",
                              "namespace": "<hex of the producer's namespace id>"}}}

  `chunks` counts the leading chunks that are on their way (readable or being stored in RAM, or
  known to the hand-off tier): a chunk RAM has no room for, or a tier that is down when the
  request ends, shortens the promise (0: nothing, the decode engine does not wait). A write
  that fails after the promise was made is counted on the producer (`handoff_failures` of the
  tier), and costs the consumer its wait: it recomputes what did not come, at its deadline.
  `deadline_s` is how long the producer's writes may still take (its engine and tier job
  timeouts); `key` and `namespace` name the prompt and what its bytes mean: a decode request
  whose own chunk there differs (another prompt, another `cache_salt`) or whose engine's
  namespace differs (other weights, dtype, layout) does not wait for it.
- **The consumer** (`kv_role` "kv_consumer" or "kv_both"): a request carrying a promise loads
  the promised chunks whatever the load-or-recompute decision would say (a decode engine is not
  there to prefill), and while some are not visible yet answers "ask again" — each time telling
  the tiers to look again (`OffloadingManager.recheck`: past a shared tier's memory of an
  absence, a directory's rescan period) — until `min(handoff_wait_s, deadline_s)` after it was
  first asked. Past that, or at once when the hand-off tier is unreachable (an open circuit
  breaker), it loads what came and recomputes the rest: `handoff_timeouts`, or
  `handoff_unreachable`. Never a wrong byte: the chunks are checked as every load is.

Requests without the marker or a promise behave exactly as without this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvtier.base import OffloadingManager
from kvtier.keys import OffloadKey
from kvtier.scheduler.config import GroupKind, SchedulerOffloadConfig
from kvtier.scheduler.promise import HandoffPromise
from kvtier.scheduler.state import RequestOffloadState
from kvtier.scheduler.stats import SchedulerStats

__all__ = ["Handoffs"]

logger = logging.getLogger(__name__)


class Handoffs:
    """Both ends of a hand-off, for one engine's scheduler (a collaborator of
    `kvtier.scheduler.core.OffloadScheduler`; its thread-safety).

    Args:
        config: the offload rules (`role`, `handoff_wait_s`, `job_timeout_s`).
        manager: hands prompts off, looks for promised chunks afresh.
        stats: where promises and waits are counted.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        config: SchedulerOffloadConfig,
        manager: OffloadingManager,
        stats: SchedulerStats,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.manager = manager
        self.stats = stats
        self._clock = clock
        # a chunk may take two job timeouts into RAM (the engine's job, then its expiry: the
        # tiered manager's `handoff_store_s`), and the tier's job another one out of it
        self._deadline_s = 3 * config.job_timeout_s

    # -- the producer -------------------------------------------------------------------

    def promise(self, state: RequestOffloadState) -> dict[str, Any] | None:
        """The ended request's promise (its `kv_transfer_params` for the decode engine), after its
        last stores were offered; None for a request that is not handed off."""
        if not state.params.remote_decode:
            return None
        size = self.config.tokens_per_chunk
        req = state.req
        end = min(
            state.num_hashed_chunks(),
            (req.num_prompt_tokens - 1) // size,
            req.num_computed_tokens // size,
        )
        num_chunks = 0
        if end > 0:
            num_chunks = self._hand_off(state, end)
        medium = self.manager.handoff_medium or ""
        key = _promise_key(state, num_chunks) if num_chunks else b""
        self.stats.handoff_promises += 1
        self.stats.handoff_promised_chunks += num_chunks
        promise = HandoffPromise(
            num_chunks, num_chunks * size, medium, self._deadline_s, key, self.config.namespace_id
        )
        return promise.as_params()

    def _hand_off(self, state: RequestOffloadState, end: int) -> int:
        """Hand chunks [0, end) off (each group's that a decode engine needs); the leading chunks on
        their way. A request whose load is still in flight stores its computed chunks once the load
        is reported: they are counted as coming.

        A promise cut short at chunk c needs a sliding-window group's chunks in the window before c,
        which the window before `end` did not include: those are handed off too (and, if one of
        them is not on its way either, the promise is cut again)."""
        groups = [gs for gs in state.group_states if gs.spec.kind is not GroupKind.UNSUPPORTED]
        # each group's chunks from this one on were handed off already
        handed_from = {gs.group: end for gs in groups}
        # (a request that stores nothing stores nothing then either)
        is_loading = state.load_job_id is not None and state.params.store
        while end > 0:
            firsts = {gs.group: gs.spec.first_needed_chunk(end) for gs in groups}
            keys, chunks = state.chunk_major(firsts, end)
            new = [i for i, (g, c) in enumerate(chunks) if c < handed_from[g]]
            for group, first in firsts.items():
                handed_from[group] = min(handed_from[group], first)
            new_keys = [keys[i] for i in new]
            if not new_keys:
                return end
            num_keys = self.manager.hand_off(new_keys, state.req_context, coming=is_loading)
            if num_keys >= len(new_keys):
                return end
            # chunk-major: the chunk of the first key not on its way is the first one not promised
            end = chunks[new[num_keys]][1]
        return 0

    # -- the consumer -------------------------------------------------------------------

    def promised_chunks(self, state: RequestOffloadState, max_chunks: int) -> int:
        """The chunks a request waits for (0: none, or its wait is over). Its promise is checked at
        its first lookup: one for another prompt, or in a tier this engine lacks, is not awaited."""
        if state.handoff_over:
            return 0
        if state.handoff_chunks:
            return state.handoff_chunks
        promise = state.params.handoff
        if promise is None or promise.chunks == 0:
            return 0
        own_key = None
        if promise.chunks <= max_chunks:
            own_key = _promise_key(state, promise.chunks)
        ours = self.config.namespace_id
        other_namespace = bool(ours and promise.namespace and promise.namespace != ours)
        if own_key != promise.key or other_namespace:
            state.handoff_over = True
            self.stats.handoff_mismatches += 1
            logger.warning(
                "request %s: its hand-off promise is for another prompt (another cache_salt, "
                "namespace or prompt); not awaited",
                state.req_id,
            )
            return 0
        state.handoff_chunks = promise.chunks
        wait_s = min(self.config.handoff_wait_s, promise.deadline_s)
        state.handoff_deadline = self._clock() + wait_s
        self.stats.handoff_waits += 1
        return promise.chunks

    def may_wait(self, state: RequestOffloadState, end_chunk: int, target: int) -> bool:
        """Not all of chunks [0, target) are loadable yet, only up to `end_chunk`: True to ask again
        next step (the tiers look afresh for what is missing: each full-attention group's chunks
        from `end_chunk` on, each sliding-window group's window before `target`); False once the
        wait is over (counted), and the request then loads what came and recomputes the rest,
        waiting for nothing more."""
        promise = state.params.handoff
        if promise is None or not self.manager.is_reachable(promise.tier):
            self.stats.handoff_unreachable += 1
            self._end_wait(state, "its tier does not answer")
            return False
        if self._clock() >= state.handoff_deadline:
            self.stats.handoff_timeouts += 1
            self._end_wait(state, "its deadline passed")
            return False
        for gs in state.group_states:
            if gs.spec.kind is GroupKind.FULL:
                self.manager.recheck(state.keys(gs.group, end_chunk, target))
            elif gs.spec.kind is GroupKind.SLIDING_WINDOW:
                first = gs.spec.first_needed_chunk(target)
                self.manager.recheck(state.keys(gs.group, first, target))
        self.stats.deferrals += 1
        return True

    def _end_wait(self, state: RequestOffloadState, why: str) -> None:
        state.handoff_over = True
        # nor for anything else: its waiting budget is spent
        state.deferral_expired = True
        logger.info(
            "request %s stopped waiting for its hand-off of %d chunks (%s): what did not come is "
            "recomputed",
            state.req_id,
            state.handoff_chunks,
            why,
        )


def _promise_key(state: RequestOffloadState, num_chunks: int) -> OffloadKey:
    """What names a promise of `state`'s first `num_chunks` chunks, on both ends: the key of the
    last one in group 0 (a chained hash: it names the whole prefix, `cache_salt` included)."""
    return state.keys(0, num_chunks - 1, num_chunks)[0]
