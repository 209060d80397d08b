"""Tiers: places that hold offloaded chunks — a library that imports no user configuration and
no torch. `cpu/` is the primary tier (its bytes live in the host slab, `kvtier.slab`); `disk/`
and `remote/` are secondary tiers (the contract: `secondary`); `tiered` puts them together
(`cascade`: how chunks flow down; `flights`: tier jobs in flight and their deadlines;
`admission`: the reuse gate; `workers`: a secondary tier's thread pools). `registry` knows every
tier by name: its descriptor and configuration slice (`register_tier` adds an out-of-tree one)."""

from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.registry import register_tier, tier_descriptor, tier_descriptors
from kvtier.tiers.secondary import SecondaryTier, TierDescriptor
from kvtier.tiers.tiered import TieredManager

__all__ = [
    "CPUTierManager",
    "SecondaryTier",
    "TierDescriptor",
    "TieredManager",
    "register_tier",
    "tier_descriptor",
    "tier_descriptors",
]
