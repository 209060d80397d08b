"""`simulate`: replay a trace through the real kvtier, driven by the fake engine.

    from kvtier.sim import load_mooncake, simulate, SimOptions
    report = simulate(load_mooncake("mooncake_conversation.jsonl"), SimOptions(host_fraction=0.05))
    print(report.total_hit_rate, report.to_dict())

What runs is what runs under vLLM: the real `OffloadScheduler`, the manager
`kvtier.build.build_manager` makes from a `KVTierConfig` (the CPU tier with its
eviction policy and admission rule, and a real `DiskTier` in a scratch directory when
`disk_slots` is set), the real worker copying real (tiny) KV tensors to a shared-memory
host slab and back, and the fake engine (`kvtier.sim.fake_engine`) with a prefix cache of
`engine_blocks` blocks, which checks every block it attends to. Only the scale is reduced
(`kvtier.sim.workload`): one engine block of `engine_block_tokens` tokens per trace block.

How requests flow: in trace order, at most `max_running` of them in the engine at once (the
trace's timestamps order the requests; time between them is not replayed). Each engine step
advances a simulated clock by `step_s` — the clock the scheduler reads for its bounded
waits and job deadlines — and, with a disk tier, waits for the tier's reads and writes to
end (as if they took one step), so a replay is repeatable.

Generated tokens are computed but not offloaded (`offload_prompt_only`): a trace names its
prompt blocks only, so the KV of a reply can never match a later prompt in a replay; the
next turn's prompt names those tokens again, as new blocks.

Thread-safety: `simulate` builds everything it uses and is safe to call from several threads.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.base import OffloadingManager
from kvtier.build import build_manager
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.keys import OFFLOAD_KEY_BYTES
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim.costs import CostModel
from kvtier.sim.fake_engine import FakeEngine, make_slab
from kvtier.sim.kv_cache import KVCache
from kvtier.sim.report import SimulationReport
from kvtier.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest
from kvtier.sim.workload import engine_output_tokens, engine_prompt, num_unique_blocks
from kvtier.slab import HostSlab
from kvtier.tiers.disk.config import DiskConfig
from kvtier.tiers.disk.format import ChunkFormat
from kvtier.tiers.namespace import Namespace

__all__ = ["SimOptions", "simulate"]

Progress = Callable[[int, int], None]  # (requests finished, requests in the trace)


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
        step_s: simulated seconds per engine step.
        max_defer_s: the scheduler's bound on a request's wait, in simulated seconds.
        check_content: the fake engine checks every block a token attends to (a fast path
            skips it; the tests keep it on).
        offload_prompt_only: store prompt chunks only (see the module docstring).
        costs: the TTFT cost model (`kvtier.sim.costs`).
    """

    host_fraction: float = 0.05
    host_slots: int | None = None
    engine_blocks: int = 2048
    policy: str = "turns"  # the CPU tier's default (KVTierConfig.eviction_policy)
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
    costs: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if self.host_slots is None and not self.host_fraction > 0:
            raise ConfigError(f"host_fraction must be > 0, got {self.host_fraction}")
        if self.host_slots is not None and self.host_slots < 1:
            raise ConfigError(f"host_slots must be >= 1, got {self.host_slots}")
        if min(self.engine_blocks, self.engine_block_tokens, self.trace_block_tokens, self.max_running) < 1:
            raise ConfigError("engine_blocks, engine_block_tokens, trace_block_tokens and max_running must be >= 1")
        if self.disk_slots < 0 or self.step_s <= 0:
            raise ConfigError("disk_slots must be >= 0 and step_s > 0")
        if self.store_mode not in ("eager", "lazy"):
            raise ConfigError(f"store_mode: expected 'eager' or 'lazy', got {self.store_mode!r}")
        if self.evict_lookahead is not None and self.evict_lookahead < 1:
            raise ConfigError(f"evict_lookahead must be >= 1, got {self.evict_lookahead}")

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


@dataclass
class SimClock:
    """The simulated clock: seconds, advanced by the replay."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(requests: Sequence[TraceRequest], options: SimOptions | None = None,
             progress: Progress | None = None) -> SimulationReport:
    """Replay `requests` (see the module docstring) and report what kvtier did.

    Args:
        requests: the trace, in arrival order (`load_mooncake`, `synthetic`).
        options: what to simulate (default `SimOptions()`).
        progress: called now and then with (requests finished, requests in the trace).

    Raises:
        ConfigError: options that cannot run this trace (e.g. an engine cache smaller than
            its longest request).
    """
    opts = options or SimOptions()
    _check_fits(requests, opts)
    started = time.perf_counter()
    num_slots = opts.slots_for(requests)
    with tempfile.TemporaryDirectory(prefix="kvtier-sim-") as scratch:
        engine, manager, clock = _build(opts, num_slots, Path(opts.disk_dir or scratch))
        try:
            num_steps = _replay(engine, manager, clock, requests, opts, progress)
            return _report(engine, manager, requests, opts, num_slots, num_steps, time.perf_counter() - started)
        finally:
            manager.close()
            engine.close()


def _check_fits(requests: Sequence[TraceRequest], opts: SimOptions) -> None:
    scale, block = (opts.trace_block_tokens, opts.engine_block_tokens), opts.engine_block_tokens
    longest = max((-(-(len(engine_prompt(r, *scale)) + engine_output_tokens(r, *scale)) // block) for r in requests),
                  default=0)
    if longest > opts.engine_blocks:
        raise ConfigError(f"the trace's longest request needs {longest} engine blocks, the engine has "
                          f"{opts.engine_blocks}: raise engine_blocks")


def _build(opts: SimOptions, num_slots: int, disk_dir: Path) -> tuple[FakeEngine, OffloadingManager, SimClock]:
    """The engine, its scheduler and the manager the configuration asks for, over one host slab."""
    block = opts.engine_block_tokens
    slab = make_slab(KVCache(1, opts.engine_blocks, block), 1, num_slots)
    try:
        manager = build_manager(_config(opts, slab, disk_dir), num_slots, OFFLOAD_KEY_BYTES, [slab.rows],
                                _namespace(opts, slab))
    except BaseException:
        slab.close()
        raise
    config = SchedulerOffloadConfig(groups=(GroupSpec(tokens_per_block=block),), max_defer_s=opts.max_defer_s,
                                    offload_prompt_only=opts.offload_prompt_only, store_mode=opts.store_mode)
    clock = SimClock()
    scheduler = OffloadScheduler(config, manager, clock=clock)
    engine = FakeEngine(scheduler, num_blocks=opts.engine_blocks, block_size=block, clock=clock, slab=slab,
                        max_tokens_per_step=1 << 30, check_content=opts.check_content,
                        evict_lookahead=opts.evict_lookahead)
    return engine, manager, clock


def _config(opts: SimOptions, slab: HostSlab, disk_dir: Path) -> KVTierConfig:
    disk = DiskConfig()
    if opts.disk_slots:
        file_bytes = ChunkFormat(bytes(16), slab.rows.shape[1]).file_bytes
        disk = DiskConfig(path=str(disk_dir), bytes=opts.disk_slots * file_bytes, write_mode=opts.disk_write_mode,
                          eviction_policy=opts.disk_policy)
    return KVTierConfig(eviction_policy=opts.policy, store_threshold=opts.store_threshold, enable_events=False,
                        offload_prompt_only=opts.offload_prompt_only, disk=disk)


def _namespace(opts: SimOptions, slab: HostSlab) -> Namespace:
    return Namespace("kvtier-simulate", "int64", "sim", opts.engine_block_tokens, 1, "sha256", 1,
                     int(slab.rows.shape[1]))


def _replay(engine: FakeEngine, manager: OffloadingManager, clock: SimClock, requests: Sequence[TraceRequest],
            opts: SimOptions, progress: Progress | None) -> int:
    """Feed the requests in order, `max_running` at a time; returns the number of steps."""
    scale = (opts.trace_block_tokens, opts.engine_block_tokens)
    next_index = num_steps = 0
    max_steps = 1000 + 50 * len(requests)
    while True:
        while next_index < len(requests) and len(engine.waiting) + len(engine.running) < opts.max_running:
            req = requests[next_index]
            engine.add_request(str(next_index), engine_prompt(req, *scale), engine_output_tokens(req, *scale))
            next_index += 1
        if not (engine.waiting or engine.running):
            if progress is not None:
                progress(len(requests), len(requests))
            return num_steps
        if num_steps >= max_steps:
            raise RuntimeError(f"the replay made no progress in {max_steps} steps (a bug: please report it)")
        engine.step()
        num_steps += 1
        clock.now += opts.step_s
        manager.drain(60.0)
        if progress is not None and num_steps % 64 == 0:
            progress(next_index - len(engine.waiting) - len(engine.running), len(requests))


def _report(engine: FakeEngine, manager: OffloadingManager, requests: Sequence[TraceRequest], opts: SimOptions,
            num_slots: int, num_steps: int, wall_s: float) -> SimulationReport:
    stats = engine.scheduler.stats.as_dict() if engine.scheduler else {}
    engine_tokens, tier_hits, bytes_moved, evictions = _tier_figures(engine, manager, stats, opts)
    prompt_tokens = sum(r.input_length for r in requests)
    disk_tokens = sum(tokens for tier, tokens in tier_hits.items() if tier != "cpu")
    ttft = opts.costs.estimate(len(requests), prompt_tokens, engine_tokens, sum(tier_hits.values()), disk_tokens)
    return SimulationReport(
        num_requests=len(requests), prompt_tokens=prompt_tokens, unique_blocks=num_unique_blocks(requests),
        host_slots=num_slots, engine_blocks=opts.engine_blocks, policy=opts.label, engine_hit_tokens=engine_tokens,
        tier_hit_tokens=tier_hits, bytes_moved=bytes_moved, evictions=evictions, deferrals=stats.get("deferrals", 0),
        deferral_timeouts=stats.get("deferral_timeouts", 0), ttft=ttft, num_steps=num_steps, wall_s=wall_s,
        costs=opts.costs, counters=stats)


def _tier_figures(engine: FakeEngine, manager: OffloadingManager, stats: dict[str, int], opts: SimOptions
                  ) -> tuple[int, dict[str, int], dict[str, dict[str, int]], dict[str, int]]:
    """(engine hit tokens, hit tokens per tier, bytes per tier and direction, evictions per tier),
    in trace tokens and the modelled model's bytes."""
    block, trace_block = opts.engine_block_tokens, opts.trace_block_tokens
    engine_blocks = sum((r.num_cached_tokens or 0) - r.num_external_tokens for r in engine.requests.values()) // block
    kvtier_blocks = sum(r.num_external_tokens for r in engine.requests.values()) // block
    chunk_bytes = trace_block * opts.costs.kv_bytes_per_token
    bytes_moved = {"cpu": {"store": stats.get("stored_chunks", 0) * chunk_bytes,
                           "load": stats.get("loaded_chunks", 0) * chunk_bytes}}
    evictions = {"cpu": manager.stats().evictions}
    tier_hits = {"cpu": kvtier_blocks * trace_block}
    for tier in manager.tier_stats():
        counters = tier.counters
        bytes_moved[tier.medium] = {"store": counters["store_chunks"] * chunk_bytes,
                                    "load": counters["load_chunks"] * chunk_bytes}
        evictions[tier.medium] = counters["evictions"]
        # a chunk read up from this tier was found there, then loaded from RAM
        found = min(counters["load_chunks"] * trace_block, tier_hits["cpu"])
        tier_hits[tier.medium], tier_hits["cpu"] = found, tier_hits["cpu"] - found
    return engine_blocks * trace_block, tier_hits, bytes_moved, evictions
