"""The engine-agnostic scheduler side: per-request state, bounded waiting, store
selection and transfer jobs. Adapters (vLLM, the fake engine) drive `OffloadScheduler`.
"""

from kvtier.scheduler.config import GroupKind, GroupSpec, SchedulerOffloadConfig
from kvtier.scheduler.core import OffloadScheduler
from kvtier.scheduler.params import OffloadParams, parse_kv_transfer_params
from kvtier.scheduler.state import RequestGroupState, RequestOffloadState
from kvtier.scheduler.stats import SchedulerStats
from kvtier.scheduler.types import RequestView, ScheduledBatch, ScheduledRequest, StepView

__all__ = [
    "GroupKind",
    "GroupSpec",
    "OffloadParams",
    "OffloadScheduler",
    "RequestGroupState",
    "RequestOffloadState",
    "RequestView",
    "ScheduledBatch",
    "ScheduledRequest",
    "SchedulerOffloadConfig",
    "SchedulerStats",
    "StepView",
    "parse_kv_transfer_params",
]
