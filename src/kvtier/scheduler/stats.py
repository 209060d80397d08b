"""Scheduler-side counters (monotonic; exporters take deltas)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.scheduler.state import LookupAnswer

__all__ = ["SchedulerStats"]


@dataclass(slots=True)
class SchedulerStats:
    # admissions: counted once per request, with the answer it was admitted with
    requests: int = 0
    # tokens after the engine's own hits that kvtier was asked for
    query_tokens: int = 0
    # of those, tokens kvtier loads
    hit_tokens: int = 0
    # tokens the engine's own prefix cache served
    local_hit_tokens: int = 0
    # "ask again next step" answers
    deferrals: int = 0
    # requests that stopped waiting at their deadline or cap
    deferral_timeouts: int = 0
    load_jobs: int = 0
    loaded_chunks: int = 0
    failed_load_chunks: int = 0
    load_prepare_failures: int = 0
    store_jobs: int = 0
    stored_chunks: int = 0
    failed_store_chunks: int = 0
    # prepare_store found no room; retried next step
    store_alloc_failures: int = 0
    # lazy store mode: chunks offered as the engine was about to evict them
    lazy_offered_chunks: int = 0
    flushed_jobs: int = 0
    # jobs from before a reset_cache()
    stale_completions: int = 0
    # jobs not every worker reported in time: failed by the scheduler
    expired_jobs: int = 0
    # requests whose kv_transfer_params carried a valid hint (`kvtier.hints`)
    hinted_requests: int = 0
    # disaggregated prefill (`kvtier.scheduler.handoff`): a producer's promises and the chunks in
    # them; a consumer's requests that waited for one, stopped at its deadline, found its tier
    # unreachable, or were promised another prompt's chunks
    handoff_promises: int = 0
    handoff_promised_chunks: int = 0
    handoff_waits: int = 0
    handoff_timeouts: int = 0
    handoff_unreachable: int = 0
    handoff_mismatches: int = 0
    # load or recompute (`kvtier.scheduler.load_cost`): decisions by (decision, tier), and the
    # loads that ended, with the seconds they were expected to take and took (microseconds)
    load_decisions: Counter[tuple[str, str]] = field(default_factory=Counter)
    # by tier: decisions that tried a tier they wrote off (`kvtier.costmodel.exploration`)
    explorations: Counter[str] = field(default_factory=Counter)
    timed_loads: int = 0
    expected_load_us: int = 0
    measured_load_us: int = 0

    def count_admission(self, answer: LookupAnswer | None, num_loaded_tokens: int) -> None:
        """Count a request's lookup once, when the engine admits it (not at every re-ask)."""
        if answer is not None:
            self.requests += 1
            self.local_hit_tokens += answer.num_local_tokens
            self.query_tokens += answer.num_query_tokens
            self.hit_tokens += num_loaded_tokens

    def count_decision(self, decision: str, tier: str) -> None:
        self.load_decisions[(decision, tier)] += 1

    def as_dict(self) -> dict[str, int]:
        """The counters (the decisions as `load_decisions_<decision>_<tier>`, the explorations as
        `explorations_<tier>`)."""
        by_key = ("load_decisions", "explorations")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in by_key}
        out.update({f"load_decisions_{d}_{t}": n for (d, t), n in self.load_decisions.items()})
        out.update({f"explorations_{t}": n for t, n in self.explorations.items()})
        return out
