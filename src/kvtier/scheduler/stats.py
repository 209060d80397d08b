"""Scheduler-side counters (monotonic; exporters take deltas)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["SchedulerStats"]


@dataclass(slots=True)
class SchedulerStats:
    requests: int = 0  # lookups answered with a number (not deferred)
    query_tokens: int = 0  # tokens after the engine's own hits that kvtier was asked for
    hit_tokens: int = 0  # of those, tokens kvtier will load
    local_hit_tokens: int = 0  # tokens the engine's own prefix cache served
    deferrals: int = 0  # "ask again next step" answers
    deferral_timeouts: int = 0  # requests that stopped waiting at their deadline or cap
    load_jobs: int = 0
    loaded_chunks: int = 0
    failed_load_chunks: int = 0
    load_prepare_failures: int = 0
    store_jobs: int = 0
    stored_chunks: int = 0
    failed_store_chunks: int = 0
    store_alloc_failures: int = 0  # prepare_store found no room; retried next step
    flushed_jobs: int = 0
    stale_completions: int = 0  # jobs from before a reset_cache()

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
