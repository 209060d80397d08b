"""kvtier's connector stats and Prometheus metrics (`kvtier:*`).

Both connector halves report deltas since their previous report: the scheduler
side its lookups, deferrals and occupancy, the workers their bytes and seconds per
direction. vLLM aggregates them (`aggregate`), logs `reduce()` and feeds the data to
`KVTierPromMetrics.observe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvtier.costmodel.decision import DECISIONS

__all__ = [
    "COUNTERS",
    "GAUGES",
    "PREDICTED_HIT_RATIO_DOC",
    "TIER_COUNTERS",
    "TIER_GAUGES",
    "KVTierPromMetrics",
    "KVTierStats",
    "decision_stat_name",
    "read_metric",
    "tier_stat_name",
]

# name -> documentation; counters are deltas, gauges the latest value
COUNTERS = {
    "hit_tokens": "Prompt tokens loaded from kvtier instead of recomputed.",
    "miss_tokens": "Prompt tokens after the engine's own hits that kvtier could not supply.",
    "deferrals": "Lookups answered 'ask again next step' (pending writes or probes).",
    "deferral_timeouts": "Requests that stopped waiting at their deadline or deferral cap.",
    "store_alloc_failures": "Stores postponed because the CPU tier had no evictable room.",
    "evictions": "Chunks evicted from the CPU tier.",
    "load_bytes": "Bytes loaded from kvtier into the engine's KV cache.",
    "load_seconds": "Seconds spent loading.",
    "store_bytes": "Bytes stored from the engine's KV cache into kvtier.",
    "store_seconds": "Seconds spent storing.",
    "failed_load_chunks": "Chunks whose load failed (the engine recomputed them).",
    "failed_store_chunks": "Chunks whose store failed (dropped, never served).",
    "expired_jobs": "Transfer jobs not every worker reported by their deadline (failed by the scheduler).",
    "cancelled_jobs": "Transfer jobs a worker cancelled at their deadline.",
    "cancel_cut_tasks": "Copies of other jobs failed because a cancel cut short the batch they were copied in.",
    "hinted_requests": "Requests that sent kvtier hints (session, retain_s, priority, next_turn_s, end_session).",
    "pinned_slabs": "Worker host slabs page-locked for CUDA copies (1 per worker at start; none: pageable copies).",
    "handoff_promises": "Disaggregated prefill: requests this engine handed off to a decode engine, a promise each.",
    "handoff_promised_chunks": "Disaggregated prefill: chunks this engine promised decode engines.",
    "handoff_waits": "Disaggregated decode: requests that carried a prefill engine's promise for their prompt "
    "(and waited for what of it was not there yet).",
    "handoff_timeouts": "Disaggregated decode: requests whose promised chunks did not all come by the deadline "
    "(handoff_wait_s): the rest was recomputed.",
    "handoff_unreachable": "Disaggregated decode: requests that did not wait because the hand-off tier did not answer.",
    "handoff_mismatches": "Disaggregated decode: requests whose promise named another prompt (not awaited).",
    "expected_load_seconds": "Seconds the cost model expected the loads that ended to take (decision to loaded).",
    "measured_load_seconds": "Seconds the loads that ended took, from their load-or-recompute decision to loaded.",
}
GAUGES = {
    "num_slots": "Slots (chunks) of the CPU tier.",
    "used_slots": "Slots holding a chunk (readable, being written, or retired).",
    "pinned_slots": "Slots pinned by loads in flight.",
    "unsupported_groups": "KV-cache groups kvtier cannot serve (the model then gets no kvtier hits).",
    "jobs_in_flight": "Transfer jobs (engine <-> CPU tier) not yet reported by every worker nor expired.",
    "tier_jobs_in_flight": "Reads and writes of the secondary tiers (disk, Redis, S3) in flight.",
    "prefill_tokens_per_second": "The engine's prefill speed as the load-or-recompute decision estimates it.",
}
LOAD_DECISIONS_DOC = (
    "Load-or-recompute decisions on prefixes kvtier found: load (all of it), partial (a head) "
    "or recompute (none), by the tier the decision was about."
)
# Per tier (label `tier`: cpu, disk, …), reported as "tier.<medium>.<name>". The directional ones
# (`<direction>_<what>`) become one metric with a `direction` label (load, store).
TIER_COUNTERS = {
    "chunks": "Chunks a tier read (load, promotions included) or wrote (store, cascades included).",
    "bytes": "Bytes a tier read or wrote.",
    "seconds": "Seconds a tier's reads or writes took, summed over its I/O threads.",
    "failures": "Chunks a tier failed to read or write (I/O error, full disk, corrupt value).",
    "evictions": "Chunks a tier evicted for room.",
    "corrupt": "Values that failed a check on read (header, length, checksum): deleted, never served.",
    "backpressure_drops": "Chunks not written to a tier because its queue or latency was over its limit.",
    "promotions": "Chunks read back from a tier into the CPU tier for a request.",
    "explorations": "Load-or-recompute decisions that tried a tier they wrote off, its estimate stale: a chunk read "
    "in the background to measure it, not kept (cpu: a request loaded its RAM head anyway).",
    "promotion_failures": "Promotions that failed (the slot was freed, the request recomputes).",
    "admission_skips": "Chunks a tier's admission rule kept out.",
    "staging_drops": "Evicted chunks an on_evict tier lost because the staging pool was full.",
    "timeouts": "Operations of a shared tier (Redis, S3) that timed out.",
    "errors": "Operations of a shared tier that failed otherwise (connection refused, server or auth error).",
    "breaker_opens": "Times a shared tier's circuit breaker opened (the tier then answers misses at once).",
    "breaker_closes": "Times a shared tier's circuit breaker closed again (its server answered a ping).",
    "breaker_rejects": "Chunks not read or written because a shared tier's breaker was open.",
    "expired_jobs": "Jobs of a tier the manager gave up on at their deadline (what they hold is freed when they end).",
    "expired": "Chunks a tier did not read or write because their job was past its deadline.",
    "late": "Chunks a tier read after their job's deadline (reported failed, never served).",
    "handoff_chunks": "Chunks a prefill engine wrote to its hand-off tier for decode engines.",
    "handoff_failures": "Chunks a prefill engine promised that did not reach its hand-off tier.",
    "reset_rejects": "Chunks a shared tier refused while a reset deleted its values.",
}
TIER_GAUGES = {
    "used_bytes": "Bytes of chunks a tier holds.",
    "capacity_bytes": "A tier's capacity in bytes (0: set by the server, e.g. Redis maxmemory).",
    "breaker_open": "1 while a shared tier's circuit breaker is open (the server failed; being retried), else 0.",
    "read_bytes_per_second": "A tier's read throughput as the load-or-recompute decision estimates it (cpu: into "
    "the engine).",
    "read_latency_seconds": "A tier's read latency as the load-or-recompute decision estimates it.",
}
PREDICTED_HIT_RATIO_DOC = (
    "The hit ratio a tier would get with capacity_factor x its capacity (in chunks), estimated online from its "
    "lookups (kvtier.mrc, SHARDS; an LRU estimate: the tier's own policy may do better or worse)."
)
# reported as "tier.<medium>.predicted_hit_ratio.<factor>"
_PREDICTED = "predicted_hit_ratio"
_DIRECTIONS = ("load", "store")


def tier_stat_name(medium: str, name: str) -> str:
    """The `KVTierStats` name of one tier's counter or gauge."""
    return f"tier.{medium}.{name}"


def decision_stat_name(decision: str, medium: str) -> str:
    """The `KVTierStats` name of the load-or-recompute decisions of one kind about one tier."""
    return f"load_decisions.{decision}.{medium}"


_TIER_DIRECTIONAL = ("chunks", "bytes", "seconds", "failures")
_DIRECTIONAL = {
    "bytes": ("load_bytes", "store_bytes"),
    "seconds": ("load_seconds", "store_seconds"),
    "failed_chunks": ("failed_load_chunks", "failed_store_chunks"),
}


@dataclass
class KVTierStats(KVConnectorStats):
    """`data = {"counters": {name: delta}, "gauges": {name: value}}` (plain, serializable)."""

    def __post_init__(self) -> None:
        if "counters" not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def add(self, name: str, value: float) -> None:
        if value:
            self.data["counters"][name] = self.data["counters"].get(name, 0) + value

    def set_gauge(self, name: str, value: float) -> None:
        self.data["gauges"][name] = value

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        for name, value in other.data.get("counters", {}).items():
            self.add(name, value)
        self.data["gauges"].update(other.data.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {**self.data["counters"], **self.data["gauges"]}
        queried = out.get("hit_tokens", 0) + out.get("miss_tokens", 0)
        if queried:
            out["hit_rate"] = round(out.get("hit_tokens", 0) / queried, 4)
        for direction in ("load", "store"):
            seconds = out.get(f"{direction}_seconds", 0)
            if seconds:
                out[f"{direction}_GBps"] = round(
                    out.get(f"{direction}_bytes", 0) / seconds / 1e9, 3
                )
        return out

    def is_empty(self) -> bool:
        return not (self.data["counters"] or self.data["gauges"])


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Registers `kvtier:*` counters and gauges, per engine, and records stats into them."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_kvtier_metrics()
        self._counters: dict[str, dict[int, Any]] = {}
        self._gauges: dict[str, dict[int, Any]] = {}
        directional = {n for names in _DIRECTIONAL.values() for n in names}
        for name, doc in COUNTERS.items():
            if name not in directional:
                metric = self._counter_cls(
                    name=f"kvtier:{name}", documentation=doc, labelnames=labelnames
                )
                self._counters[name] = create_metric_per_engine(metric, per_engine_labelvalues)
        for suffix, (load_name, store_name) in _DIRECTIONAL.items():
            metric = self._counter_cls(
                name=f"kvtier:transfer_{suffix}",
                labelnames=[*labelnames, "direction"],
                documentation=f"{COUNTERS[load_name]} / {COUNTERS[store_name]}",
            )
            for name, direction in ((load_name, "load"), (store_name, "store")):
                self._counters[name] = {
                    i: metric.labels(*values, direction)
                    for i, values in per_engine_labelvalues.items()
                }
        for name, doc in GAUGES.items():
            metric = self._gauge_cls(
                name=f"kvtier:{name}", documentation=doc, labelnames=labelnames
            )
            self._gauges[name] = create_metric_per_engine(metric, per_engine_labelvalues)
        self._engine_labels = per_engine_labelvalues
        self._decisions = self._counter_cls(
            name="kvtier:load_decisions",
            documentation=LOAD_DECISIONS_DOC,
            labelnames=[*labelnames, "decision", "tier"],
        )
        self._tier_families = {
            name: self._counter_cls(
                name=f"kvtier:tier_{name}",
                documentation=doc,
                labelnames=[*labelnames, "tier", "direction"]
                if name in _TIER_DIRECTIONAL
                else [*labelnames, "tier"],
            )
            for name, doc in TIER_COUNTERS.items()
        }
        self._tier_families.update(
            {
                name: self._gauge_cls(
                    name=f"kvtier:tier_{name}", documentation=doc, labelnames=[*labelnames, "tier"]
                )
                for name, doc in TIER_GAUGES.items()
            }
        )
        self._predicted = self._gauge_cls(
            name=f"kvtier:tier_{_PREDICTED}",
            documentation=PREDICTED_HIT_RATIO_DOC,
            labelnames=[*labelnames, "tier", "capacity_factor"],
        )
        self._tiers_seen: set[tuple[int, str]] = set()

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            if name.startswith("tier."):
                self._observe_tier(name, value, engine_idx, is_gauge=False)
            elif name.startswith("load_decisions.") and value > 0:
                _, decision, medium = name.split(".", 2)
                self._decisions.labels(*self._engine_labels[engine_idx], decision, medium).inc(
                    value
                )
            elif name in self._counters and value > 0:
                self._counters[name][engine_idx].inc(value)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if name.startswith("tier."):
                self._observe_tier(name, value, engine_idx, is_gauge=True)
            elif name in self._gauges:
                self._gauges[name][engine_idx].set(value)

    def _observe_tier(self, name: str, value: float, engine_idx: int, is_gauge: bool) -> None:
        _, medium, what = name.split(".", 2)
        labels = [*self._engine_labels[engine_idx], medium]
        if (engine_idx, medium) not in self._tiers_seen:
            self._start_tier(engine_idx, medium)
        if is_gauge and what.startswith(f"{_PREDICTED}."):
            self._predicted.labels(*labels, what.removeprefix(f"{_PREDICTED}.")).set(value)
            return
        direction, _, base = what.partition("_")
        if direction in _DIRECTIONS and base in _TIER_DIRECTIONAL:
            what = base
            labels = [*labels, direction]
        family = self._tier_families.get(what)
        if family is None or (what in _TIER_DIRECTIONAL) != (
            len(labels) == len(self._engine_labels[engine_idx]) + 2
        ):
            # a tier-specific counter without a metric: in the log line only
            return
        if is_gauge:
            family.labels(*labels).set(value)
        elif value > 0:
            family.labels(*labels).inc(value)

    def _start_tier(self, engine_idx: int, medium: str) -> None:
        """Every counter of a tier first reported, at 0 (its gauges come with each report): a
        series that exists only from its first event hides that event from `rate()` and
        `increase()`, so an alert on a tier's first failures or timeouts would never fire."""
        self._tiers_seen.add((engine_idx, medium))
        labels = [*self._engine_labels[engine_idx], medium]
        for name in TIER_COUNTERS:
            for direction in _DIRECTIONS if name in _TIER_DIRECTIONAL else (None,):
                self._tier_families[name].labels(*labels, *([direction] if direction else []))
        for decision in DECISIONS:
            self._decisions.labels(*self._engine_labels[engine_idx], decision, medium)


def _unregister_kvtier_metrics() -> None:
    """Drop the `kvtier:` metrics of an earlier engine in this process (a second `LLM`), as vLLM
    does for its `vllm:` ones; registering them twice would stop the new engine at start."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith("kvtier:"):
            REGISTRY.unregister(collector)


def read_metric(name: str) -> float:
    """A kvtier metric as this process's Prometheus registry holds it, summed over labels.

    `name` is the sample name `/metrics` shows (counters end in `_total`, e.g.
    `kvtier:hit_tokens_total`; gauges do not). vLLM's stat logger records into the
    registry of the process that runs `LLM`.
    """
    from prometheus_client import REGISTRY

    return sum(
        sample.value
        for metric in REGISTRY.collect()
        for sample in metric.samples
        if sample.name == name
    )
