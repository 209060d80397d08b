"""What crosses between kvtier's scheduler-side and worker-side connector halves."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.scheduler import JobReport, StepPlan

__all__ = ["KVTierMetadata", "KVTierWorkerMetadata"]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """Scheduler -> workers: this step's plan."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: one report per finished job per worker."""

    reports: list[JobReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        extra = other.reports if isinstance(other, KVTierWorkerMetadata) else []
        return KVTierWorkerMetadata(self.reports + extra)
