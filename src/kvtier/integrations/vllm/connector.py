"""`KVTierConnector`: kvtier as a vLLM v1 KV connector (out of tree).

    LLM(..., kv_transfer_config=KVTransferConfig(
        kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"cpu_bytes": "4GiB"}))

vLLM builds one instance per process: role SCHEDULER in the engine core (-> `SchedulerSide`,
metadata and the host slabs' ownership) and role WORKER in each worker (-> `kvtier.worker.WorkerSide`,
the copies). Each worker rank's host slab is shared memory both map (`kvtier.slab`); the
workers' connectors come first (vLLM registers KV caches before it builds the scheduler).
This class only routes calls; `kv_connector_extra_config` is validated here, at engine start,
and the engine's facts are derived here, once per process (`layout.EngineLayout`), for its half.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

# vLLM >= 0.32: request-level load failures (models with several KV-cache groups need them)
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover (older vLLM)
    KVConnectorTransferResults = None
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.config import KVTierConfig
from kvtier.integrations.vllm.convert import namespace_for, worker_rank
from kvtier.integrations.vllm.events import group_event_kinds
from kvtier.integrations.vllm.layout import check_slot_bytes, engine_layout
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.metrics import KVTierPromMetrics, KVTierStats
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.worker import TransferEngine, WorkerSide

__all__ = ["KVTierConnector", "kv_transfer_config"]


def kv_transfer_config(
    connector: str = "KVTierConnector",
    module: str = "kvtier.integrations.vllm",
    role: str = "kv_both",
    **extra_config: Any,
) -> Any:
    """vLLM's `KVTransferConfig` for kvtier; `extra_config` becomes `kv_connector_extra_config`.

    `role` is vLLM's `kv_role`: "kv_producer" for a prefill engine, "kv_consumer" for a decode
    engine of disaggregated serving (`kvtier.scheduler.handoff`), "kv_both" otherwise.
    Failed loads are recomputed (`kv_load_failure_policy="recompute"`): vLLM's default,
    "fail", would abort the request instead.
    """
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module,
        kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra_config,
    )


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered KV-cache offloading for vLLM; see the module docstring for its configuration."""

    _cache_hit_source = CacheHitSource.HOST
    # what the worker moves bytes with (tests inject faults here)
    transfer_factory = TransferEngine

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = KVTierConfig.from_dict(self._kv_transfer_config.kv_connector_extra_config)
        self.kvtier_config = cfg
        # the only derivation here
        layout = engine_layout(cfg, vllm_config, kv_cache_config)
        self.layout = layout
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._slots_reported = False
        if role == KVConnectorRole.SCHEDULER:
            # hashes the weights: here only
            namespace = namespace_for(cfg, vllm_config, kv_cache_config, layout)
            self._scheduler = SchedulerSide(
                cfg, vllm_config, layout, namespace, group_event_kinds(kv_cache_config)
            )
        else:
            self._worker = WorkerSide(
                num_slots=layout.num_slots,
                blocks_per_chunk=layout.blocks_per_chunk,
                layer_groups=[list(layers) for layers in layout.layer_groups],
                transfer_factory=type(self).transfer_factory,
                slab_name=layout.slab_names[worker_rank(vllm_config, layout.num_workers)],
            )

    @property
    def requires_kv_delivery(self) -> bool:
        # a best-effort cache: a dropped store is only a future miss
        return False

    # -- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """(False: blocks may be freed now, stores still reading them are fenced; the request's
        hand-off promise for a decode engine, or None: `kvtier.scheduler.handoff`)."""
        return False, self._sched().request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        """vLLM's hybrid KV-cache manager stays on with kvtier (`SupportsHMA`): one call per request
        for every group; kvtier's scheduler already tracks each group's blocks itself."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM hands over its block pool once its KV-cache manager exists: a lazy store mode
        reads its free queue (which cached blocks the next allocations evict); nothing else."""
        self._sched().bind_block_pool(gpu_block_pool)

    def take_events(self) -> Iterable[Any]:
        return self._sched().take_events()

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def reset_cache(self) -> bool:
        return self._sched().reset_cache()

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        worker = self._work()
        worker.register_kv_caches(kv_caches)
        check_slot_bytes(
            self.layout, worker.transfer.slot_bytes if worker.transfer is not None else None
        )

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self._work().handle_preemptions(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # a step replayed as one FULL CUDA graph never calls wait_for_layer_load: load it whole
        mode = getattr(forward_context, "cudagraph_runtime_mode", None)
        self._work().start_load_kv(self._plan(), layer_waits=getattr(mode, "name", "") != "FULL")

    def wait_for_layer_load(self, layer_name: str) -> None:
        # the step's synchronous loads of this layer
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # whole chunks are stored after the forward pass (wait_for_save)
        pass

    def wait_for_save(self) -> None:
        self._work().wait_for_save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None: blocks are never held back, requests whose asynchronous load ended)."""
        finished, _ = self._work().take_finished_loads()
        return None, finished or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """As `get_finished`, with the requests whose asynchronous load failed whole (recomputed)."""
        if KVConnectorTransferResults is None:  # pragma: no cover
            return super().get_transfer_results(finished_req_ids)
        finished, failed = self._work().take_finished_loads()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        worker = self._work()
        results = worker.take_results()
        # checked by the scheduler, once
        slots = () if self._slots_reported else (worker.num_slots,)
        self._slots_reported = True
        return KVTierWorkerMetadata(results, slots) if results or slots else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            # vLLM's Scheduler.shutdown: the host slabs are unlinked
            self._scheduler.shutdown()

    # -- stats ------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVTierStats | None:
        if self._scheduler is not None:
            return self._scheduler.get_stats()
        if self._worker is None:
            return None
        taken = self._worker.take_stats()
        # most steps: nothing moved, no report built
        if not taken:
            return None
        stats = KVTierStats()
        for name, value in taken.items():
            stats.add(name, value)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats:
        return KVTierStats(data=data) if data is not None else KVTierStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- helpers ----------------------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError(
                "a scheduler-side KVTierConnector method was called on the worker side"
            )
        return self._scheduler

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError(
                "a worker-side KVTierConnector method was called on the scheduler side"
            )
        return self._worker

    def _plan(self):
        return self._get_connector_metadata().plan
