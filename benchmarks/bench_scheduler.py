"""The Mooncake conversation trace through the fake engine + OffloadScheduler +
CPUTierManager, against the same engine with offloading disabled.

Each trace block id (512 tokens) becomes one 16-token engine block whose tokens are
derived from the id, so prefix reuse is the trace's; outputs are scaled down by 32
too. Requests arrive as the engine frees room (4 waiting at most). Prints the time
the engine spends per request-step with and without kvtier (their ratio is the cost
kvtier adds to scheduling), kvtier's own share, and the token hit rate it delivers.

    python benchmarks/bench_scheduler.py [--quick]

Last line: RESULT sched_us_per_step=<kvtier µs per request-step> hit_rate=<token hit rate>
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import FakeEngine
from kvtier.tiers.cpu.manager import CPUTierManager
from mooncake import DEFAULT_TRACE, TraceRequest, load_trace

BLOCK = 16
SCALE = 512 // BLOCK


def block_tokens(hash_id: int) -> list[int]:
    return [(hash_id * 131 + i * 7) % 32000 for i in range(BLOCK)]


class TimedScheduler(OffloadScheduler):
    """Accumulates the wall time spent inside the scheduler's engine-facing calls."""

    seconds = 0.0


def _timed(name: str):
    inner = getattr(OffloadScheduler, name)

    def call(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    return call


for _name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
              "update_connector_output", "request_finished"):
    setattr(TimedScheduler, _name, _timed(_name))


def run(requests: list[TraceRequest], offload: bool, num_blocks: int, num_slots: int) -> dict:
    sched = None
    if offload:
        config = SchedulerOffloadConfig(groups=(GroupSpec(tokens_per_block=BLOCK),))
        sched = TimedScheduler(config, CPUTierManager(num_slots))
    engine = FakeEngine(sched, num_blocks=num_blocks, block_size=BLOCK, max_tokens_per_step=4096)
    request_steps = 0
    pending = list(reversed(requests))
    start = time.perf_counter()
    while pending or engine.waiting or engine.running:
        while pending and len(engine.waiting) < 4:
            i = len(requests) - len(pending)
            r = pending.pop()
            prompt = [t for h in r.hash_ids for t in block_tokens(h)] + [i % 997]
            engine.add_request(str(i), prompt, max_new_tokens=max(1, r.output_length // SCALE))
        request_steps += len(engine.running) + min(len(engine.waiting), 4)
        engine.step()
    seconds = time.perf_counter() - start
    reqs = engine.requests.values()
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    return {
        "seconds": seconds,
        "request_steps": request_steps,
        "kvtier_seconds": sched.seconds if sched else 0.0,
        "hit_rate": sum(r.num_external_tokens for r in reqs) / prompt_tokens,
        "local_rate": sum((r.num_cached_tokens or 0) - r.num_external_tokens for r in reqs) / prompt_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="first 1,000 requests")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--engine-blocks", type=int, default=2048, help="the engine's own KV blocks")
    parser.add_argument("--tier-slots", type=int, default=32768, help="kvtier CPU slots (chunks)")
    args = parser.parse_args()
    requests = load_trace(args.trace, limit=1000 if args.quick else None)
    print(f"{len(requests)} requests; engine {args.engine_blocks} blocks of {BLOCK} tokens; "
          f"kvtier {args.tier_slots} slots")
    base = run(requests, False, args.engine_blocks, args.tier_slots)
    ours = run(requests, True, args.engine_blocks, args.tier_slots)
    base_us = base["seconds"] / base["request_steps"] * 1e6
    ours_us = ours["seconds"] / ours["request_steps"] * 1e6
    sched_us = ours["kvtier_seconds"] / ours["request_steps"] * 1e6
    print(f"engine without kvtier: {base_us:8.1f} µs per request-step, engine prefix-cache hit rate "
          f"{base['local_rate']:.2%}")
    print(f"engine with kvtier:    {ours_us:8.1f} µs per request-step ({ours_us / base_us:.2f}x), of which "
          f"kvtier {sched_us:.1f} µs; engine hit rate {ours['local_rate']:.2%} + kvtier hit rate "
          f"{ours['hit_rate']:.2%}")
    print(f"RESULT sched_us_per_step={sched_us:.1f} hit_rate={ours['hit_rate']:.4f}")


if __name__ == "__main__":
    main()
