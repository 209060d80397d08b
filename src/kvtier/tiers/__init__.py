"""Tiers: places that hold offloaded chunks (cpu is the primary one)."""

from kvtier.tiers.cpu import CPUTierManager

__all__ = ["CPUTierManager"]
