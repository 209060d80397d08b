"""Simulation: a fake engine that drives the real scheduler, tiers and worker, and the
trace replays built on it (`kvtier simulate`).

    from kvtier.sim import SimOptions, load_mooncake, simulate, sweep, synthetic

- `load_mooncake(path)` / `synthetic(...)` / `agentic(...)`: traces (`kvtier.sim.trace`,
  `kvtier.sim.synthetic`, `kvtier.sim.agentic`); `with_hints(requests, pace)`: each request with
  its client's hints (`kvtier.sim.hints`; or `SimOptions(hints="exact")`);
- `simulate(requests, SimOptions(...))` -> `SimulationReport` (`kvtier.sim.replay`);
- `sweep(requests, capacities, policies, out_dir)` -> `SweepResult`, a CSV and a PNG
  (`kvtier.sim.sweep`), with Belady's MIN (`kvtier.sim.belady`) as the ceiling;
- `CostModel`: the figures a replay's load decisions use and the TTFT estimate's assumptions
  (`kvtier.sim.costs`).
"""

from kvtier.sim.agentic import agentic
from kvtier.sim.belady import belady_hit_rate, belady_hits
from kvtier.sim.costs import CostModel, TTFTEstimate
from kvtier.sim.fake_engine import FakeEngine, SimRequest
from kvtier.sim.faults import Faults, SimTransferEngine
from kvtier.sim.hints import replay_pace, with_hints
from kvtier.sim.kv_cache import ContentMismatch, KVCache
from kvtier.sim.options import SimOptions
from kvtier.sim.replay import simulate
from kvtier.sim.report import SimulationReport
from kvtier.sim.sweep import SweepPoint, SweepResult, sweep
from kvtier.sim.synthetic import synthetic
from kvtier.sim.trace import ClientHints, TraceError, TraceRequest, load_mooncake, parse_mooncake

__all__ = [
    "ClientHints",
    "ContentMismatch",
    "CostModel",
    "FakeEngine",
    "Faults",
    "KVCache",
    "SimOptions",
    "SimRequest",
    "SimTransferEngine",
    "SimulationReport",
    "SweepPoint",
    "SweepResult",
    "TTFTEstimate",
    "TraceError",
    "TraceRequest",
    "agentic",
    "belady_hit_rate",
    "belady_hits",
    "load_mooncake",
    "parse_mooncake",
    "replay_pace",
    "simulate",
    "sweep",
    "synthetic",
    "with_hints",
]
