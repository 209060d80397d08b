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
- `evictions[tier]`, `deferrals` and `deferral_timeouts` as the scheduler counts them.

Thread-safety: plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.sim.costs import CostModel, TTFTEstimate

__all__ = ["SimulationReport"]


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
    counters: dict[str, int] = field(default_factory=dict)  # the scheduler's own, for the curious

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
            "num_requests": self.num_requests, "prompt_tokens": self.prompt_tokens,
            "unique_blocks": self.unique_blocks, "host_slots": self.host_slots, "engine_blocks": self.engine_blocks,
            "policy": self.policy, "engine_hit_rate": self.engine_hit_rate, "kvtier_hit_rate": self.kvtier_hit_rate,
            "total_hit_rate": self.total_hit_rate, "tier_hit_rates": self.tier_hit_rates,
            "engine_hit_tokens": self.engine_hit_tokens, "tier_hit_tokens": dict(self.tier_hit_tokens),
            "bytes_moved": {t: dict(d) for t, d in self.bytes_moved.items()}, "evictions": dict(self.evictions),
            "deferrals": self.deferrals, "deferral_timeouts": self.deferral_timeouts,
            "ttft": self.ttft.to_dict(), "costs": self.costs.to_dict(), "num_steps": self.num_steps,
            "wall_s": self.wall_s, "counters": dict(self.counters),
        }

    def _rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0
