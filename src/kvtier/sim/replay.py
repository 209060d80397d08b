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

How much of a found prefix a request loads is decided as under vLLM, by the scheduler's
`kvtier.costmodel.choose_load` (`load_policy`), but with the fixed figures of the cost model
(`CostModel.snapshot`) in the modelled model's units: a chunk weighs one trace block of
`kv_bytes_per_token`, recomputes at `prefill_tokens_per_s`, and a promotion waits `step_s`.

Each request carries its client's hints (`TraceRequest.hints`, or those `options.hints` asks
`kvtier.sim.hints` to derive) to the scheduler as its `kv_transfer_params`; hint durations are
simulated seconds.

Generated tokens are computed but not offloaded (`offload_prompt_only`): a trace names its
prompt blocks only, so the KV of a reply can never match a later prompt in a replay; the
next turn's prompt names those tokens again, as new blocks.

Thread-safety: `simulate` builds everything it uses and is safe to call from several threads.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.base import OffloadingManager
from kvtier.build import build_manager
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.keys import OFFLOAD_KEY_BYTES
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim.fake_engine import FakeEngine, make_slab
from kvtier.sim.hints import replay_pace, with_hints
from kvtier.sim.kv_cache import KVCache
from kvtier.sim.options import SimOptions
from kvtier.sim.report import SimulationReport, read_report
from kvtier.sim.trace import TraceRequest
from kvtier.sim.workload import engine_output_tokens, engine_prompt
from kvtier.slab import HostSlab
from kvtier.tiers.disk.config import DiskConfig
from kvtier.tiers.disk.format import ChunkFormat
from kvtier.tiers.namespace import Namespace

__all__ = ["SimOptions", "simulate"]

# (requests finished, requests in the trace)
Progress = Callable[[int, int], None]


@dataclass
class SimClock:
    """The simulated clock: seconds, advanced by the replay."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(
    requests: Sequence[TraceRequest],
    options: SimOptions | None = None,
    progress: Progress | None = None,
) -> SimulationReport:
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
    requests = _hinted(requests, opts)
    started = time.perf_counter()
    num_slots = opts.slots_for(requests)
    with tempfile.TemporaryDirectory(prefix="kvtier-sim-") as scratch:
        engine, manager, clock = _build(opts, num_slots, Path(opts.disk_dir or scratch))
        try:
            num_steps = _replay(engine, manager, clock, requests, opts, progress)
            return read_report(
                engine, manager, requests, opts, num_slots, num_steps, time.perf_counter() - started
            )
        finally:
            manager.close()
            engine.close()


def _check_fits(requests: Sequence[TraceRequest], opts: SimOptions) -> None:
    scale = (opts.trace_block_tokens, opts.engine_block_tokens)
    block = opts.engine_block_tokens
    longest = max(
        (
            -(-(len(engine_prompt(r, *scale)) + engine_output_tokens(r, *scale)) // block)
            for r in requests
        ),
        default=0,
    )
    if longest > opts.engine_blocks:
        raise ConfigError(
            f"the trace's longest request needs {longest} engine blocks, the engine has "
            f"{opts.engine_blocks}: raise engine_blocks"
        )


def _hinted(requests: Sequence[TraceRequest], opts: SimOptions) -> Sequence[TraceRequest]:
    """The requests with the hints `opts.hints` asks for."""
    if opts.hints == "trace":
        return requests
    error = opts.hint_error if opts.hints == "noisy" else 0.0
    return with_hints(
        requests,
        replay_pace(requests, opts),
        error=error,
        seed=opts.hint_seed,
        block_tokens=opts.trace_block_tokens,
    )


def _build(
    opts: SimOptions, num_slots: int, disk_dir: Path
) -> tuple[FakeEngine, OffloadingManager, SimClock]:
    """The engine, its scheduler and the manager the configuration asks for, over one host slab."""
    block = opts.engine_block_tokens
    slab = make_slab(KVCache(1, opts.engine_blocks, block), 1, num_slots)
    try:
        manager = build_manager(
            _config(opts, slab, disk_dir),
            num_slots,
            OFFLOAD_KEY_BYTES,
            [slab.rows],
            _namespace(opts, slab),
        )
    except BaseException:
        slab.close()
        raise
    # one engine chunk stands for one trace block: the decisions weigh the modelled model's
    config = SchedulerOffloadConfig(
        groups=(GroupSpec(tokens_per_block=block),),
        max_defer_s=opts.max_defer_s,
        offload_prompt_only=opts.offload_prompt_only,
        store_mode=opts.store_mode,
        load_policy=opts.load_policy,
        chunk_bytes=opts.trace_block_tokens * opts.costs.kv_bytes_per_token,
    )
    costs = opts.costs.snapshot(step_s=opts.step_s, token_scale=opts.trace_block_tokens / block)
    clock = SimClock()
    scheduler = OffloadScheduler(config, manager, clock=clock, costs=costs)
    engine = FakeEngine(
        scheduler,
        num_blocks=opts.engine_blocks,
        block_size=block,
        clock=clock,
        slab=slab,
        max_tokens_per_step=1 << 30,
        check_content=opts.check_content,
        evict_lookahead=opts.evict_lookahead,
    )
    return engine, manager, clock


def _config(opts: SimOptions, slab: HostSlab, disk_dir: Path) -> KVTierConfig:
    disk = DiskConfig()
    if opts.disk_slots:
        file_bytes = ChunkFormat(bytes(16), slab.rows.shape[1]).file_bytes
        disk = DiskConfig(
            path=str(disk_dir),
            bytes=opts.disk_slots * file_bytes,
            write_mode=opts.disk_write_mode,
            eviction_policy=opts.disk_policy,
        )
    return KVTierConfig(
        eviction_policy=opts.policy,
        store_threshold=opts.store_threshold,
        enable_events=False,
        offload_prompt_only=opts.offload_prompt_only,
        disk=disk,
    )


def _namespace(opts: SimOptions, slab: HostSlab) -> Namespace:
    return Namespace(
        "kvtier-simulate",
        "int64",
        "sim",
        opts.engine_block_tokens,
        1,
        "sha256",
        1,
        int(slab.rows.shape[1]),
    )


def _replay(
    engine: FakeEngine,
    manager: OffloadingManager,
    clock: SimClock,
    requests: Sequence[TraceRequest],
    opts: SimOptions,
    progress: Progress | None,
) -> int:
    """Feed the requests in order, `max_running` at a time; returns the number of steps."""
    scale = (opts.trace_block_tokens, opts.engine_block_tokens)
    next_index = 0
    num_steps = 0
    max_steps = 1000 + 50 * len(requests)
    while True:
        while (
            next_index < len(requests)
            and len(engine.waiting) + len(engine.running) < opts.max_running
        ):
            req = requests[next_index]
            engine.add_request(
                str(next_index),
                engine_prompt(req, *scale),
                engine_output_tokens(req, *scale),
                kv_transfer_params=req.kv_transfer_params(),
            )
            next_index += 1
        if not (engine.waiting or engine.running):
            if progress is not None:
                progress(len(requests), len(requests))
            return num_steps
        if num_steps >= max_steps:
            raise RuntimeError(
                f"the replay made no progress in {max_steps} steps (a bug: please report it)"
            )
        engine.step()
        num_steps += 1
        clock.now += opts.step_s
        manager.drain(60.0)
        if progress is not None and num_steps % 64 == 0:
            progress(next_index - len(engine.waiting) - len(engine.running), len(requests))
