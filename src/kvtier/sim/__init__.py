"""Simulation: a fake engine that drives the real scheduler, tiers and worker."""

from kvtier.sim.fake_engine import FakeEngine, SimRequest
from kvtier.sim.faults import Faults, SimTransferEngine
from kvtier.sim.kv_cache import ContentMismatch, KVCache

__all__ = ["ContentMismatch", "FakeEngine", "Faults", "KVCache", "SimRequest", "SimTransferEngine"]
