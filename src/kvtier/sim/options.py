"""What a replay simulates: `SimOptions`, every knob of `kvtier.sim.replay.simulate` (and, one
flag per field, of `kvtier simulate`).

Thread-safety: an immutable value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.costmodel import LOAD_POLICIES
from kvtier.errors import ConfigError
from kvtier.sim.costs import CostModel
from kvtier.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest
from kvtier.sim.workload import num_unique_blocks

__all__ = ["HINT_MODES", "SimOptions"]

# see SimOptions.hints
HINT_MODES = ("trace", "exact", "noisy")


@dataclass(frozen=True, slots=True)
class SimOptions:
    """What to simulate.

    Args:
        host_fraction: the CPU tier's slots as a fraction of the trace's distinct blocks.
        host_slots: the CPU tier's slots (chunks), overriding `host_fraction`.
        engine_blocks: the engine's own KV cache, in blocks (one per trace block).
        policy: the CPU tier's eviction policy (`kvtier.policies.policy_names()`).
        store_mode: "eager" (store chunks once computed) or "lazy" (once the engine is about to
            evict them; see `kvtier.scheduler.lazy`).
        evict_lookahead: lazy mode: how many block allocations ahead the engine reports the
            cached blocks they will evict (default: twice the most one step allocated so far,
            as vLLM's lazy offloading looks two steps' worth of tokens ahead).
        store_threshold: store a chunk on its N-th offer (1: always).
        disk_slots: a disk tier of this many chunks behind the CPU tier (0: none).
        disk_write_mode: which chunks the disk tier gets: "write_through" (every chunk stored in
            RAM) or "on_evict" (those RAM evicts).
        disk_policy: the disk tier's eviction policy.
        disk_dir: where the disk tier writes (default: a scratch directory, removed after).
        trace_block_tokens: tokens per trace hash id (512 in Mooncake's traces).
        engine_block_tokens: tokens per engine block in the replay (the scale; see `workload`).
        max_running: requests in the engine at once.
        step_s: simulated seconds per engine step (in the load decisions too: a request whose
            chunks come up from disk waits a step at least).
        max_defer_s: the scheduler's bound on a request's wait, in simulated seconds.
        check_content: the fake engine checks every block a token attends to (a fast path
            skips it; the tests keep it on).
        offload_prompt_only: store prompt chunks only (see `kvtier.sim.replay`).
        load_policy: "cost": load as much of a found prefix as the cost model's expected time to
            first token says (`kvtier.costmodel.choose_load`); "always": all of it.
        costs: the cost model, for the load decisions and the TTFT estimate (`kvtier.sim.costs`).
        hints: what the requests tell kvtier in their `kv_transfer_params` (issue 23): "trace" (the
            hints the requests carry; a trace file carries none), "exact" (their clients' hints,
            derived from the trace's conversations by `kvtier.sim.hints`) or "noisy" (the same,
            each wrong with probability `hint_error`).
        hint_error: "noisy": the share of requests whose hint is wrong.
        hint_seed: "noisy": the seed that picks them.
    """

    host_fraction: float = 0.05
    host_slots: int | None = None
    engine_blocks: int = 2048
    # the CPU tier's default (KVTierConfig.eviction_policy)
    policy: str = "adaptive"
    store_mode: str = "eager"
    evict_lookahead: int | None = None
    store_threshold: int = 1
    disk_slots: int = 0
    disk_write_mode: str = "write_through"
    disk_policy: str = "lru"
    disk_dir: str | None = None
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    engine_block_tokens: int = 2
    max_running: int = 16
    step_s: float = 0.05
    max_defer_s: float = 2.0
    check_content: bool = True
    offload_prompt_only: bool = True
    load_policy: str = "cost"
    costs: CostModel = field(default_factory=CostModel)
    hints: str = "trace"
    hint_error: float = 0.2
    hint_seed: int = 0

    def __post_init__(self) -> None:
        if self.host_slots is None and not self.host_fraction > 0:
            raise ConfigError(f"host_fraction must be > 0, got {self.host_fraction}")
        if self.host_slots is not None and self.host_slots < 1:
            raise ConfigError(f"host_slots must be >= 1, got {self.host_slots}")
        if (
            min(
                self.engine_blocks,
                self.engine_block_tokens,
                self.trace_block_tokens,
                self.max_running,
            )
            < 1
        ):
            raise ConfigError(
                "engine_blocks, engine_block_tokens, trace_block_tokens and max_running must be >= 1"
            )
        if self.disk_slots < 0 or self.step_s <= 0:
            raise ConfigError("disk_slots must be >= 0 and step_s > 0")
        if self.store_mode not in ("eager", "lazy"):
            raise ConfigError(f"store_mode: expected 'eager' or 'lazy', got {self.store_mode!r}")
        if self.evict_lookahead is not None and self.evict_lookahead < 1:
            raise ConfigError(f"evict_lookahead must be >= 1, got {self.evict_lookahead}")
        if self.load_policy not in LOAD_POLICIES:
            raise ConfigError(
                f"load_policy: expected one of {', '.join(LOAD_POLICIES)}, got {self.load_policy!r}"
            )
        if self.hints not in HINT_MODES or not 0.0 <= self.hint_error <= 1.0:
            raise ConfigError(
                f"hints: expected one of {', '.join(HINT_MODES)} and 0 <= hint_error <= 1, "
                f"got {self.hints!r} and {self.hint_error}"
            )

    @property
    def label(self) -> str:
        """The store policy's name in reports: the eviction policy, prefixed "lazy-" in lazy mode."""
        return self.policy if self.store_mode == "eager" else f"lazy-{self.policy}"

    @classmethod
    def parse_label(cls, label: str) -> dict[str, str]:
        """`label`'s inverse: {"policy": ..., "store_mode": ...} for "lru", "lazy-lru", "eager-arc"..."""
        mode, _, policy = label.rpartition("-")
        if mode in ("eager", "lazy"):
            return {"policy": policy, "store_mode": mode}
        return {"policy": label, "store_mode": "eager"}

    def slots_for(self, requests: Sequence[TraceRequest]) -> int:
        """The CPU tier's slots for this trace."""
        if self.host_slots is not None:
            return self.host_slots
        return max(1, round(self.host_fraction * num_unique_blocks(requests)))
