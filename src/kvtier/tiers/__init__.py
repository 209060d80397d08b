"""Tiers: places that hold offloaded chunks. `cpu` is the primary one (its slab in shared
memory, `slab`); `disk` is a secondary tier (the contract: `secondary`); `tiered` puts them
together (`cascade`: how chunks flow down); `build` picks what a configuration asks for."""

from kvtier.tiers.cpu import CPUTierManager
from kvtier.tiers.tiered import TieredManager

__all__ = ["CPUTierManager", "TieredManager"]
