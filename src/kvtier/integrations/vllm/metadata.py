"""What crosses between kvtier's scheduler-side and worker-side connector halves."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.jobs import JobResult, StepPlan

__all__ = ["KVTierMetadata", "KVTierWorkerMetadata"]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """Scheduler -> workers: this step's plan."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: one result per finished job per worker; on a worker's first
    report, the number of slots its host slab has (the scheduler checks they agree)."""

    results: list[JobResult] = field(default_factory=list)
    slab_slots: tuple[int, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        if not isinstance(other, KVTierWorkerMetadata):
            return self
        return KVTierWorkerMetadata(
            self.results + other.results, self.slab_slots + other.slab_slots
        )
