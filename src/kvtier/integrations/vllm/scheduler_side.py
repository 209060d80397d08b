"""The scheduler-process half of `KVTierConnector`: vLLM calls -> `OffloadScheduler`."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from typing import Any

from kvtier.base import ManagerStats, OffloadingManager, ReqContext
from kvtier.build import build_manager
from kvtier.config import KVTierConfig
from kvtier.integrations.vllm.convert import (
    block_hash_bytes,
    evict_lookahead,
    evictable_blocks,
    request_view,
    scheduler_config,
    step_view,
)
from kvtier.integrations.vllm.events import (
    KVEventTranslator,
    chunk_infos,
    engine_publishes_events,
)
from kvtier.integrations.vllm.layout import EngineLayout
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.metrics import KVTierStats, decision_stat_name, tier_stat_name
from kvtier.jobs import check_slab_slots
from kvtier.keys import GROUP_INDEX_BYTES, OffloadKey
from kvtier.mrc import curve_gauges
from kvtier.scheduler import OffloadScheduler, RequestView, SchedulerStats
from kvtier.slab import HostSlab, remove_stale_slabs
from kvtier.tiers.namespace import Namespace

__all__ = ["SchedulerSide"]

logger = logging.getLogger(__name__)

# with no scheduler counter changed, tier counters and gauges are reported this often
_REPORT_EVERY_S = 1.0
# chunks described beyond what RAM and disk hold: Redis, S3, offers in flight
_EVENT_ENTRIES_BEYOND_LOCAL = 16384
_SCHEDULER_COUNTERS = (
    "deferrals",
    "deferral_timeouts",
    "store_alloc_failures",
    "failed_load_chunks",
    "failed_store_chunks",
    "expired_jobs",
    "hinted_requests",
    "handoff_promises",
    "handoff_promised_chunks",
    "handoff_waits",
    "handoff_timeouts",
    "handoff_unreachable",
    "handoff_mismatches",
)


class SchedulerSide:
    """Owns the CPU tier's metadata, the scheduler and the host slabs; copies no KV itself.

    `layout`: the engine's facts (`kvtier.integrations.vllm.layout`); `namespace`: its chunks'
    (`convert.namespace_for`). The host slabs (one shared-memory segment per worker rank,
    `self.slabs` in rank order) are created or opened here at construction — vLLM's workers
    usually came first and made them already — after removing the segments of engines that
    died without unlinking theirs; `shutdown` unlinks them. Thread-safety: vLLM's scheduler
    thread calls it.
    """

    def __init__(
        self,
        cfg: KVTierConfig,
        vllm_config: Any,
        layout: EngineLayout,
        namespace: Namespace,
        group_kinds: tuple[tuple[str | None, int | None], ...] = (),
    ):
        self.layout = layout
        # HostSlab rejects 0
        self.num_slots = layout.num_slots
        remove_stale_slabs()
        self.slabs: list[HostSlab] = []
        try:
            # populate=False: its rows are touched off the hot path
            for name in layout.slab_names:
                self.slabs.append(
                    HostSlab(name, self.num_slots, layout.slot_bytes, owner=True, populate=False)
                )
        except BaseException:
            self.shutdown()
            raise
        # one chunk across every rank
        self.payload_bytes = layout.payload_bytes
        self.manager: OffloadingManager | None = None
        try:
            self.manager = build_manager(
                cfg,
                self.num_slots,
                block_hash_bytes(vllm_config) + GROUP_INDEX_BYTES,
                [s.rows for s in self.slabs],
                namespace,
            )
        except BaseException:
            self.shutdown()
            raise
        config = scheduler_config(cfg, vllm_config, layout)
        # a hand-off's promise names it
        config = dataclasses.replace(config, namespace_id=namespace.id_hex)
        self.core = OffloadScheduler(config, self.manager)
        # vLLM's BlockPool (lazy store mode reads its free queue)
        self._block_pool: Any = None
        self._events: KVEventTranslator | None = None
        # published at the next take_events
        self._reset_events: list[Any] = []
        # else describing chunks is wasted work
        if cfg.enable_events and engine_publishes_events(vllm_config):
            disk_chunks = 0
            if cfg.disk.path:
                disk_chunks = cfg.disk.bytes // max(self.payload_bytes, 1)
            self._events = KVEventTranslator(
                self.num_slots + disk_chunks + _EVENT_ENTRIES_BEYOND_LOCAL, group_kinds
            )
            self.core.store_observer = self._describe_chunks
        self._evict_lookahead = evict_lookahead(vllm_config, layout)
        self._reported = SchedulerStats()
        self._reported_at = float("-inf")
        # when reports were due (tests set it)
        self._clock = time.monotonic
        # the requests of the step planned last (vLLM's {id: tokens}, read in place) and those of
        # them that ended since: when all have, no request is left running (`get_stats`)
        self._scheduled: dict[str, int] = {}
        self._ended: set[str] = set()
        self._reported_tiers: dict[str, Counter[str]] = {}
        role = self.core.config.role
        if role == "kv_producer" and self.manager.handoff_medium is None:
            logger.warning(
                "kvtier: kv_role kv_producer without a shared tier (redis, s3, or a disk_path "
                "the decode engines share, with handoff_tier: disk): nothing can be handed off"
            )
        logger.info(
            "kvtier: %s; CPU tier of %d slots per worker (cpu_bytes %d for %d worker(s)), "
            "chunks of %d block(s)%s%s",
            role,
            self.num_slots,
            cfg.cpu_bytes,
            layout.num_workers,
            layout.blocks_per_chunk,
            f"; disk tier at {cfg.disk.path} ({cfg.disk.bytes} bytes)" if cfg.disk.path else "",
            f"; hand-offs through {self.manager.handoff_medium}"
            if self.manager.handoff_medium
            else "",
        )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.core.get_num_new_matched_tokens(request_view(request), num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.core.update_state_after_alloc(
            request.request_id, blocks.get_block_ids(), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        plan = self.core.build_connector_meta(step_view(scheduler_output))
        self._scheduled = scheduler_output.num_scheduled_tokens
        self._ended = set()
        plan.engine_idle = scheduler_output.total_num_scheduled_tokens == 0
        return KVTierMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVTierWorkerMetadata):
            return
        # workers' first reports: a mismatch stops the engine
        check_slab_slots(self.num_slots, meta.slab_slots)
        if meta.results:
            self.core.update_connector_output(meta.results)

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        """The request's promise to a decode engine if it is handed off (its `kv_transfer_params`
        in the engine's output; `kvtier.scheduler.handoff`), else None."""
        self._ended.add(request.request_id)
        return self.core.request_finished(request_view(request))

    def bind_block_pool(self, block_pool: Any) -> None:
        self._block_pool = block_pool

    def take_events(self):
        """vLLM calls this at the end of every step, after freeing the blocks of the requests that
        ended: the moment for a lazy store mode to look at what the next allocations will evict."""
        if self.core.config.store_mode == "lazy" and self._block_pool is not None:
            self.core.plan_evictions(evictable_blocks(self._block_pool, self._evict_lookahead))
        # taken even if not published: the tiers' lists would grow
        events = self.core.take_events()
        if self._events is None:
            return []
        published = self._reset_events
        self._reset_events = []
        return published + self._events.translate(events)

    def _describe_chunks(
        self,
        req: RequestView,
        ctx: ReqContext,
        keys: list[OffloadKey],
        chunks: list[tuple[int, int]],
    ) -> None:
        """The scheduler offers these chunks of `req` to the tiers: note what their events will say."""
        request = req.engine_request
        if request is None or self._events is None:
            return
        infos = chunk_infos(
            request,
            self.core.config.groups,
            chunks,
            self.core.config.tokens_per_hash,
            ctx.hints.session,
        )
        for key, info in zip(keys, infos, strict=True):
            self._events.record(key, info)

    def has_pending_push_work(self) -> bool:
        return self.core.has_jobs_in_flight()

    def reset_cache(self) -> bool:
        """Forget every chunk. A tier whose reset announces what it drops (the CPU tier) reports it;
        for the others (which cannot list their keys cheaply: `TierDescriptor.announces_reset`)
        removals are published of every chunk the events said they hold."""
        if self._events is not None:
            # what came before the reset
            self._reset_events += self._events.translate(self.core.take_events())
        done = self.core.reset_cache()
        if self._events is not None:
            self._reset_events += self._events.remove_unannounced()
        return done

    def shutdown(self) -> None:
        """Stop the tiers (their writes in flight end first, bounded), then unlink the host slabs
        (their mappings end with their last views); idempotent."""
        if self.manager is not None:
            self.manager.close()
        for slab in self.slabs:
            slab.close()

    def get_stats(self) -> KVTierStats | None:
        """Deltas of the scheduler's counters since the last report; with them, at most once every
        `_REPORT_EVERY_S` and whenever no request is left running, the gauges and the tiers' own
        counters (a full report). None (nothing to ship) while the counters are unchanged and no
        full report is due. vLLM asks at every step, and in a busy engine some counter changes at almost every
        step: a full report (the tiers' stats, the estimates, the miss-ratio curves) cost ~0.4 ms a
        step at 64 running requests (`benchmarks/bench_sched_side.py`), vLLM's own 5 µs. The step
        in which the last running request ends is the last whose report a client reads with its
        output (vLLM steps on while kvtier's stores finish): what the tiers counted up to then
        ships in it. A gauge keeps its last value between full reports."""
        now = self.core.stats
        before = self._reported
        clock = self._clock()
        is_due = clock - self._reported_at >= _REPORT_EVERY_S or self._none_running()
        if now == before and not is_due:
            return None
        stats = KVTierStats()
        stats.add("hit_tokens", now.hit_tokens - before.hit_tokens)
        stats.add(
            "miss_tokens",
            (now.query_tokens - now.hit_tokens) - (before.query_tokens - before.hit_tokens),
        )
        for name in _SCHEDULER_COUNTERS:
            stats.add(name, getattr(now, name) - getattr(before, name))
        self._add_decision_counts(stats, now, before)
        self._reported = dataclasses.replace(
            now,
            # copies
            load_decisions=Counter(now.load_decisions),
            explorations=Counter(now.explorations),
        )
        if is_due:
            self._reported_at = clock
            self._add_gauges(stats)
        return stats

    def _none_running(self) -> bool:
        """Whether every request of the step planned last has ended (a streaming-input session
        paused between turns is not scheduled, and vLLM does not step for it)."""
        ended = self._ended
        return len(ended) >= len(self._scheduled) and ended.issuperset(self._scheduled)

    def _add_decision_counts(
        self, stats: KVTierStats, now: SchedulerStats, before: SchedulerStats
    ) -> None:
        """Load-or-recompute: decisions and load seconds since the last report."""
        for (decision, medium), count in now.load_decisions.items():
            stats.add(
                decision_stat_name(decision, medium),
                count - before.load_decisions.get((decision, medium), 0),
            )
        for medium, count in now.explorations.items():
            stats.add(
                tier_stat_name(medium, "explorations"), count - before.explorations.get(medium, 0)
            )
        stats.add("expected_load_seconds", (now.expected_load_us - before.expected_load_us) / 1e6)
        stats.add("measured_load_seconds", (now.measured_load_us - before.measured_load_us) / 1e6)

    def _add_gauges(self, stats: KVTierStats) -> None:
        """A full report's rest: occupancy, the cost model's estimates, and per tier its counters'
        deltas since the last full report, its bytes and its miss-ratio curve."""
        cpu = self.core.manager.stats()
        for name in ("num_slots", "used_slots", "pinned_slots"):
            stats.set_gauge(name, getattr(cpu, name))
        stats.set_gauge("unsupported_groups", len(self.core.config.unsupported_groups()))
        stats.set_gauge("jobs_in_flight", self.core.num_jobs_in_flight())
        stats.set_gauge("tier_jobs_in_flight", cpu.extra.get("tier_jobs_in_flight", 0))
        costs = self.core.costs.snapshot()
        stats.set_gauge("prefill_tokens_per_second", round(costs.prefill_tokens_per_s, 1))
        for medium, estimate in costs.reads.items():
            stats.set_gauge(
                tier_stat_name(medium, "read_bytes_per_second"), round(estimate.bytes_per_s)
            )
            stats.set_gauge(
                tier_stat_name(medium, "read_latency_seconds"), round(estimate.latency_s, 6)
            )
        self._add_tier_stats(stats, cpu)

    def _add_tier_stats(self, stats: KVTierStats, cpu: ManagerStats) -> None:
        """Per tier: counter deltas since the last report, used and capacity bytes."""
        cpu_curve = curve_gauges(getattr(self.core.manager, "mrc", None), cpu.num_slots)
        tiers = [
            (
                "cpu",
                Counter(evictions=cpu.evictions),
                cpu.used_slots * self.payload_bytes,
                cpu.num_slots * self.payload_bytes,
                cpu_curve,
            )
        ]
        tiers += [
            (t.medium, t.counters, t.used_bytes, t.capacity_bytes, t.gauges)
            for t in self.core.manager.tier_stats()
        ]
        for medium, counters, used, capacity, gauges in tiers:
            for name, value in gauges.items():
                stats.set_gauge(tier_stat_name(medium, name), value)
            before = self._reported_tiers.get(medium, Counter())
            for name, value in counters.items():
                delta = value - before.get(name, 0)
                if name.endswith("_seconds_us"):
                    name = name.removesuffix("_us")
                    delta = delta / 1e6
                if name == "evictions" and medium == "cpu":
                    # the CPU tier's, under its historical name too
                    stats.add("evictions", delta)
                stats.add(tier_stat_name(medium, name), delta)
            stats.set_gauge(tier_stat_name(medium, "used_bytes"), used)
            stats.set_gauge(tier_stat_name(medium, "capacity_bytes"), capacity)
            self._reported_tiers[medium] = Counter(counters)
