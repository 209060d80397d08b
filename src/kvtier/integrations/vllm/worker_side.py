"""The worker-process half of `KVTierConnector`: a plan's jobs -> `TransferEngine`.

Per engine step (vLLM's order): `handle_preemptions` flushes the jobs the plan names;
`start_load_kv` runs the loads and waits for them (kvtier's loads are synchronous:
they finish before the forward pass reads the blocks); `wait_for_save` submits the
stores, which run in the background; `build_worker_meta` reports every finished job.
A kvtier job has one part per KV-cache group, each an engine job of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.convert import num_slots_for
from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata
from kvtier.integrations.vllm.metrics import KVTierStats
from kvtier.scheduler import JobReport, StepPlan, TransferJob
from kvtier.worker import TransferEngine

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)

_MAX_PARTS = 64  # engine job id = kvtier job id * _MAX_PARTS + part index
_FLUSH_TIMEOUT_S = 120.0  # a flush waits this long at most; then the job is reported failed


@dataclass(slots=True)
class _Pending:
    job: TransferJob
    parts_left: int
    failed_chunks: set[int] = field(default_factory=set)
    num_bytes: int = 0
    seconds: float = 0.0


class WorkerSide:
    """Owns the host slab and the copies; makes no policy decision."""

    def __init__(self, cfg: KVTierConfig, kv_cache_config: Any):
        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        self.num_slots = num_slots_for(cfg, kv_cache_config)
        self.engine: TransferEngine | None = None
        self._pending: dict[int, _Pending] = {}
        self._reports: list[JobReport] = []
        self._load_errors: set[int] = set()
        self._stats = KVTierStats()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        groups = [list(g.layer_names) for g in self.kv_cache_config.kv_cache_groups]
        if len(groups) > _MAX_PARTS:
            raise ConfigError(f"kvtier supports up to {_MAX_PARTS} KV-cache groups, this model has {len(groups)}")
        self.engine = TransferEngine(kv_caches, self.cfg.blocks_per_chunk, self.num_slots, layer_groups=groups)
        logger.info("kvtier: host slab of %d slots x %d bytes", self.num_slots, self.engine.slot_bytes)

    def handle_preemptions(self, plan: StepPlan) -> None:
        self._load_errors |= plan.failed_load_block_ids
        flush = [i * _MAX_PARTS + p for i in plan.flush_job_ids if i in self._pending
                 for p in range(len(self._pending[i].job.parts))]
        if flush and self.engine is not None and not self.engine.wait(flush, timeout=_FLUSH_TIMEOUT_S):
            logger.error("kvtier: %d flushed transfer(s) still running after %.0f s", len(flush), _FLUSH_TIMEOUT_S)

    def start_load_kv(self, plan: StepPlan) -> None:
        if not plan.load_jobs:
            return
        ids = [e for job in plan.load_jobs for e in self._submit(job, is_load=True)]
        if ids and self.engine is not None and not self.engine.wait(ids, timeout=_FLUSH_TIMEOUT_S):
            # Never hang the forward pass on a stuck copy: the engine recomputes what is late.
            # (A copy that still lands afterwards would overwrite recomputed blocks; a host that
            # cannot memcpy a few MiB in 120 s is failing, and this is logged as an error.)
            logger.error("kvtier: loads still running after %.0f s; their blocks will be recomputed",
                         _FLUSH_TIMEOUT_S)
            for job in plan.load_jobs:
                if job.job_id in self._pending:
                    self._load_errors |= job.load_targets(set(range(job.num_chunks)))
        self._collect()

    def wait_for_save(self, plan: StepPlan) -> None:
        for job in plan.store_jobs:
            self._submit(job, is_load=False)

    def _track(self, job: TransferJob) -> None:
        self._pending[job.job_id] = _Pending(job, len(job.parts))

    def _submit(self, job: TransferJob, is_load: bool) -> list[int]:
        self._track(job)
        if self.engine is None:  # no KV caches registered: nothing can move, the job fails
            self._finish(job.job_id, set(range(job.num_chunks)))
            return []
        ids = []
        for p, part in enumerate(job.parts):
            engine_id = job.job_id * _MAX_PARTS + p
            if is_load:
                self.engine.submit_load(engine_id, part.slot_ids, part.block_ids, part.group,
                                        skip_blocks=part.skip_blocks)
            else:
                self.engine.submit_store(engine_id, part.block_ids, part.slot_ids, part.group)
            ids.append(engine_id)
        return ids

    def _collect(self) -> None:
        if self.engine is None:
            return
        for result in self.engine.get_finished():
            job_id, p = divmod(result.job_id, _MAX_PARTS)
            pending = self._pending.get(job_id)
            if pending is None:
                continue
            offset = sum(len(part.slot_ids) for part in pending.job.parts[:p])
            pending.failed_chunks |= {offset + c for c in result.failed_chunks}
            pending.num_bytes += result.num_bytes
            pending.seconds += result.seconds
            pending.parts_left -= 1
            if pending.parts_left == 0:
                self._finish(job_id, pending.failed_chunks)

    def _finish(self, job_id: int, failed: set[int]) -> None:
        pending = self._pending.pop(job_id)
        job = pending.job
        direction = "store" if job.kind.value == "store" else "load"
        self._stats.add(f"{direction}_bytes", pending.num_bytes)
        self._stats.add(f"{direction}_seconds", pending.seconds)
        if direction == "load" and failed:
            self._load_errors |= job.load_targets(failed)
        self._reports.append(JobReport(job_id, not failed, tuple(sorted(failed)), pending.num_bytes,
                                       pending.seconds))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> KVTierWorkerMetadata | None:
        self._collect()
        reports, self._reports = self._reports, []
        return KVTierWorkerMetadata(reports) if reports else None

    def get_stats(self) -> KVTierStats | None:
        stats, self._stats = self._stats, KVTierStats()
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

