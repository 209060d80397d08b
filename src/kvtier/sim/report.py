"""What a replay measured: `SimulationReport`, read off the engine, scheduler and manager.

Hit rates are in trace tokens (see `kvtier.sim.workload`): a block a cache served counts
as `trace_block_tokens` tokens, over the trace's prompt tokens. Bytes are the modelled
model's (`CostModel.kv_bytes_per_token`), not the simulator's tiny tensors.

- `engine_hit_rate`: prefix tokens the engine's own cache served;
- `kvtier_hit_rate`: tokens kvtier loaded; `tier_hit_rates` splits them by where the chunk
  was found: `cpu` (RAM) or a secondary tier (read up into RAM first, a promotion);
- `total_hit_rate`: the two together, the figure Belady's MIN bounds;
- `bytes_moved[tier][direction]`: `cpu` store = engine to RAM, load = RAM to engine;
  a secondary tier's store = RAM to it, load = it to RAM;
- `evictions[tier]`, `deferrals` and `deferral_timeouts` as the scheduler counts them;
- `load_decisions[decision][tier]`: the scheduler's load-or-recompute decisions under
  `load_policy` ("load", "partial", "recompute"; the tier: for a load, the slowest one it
  reads from, otherwise that of the first chunk left to recompute);
- `ttft`: the cost model's estimate (`kvtier.sim.costs`), the loads at the seconds their
  decisions expected.

Thread-safety: plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.base import OffloadingManager
from kvtier.sim.costs import CostModel, TTFTEstimate
from kvtier.sim.fake_engine import FakeEngine
from kvtier.sim.options import SimOptions
from kvtier.sim.trace import TraceRequest
from kvtier.sim.workload import num_unique_blocks

__all__ = ["SimulationReport", "read_report"]


@dataclass(slots=True)
class SimulationReport:
    """The figures of one replay (see the module docstring)."""

    num_requests: int
    prompt_tokens: int
    unique_blocks: int
    host_slots: int
    engine_blocks: int
    policy: str
    engine_hit_tokens: int
    tier_hit_tokens: dict[str, int]
    bytes_moved: dict[str, dict[str, int]]
    evictions: dict[str, int]
    deferrals: int
    deferral_timeouts: int
    ttft: TTFTEstimate
    num_steps: int
    wall_s: float
    costs: CostModel = field(default_factory=CostModel)
    # the scheduler's own, for the curious
    counters: dict[str, int] = field(default_factory=dict)
    load_policy: str = "cost"
    load_decisions: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def kvtier_hit_tokens(self) -> int:
        return sum(self.tier_hit_tokens.values())

    @property
    def engine_hit_rate(self) -> float:
        return self._rate(self.engine_hit_tokens)

    @property
    def kvtier_hit_rate(self) -> float:
        return self._rate(self.kvtier_hit_tokens)

    @property
    def total_hit_rate(self) -> float:
        return self._rate(self.engine_hit_tokens + self.kvtier_hit_tokens)

    @property
    def tier_hit_rates(self) -> dict[str, float]:
        return {tier: self._rate(tokens) for tier, tokens in self.tier_hit_tokens.items()}

    def to_dict(self) -> dict[str, Any]:
        """Every figure, JSON-ready (`kvtier simulate --json`)."""
        return {
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "unique_blocks": self.unique_blocks,
            "host_slots": self.host_slots,
            "engine_blocks": self.engine_blocks,
            "policy": self.policy,
            "engine_hit_rate": self.engine_hit_rate,
            "kvtier_hit_rate": self.kvtier_hit_rate,
            "total_hit_rate": self.total_hit_rate,
            "tier_hit_rates": self.tier_hit_rates,
            "engine_hit_tokens": self.engine_hit_tokens,
            "tier_hit_tokens": dict(self.tier_hit_tokens),
            "bytes_moved": {t: dict(d) for t, d in self.bytes_moved.items()},
            "evictions": dict(self.evictions),
            "deferrals": self.deferrals,
            "deferral_timeouts": self.deferral_timeouts,
            "ttft": self.ttft.to_dict(),
            "costs": self.costs.to_dict(),
            "num_steps": self.num_steps,
            "wall_s": self.wall_s,
            "counters": dict(self.counters),
            "load_policy": self.load_policy,
            "load_decisions": {d: dict(by_tier) for d, by_tier in self.load_decisions.items()},
        }

    def _rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def read_report(
    engine: FakeEngine,
    manager: OffloadingManager,
    requests: Sequence[TraceRequest],
    opts: SimOptions,
    num_slots: int,
    num_steps: int,
    wall_s: float,
) -> SimulationReport:
    """The figures of a replay that ended (see the module docstring)."""
    stats = engine.scheduler.stats.as_dict() if engine.scheduler else {}
    engine_tokens, tier_hits, bytes_moved, evictions = _tier_figures(engine, manager, stats, opts)
    prompt_tokens = sum(r.input_length for r in requests)
    ttft = opts.costs.estimate(
        len(requests),
        prompt_tokens,
        engine_tokens,
        sum(tier_hits.values()),
        load_s=stats.get("expected_load_us", 0) / 1e6,
    )
    return SimulationReport(
        num_requests=len(requests),
        prompt_tokens=prompt_tokens,
        unique_blocks=num_unique_blocks(requests),
        host_slots=num_slots,
        engine_blocks=opts.engine_blocks,
        policy=opts.label,
        engine_hit_tokens=engine_tokens,
        tier_hit_tokens=tier_hits,
        bytes_moved=bytes_moved,
        evictions=evictions,
        deferrals=stats.get("deferrals", 0),
        deferral_timeouts=stats.get("deferral_timeouts", 0),
        ttft=ttft,
        num_steps=num_steps,
        wall_s=wall_s,
        costs=opts.costs,
        counters=stats,
        load_policy=opts.load_policy,
        load_decisions=_decisions(engine),
    )


def _decisions(engine: FakeEngine) -> dict[str, dict[str, int]]:
    """{decision: {tier: count}} from the scheduler's (decision, tier) counter."""
    out: dict[str, dict[str, int]] = {}
    if engine.scheduler is not None:
        for (decision, tier), count in sorted(engine.scheduler.stats.load_decisions.items()):
            out.setdefault(decision, {})[tier] = count
    return out


def _tier_figures(
    engine: FakeEngine, manager: OffloadingManager, stats: dict[str, int], opts: SimOptions
) -> tuple[int, dict[str, int], dict[str, dict[str, int]], dict[str, int]]:
    """(engine hit tokens, hit tokens per tier, bytes per tier and direction, evictions per tier),
    in trace tokens and the modelled model's bytes."""
    block = opts.engine_block_tokens
    trace_block = opts.trace_block_tokens
    engine_blocks = (
        sum((r.num_cached_tokens or 0) - r.num_external_tokens for r in engine.requests.values())
        // block
    )
    kvtier_blocks = sum(r.num_external_tokens for r in engine.requests.values()) // block
    chunk_bytes = trace_block * opts.costs.kv_bytes_per_token
    bytes_moved = {
        "cpu": {
            "store": stats.get("stored_chunks", 0) * chunk_bytes,
            "load": stats.get("loaded_chunks", 0) * chunk_bytes,
        }
    }
    evictions = {"cpu": manager.stats().evictions}
    tier_hits = {"cpu": kvtier_blocks * trace_block}
    for tier in manager.tier_stats():
        counters = tier.counters
        bytes_moved[tier.medium] = {
            "store": counters["store_chunks"] * chunk_bytes,
            "load": counters["load_chunks"] * chunk_bytes,
        }
        evictions[tier.medium] = counters["evictions"]
        # a chunk read up from this tier was found there, then loaded from RAM
        found = min(counters["load_chunks"] * trace_block, tier_hits["cpu"])
        tier_hits[tier.medium] = found
        tier_hits["cpu"] -= found
    return engine_blocks * trace_block, tier_hits, bytes_moved, evictions
