"""The hit scan: how many chunks after the engine's own hits kvtier can load now; and the
bounded wait of a request whose hits are not readable yet.

Full-attention groups need every chunk of the prefix: a prefix scan where HIT counts,
MISS stops, and HIT_PENDING / RETRY (or a chunk being loaded for another request)
mean "wait" (the scan still looks up the chunks after it, up to a MISS). Sliding-window
groups only need the chunks inside the window before the boundary: a suffix scan lowers
the boundary until that window is all HIT.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass

from kvtier.base import LookupResult, OffloadingManager
from kvtier.keys import OffloadKey
from kvtier.scheduler.config import GroupKind, SchedulerOffloadConfig
from kvtier.scheduler.state import RequestOffloadState
from kvtier.scheduler.stats import SchedulerStats

__all__ = ["HitScan", "count_query", "may_defer", "scan_hits"]

logger = logging.getLogger(__name__)

_HIT = LookupResult.HIT


@dataclass(frozen=True, slots=True)
class HitScan:
    """What the hit scan of one request found."""

    # confirmed hits cover chunks [start, end_chunk)
    end_chunk: int
    # a later chunk may become a hit soon (pending write, probe, load)
    must_wait: bool


class _Lookups:
    """Memoized lookups for one scan; a key being loaded elsewhere reads as 'wait'."""

    def __init__(
        self, manager: OffloadingManager, state: RequestOffloadState, loading: Container[OffloadKey]
    ):
        self.manager = manager
        self.ctx = state.req_context
        self.loading = loading
        self.cache: dict[OffloadKey, LookupResult] = {}

    def __call__(self, key: OffloadKey) -> LookupResult:
        result = self.cache.get(key)
        if result is None:
            result = self.manager.lookup(key, self.ctx)
            if result is _HIT and key in self.loading:
                # the engine's prefix cache will serve it soon
                result = LookupResult.HIT_PENDING
            self.cache[key] = result
        return result


def scan_hits(
    state: RequestOffloadState,
    manager: OffloadingManager,
    loading: Container[OffloadKey],
    start: int,
    max_chunks: int,
) -> HitScan:
    """Scan chunks [start, max_chunks) of every group; see the module docstring."""
    lookup = _Lookups(manager, state, loading)
    end = max_chunks
    must_wait = False
    for gs in state.group_states:
        if gs.spec.kind is GroupKind.FULL and end > start:
            end, waits = _prefix_scan(state.keys(gs.group, start, end), lookup, start, end)
            must_wait |= waits
    for gs in state.group_states:
        if gs.spec.kind is GroupKind.SLIDING_WINDOW:
            end, waits = _window_scan(state, gs.group, lookup, start, end)
            must_wait |= waits
    return HitScan(end, must_wait)


def _prefix_scan(
    keys: list[OffloadKey], lookup: _Lookups, start: int, end: int
) -> tuple[int, bool]:
    """Hits end at the first non-HIT. Past a chunk to wait for the scan goes on to the first MISS:
    the later chunks' lookups start their tiers' probes and promotions now, all in this step,
    instead of one chunk per step."""
    must_wait = False
    for i, key in enumerate(keys):
        result = lookup(key)
        if result is _HIT:
            continue
        if not must_wait:
            end = start + i
        if result is LookupResult.MISS:
            break
        must_wait = True
    return end, must_wait


def _window_scan(
    state: RequestOffloadState, group: int, lookup: _Lookups, start: int, end: int
) -> tuple[int, bool]:
    """Largest boundary h <= end whose window chunks (after `start`) are all HIT."""
    spec = state.group_states[group].spec
    must_wait = False
    for h in range(end, start, -1):
        first = max(start, spec.first_needed_chunk(h))
        results = [lookup(k) for k in state.keys(group, first, h)]
        if all(r is _HIT for r in results):
            return h, must_wait
        must_wait |= any(r is not _HIT and r is not LookupResult.MISS for r in results)
    return start, must_wait


def count_query(
    state: RequestOffloadState, manager: OffloadingManager, tokens_per_chunk: int
) -> None:
    """The engine admits the request: tell the manager the chunks it asked for (each full-attention
    group's, after the engine's own hits, as its latest answer counted them), once per request."""
    answer = state.answer
    if answer is None or not state.params.load:
        return
    start = answer.num_local_tokens // tokens_per_chunk
    end = min(
        state.num_hashed_chunks(),
        (answer.num_local_tokens + answer.num_query_tokens) // tokens_per_chunk,
    )
    for gs in state.group_states:
        if gs.spec.kind is GroupKind.FULL and start < end:
            manager.count_query(state.keys(gs.group, start, end), state.req_context)


def may_defer(
    state: RequestOffloadState, config: SchedulerOffloadConfig, now: float, stats: SchedulerStats
) -> bool:
    """Spend one "ask again next step" of the request's budget; False once it is exhausted.

    The budget is `max_deferrals` answers and `max_defer_s` seconds from the first one;
    the request that runs out counts one `deferral_timeouts` and proceeds with what is HIT.
    """
    if state.deferral_expired:
        return False
    if state.first_deferred_at is None:
        state.first_deferred_at = now
    if (
        state.num_deferrals >= config.max_deferrals
        or now - state.first_deferred_at >= config.max_defer_s
    ):
        state.deferral_expired = True
        stats.deferral_timeouts += 1
        logger.info(
            "request %s stopped waiting after %d deferrals", state.req_id, state.num_deferrals
        )
        return False
    state.num_deferrals += 1
    stats.deferrals += 1
    return True
