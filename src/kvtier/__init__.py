"""kvtier: tiered KV-cache offloading for LLM serving engines."""

from kvtier.base import (
    ChunkState,
    LoadSpec,
    LookupResult,
    ManagerStats,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    SlotSpec,
    StoreSpec,
)
from kvtier.costmodel.estimates import ReadEstimate
from kvtier.errors import ConfigError, InvariantError, KVTierError, NotReadyError
from kvtier.keys import BlockHash, BlockHasher, OffloadKey, make_offload_key, split_offload_key
from kvtier.policies import CachePolicy, make_policy, register_policy
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.registry import register_tier
from kvtier.tiers.secondary import SecondaryTier, TierDescriptor, TierJob, TierResult
from kvtier.tiers.tiered import TieredManager

__version__ = "0.1.0"

__all__ = [
    "BlockHash",
    "BlockHasher",
    "CPUTierManager",
    "CachePolicy",
    "ChunkState",
    "ConfigError",
    "DiskTier",
    "InvariantError",
    "KVTierError",
    "LoadSpec",
    "LookupResult",
    "ManagerStats",
    "Namespace",
    "NotReadyError",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReadEstimate",
    "ReqContext",
    "SecondaryTier",
    "SlotSpec",
    "StoreSpec",
    "TierDescriptor",
    "TierJob",
    "TierResult",
    "TierRules",
    "TieredManager",
    "make_offload_key",
    "make_policy",
    "register_policy",
    "register_tier",
    "split_offload_key",
]
