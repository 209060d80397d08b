"""Simulation: a fake engine and worker that drive the real scheduler and tiers."""

from kvtier.sim.fake_engine import ContentMismatch, FakeEngine, SimRequest
from kvtier.sim.fake_worker import FakeWorker

__all__ = ["ContentMismatch", "FakeEngine", "FakeWorker", "SimRequest"]
