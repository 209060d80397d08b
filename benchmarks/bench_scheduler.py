"""The Mooncake conversation trace through the fake engine + OffloadScheduler +
CPUTierManager, against the same engine with offloading disabled.

Each trace block id (512 tokens) becomes one 16-token engine block whose tokens are
derived from the id, so prefix reuse is the trace's; outputs are scaled down by 32
too. Requests arrive as the engine frees room (4 waiting at most). Prints the time
the engine spends per request-step with and without kvtier (their ratio is the cost
kvtier adds to scheduling), kvtier's own share, and the token hit rate it delivers.

    python benchmarks/bench_scheduler.py [--quick]

Last line: RESULT sched_us_per_step=<kvtier µs per request-step> hit_rate=<token hit rate>

`--prefix-lengths 1024,16384,131072` measures instead what one long request costs the scheduler
side as its prefix grows (issue 32): a prompt of each length, prefilled 2,048 tokens a step and
stored as it is computed, then 512 decoded tokens (a chunk stored every 16), with the engine and
the CPU tier (`--policy`, the connector's default `adaptive`) large enough to hold it all. Per
length: µs per step in prefill and in decode, and µs per stored chunk; the baseline is the
shortest prefix, measured in the same run. Last line:
RESULT long_prompt_us_per_chunk=<per length, '/'-separated> flat_ratio=<longest / shortest per chunk>
decode_us_per_step=<per length> decode_flat_ratio=<longest / shortest>
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

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


for _name in (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
):
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
        "local_rate": sum((r.num_cached_tokens or 0) - r.num_external_tokens for r in reqs)
        / prompt_tokens,
    }


# A forward pass runs between two scheduler calls: the scheduler's data is out of the caches by
# then. The fake engine's own bookkeeping evicts it at long prompts only (the 131k-token one walks
# 8,000 blocks a step), which alone doubled kvtier's measured µs per decode step there; so every
# step starts by walking a buffer larger than the last-level cache, at every length alike.
_COLD_CACHE_BYTES = 64 << 20


def run_long_prompt(num_prompt_tokens: int, policy: str, num_decode_tokens: int = 512) -> dict:
    """One request of `num_prompt_tokens`: kvtier's µs per prefill step and per chunk it stored, and
    per decode step."""
    num_blocks = (num_prompt_tokens + num_decode_tokens) // BLOCK + 64
    config = SchedulerOffloadConfig(groups=(GroupSpec(tokens_per_block=BLOCK),))
    sched = TimedScheduler(config, CPUTierManager(num_blocks, policy=policy))
    engine = FakeEngine(
        sched,
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_tokens_per_step=2048,
        check_content=False,
    )
    cold = np.zeros(_COLD_CACHE_BYTES // 8)
    try:
        prompt = [(i * 7919) % 32000 for i in range(num_prompt_tokens)]
        request = engine.add_request("long", prompt, max_new_tokens=num_decode_tokens)
        seconds = {"prefill": 0.0, "decode": 0.0}
        steps = {"prefill": 0, "decode": 0}
        stored = {"prefill": 0, "decode": 0}
        while engine.waiting or engine.running:
            phase = "prefill" if request.num_computed < num_prompt_tokens else "decode"
            np.add(cold, 1.0, out=cold)
            before = sched.seconds
            stored_before = sched.stats.stored_chunks
            engine.step()
            seconds[phase] += sched.seconds - before
            steps[phase] += 1
            stored[phase] += sched.stats.stored_chunks - stored_before
    finally:
        engine.close()
    return {
        "prefill_us_per_step": seconds["prefill"] / steps["prefill"] * 1e6,
        "prefill_us_per_chunk": seconds["prefill"] / max(1, stored["prefill"]) * 1e6,
        "decode_us_per_step": seconds["decode"] / steps["decode"] * 1e6,
        "stored": stored["prefill"] + stored["decode"],
    }


def long_prompts(lengths: list[int], policy: str, rounds: int) -> None:
    print(
        f"one request per prefix length; blocks of {BLOCK} tokens, 2,048 tokens per prefill step, "
        f"512 decoded; policy {policy}; best of {rounds} interleaved rounds",
        flush=True,
    )
    runs: dict[int, list[dict]] = {n: [] for n in lengths}
    for _ in range(rounds):
        for n in lengths:
            runs[n].append(run_long_prompt(n, policy))
    best = {n: {k: min(r[k] for r in results) for k in results[0]} for n, results in runs.items()}
    for n, r in best.items():
        print(
            f"{n:>7} tokens: {r['prefill_us_per_step']:9.1f} µs per prefill step, {r['prefill_us_per_chunk']:6.2f} "
            f"µs per chunk stored in prefill, {r['decode_us_per_step']:6.1f} µs per decode step "
            f"({r['stored']:.0f} chunks stored)"
        )
    short = best[min(lengths)]
    long = best[max(lengths)]
    per_chunk = "/".join(f"{best[n]['prefill_us_per_chunk']:.2f}" for n in lengths)
    decode = "/".join(f"{best[n]['decode_us_per_step']:.1f}" for n in lengths)
    print(
        f"RESULT long_prompt_us_per_chunk={per_chunk} "
        f"flat_ratio={long['prefill_us_per_chunk'] / short['prefill_us_per_chunk']:.2f} "
        f"decode_us_per_step={decode} "
        f"decode_flat_ratio={long['decode_us_per_step'] / short['decode_us_per_step']:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="first 1,000 requests (with --prefix-lengths: 1 round)"
    )
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument(
        "--engine-blocks", type=int, default=2048, help="the engine's own KV blocks"
    )
    parser.add_argument("--tier-slots", type=int, default=32768, help="kvtier CPU slots (chunks)")
    parser.add_argument(
        "--prefix-lengths", help="comma-separated prompt lengths: one long request each"
    )
    parser.add_argument(
        "--policy", default="adaptive", help="the CPU tier's policy (with --prefix-lengths)"
    )
    args = parser.parse_args()
    if args.prefix_lengths:
        long_prompts(
            [int(n) for n in args.prefix_lengths.split(",")], args.policy, 1 if args.quick else 3
        )
        return
    requests = load_trace(args.trace, limit=1000 if args.quick else None)
    print(
        f"{len(requests)} requests; engine {args.engine_blocks} blocks of {BLOCK} tokens; "
        f"kvtier {args.tier_slots} slots"
    )
    base = run(requests, False, args.engine_blocks, args.tier_slots)
    ours = run(requests, True, args.engine_blocks, args.tier_slots)
    base_us = base["seconds"] / base["request_steps"] * 1e6
    ours_us = ours["seconds"] / ours["request_steps"] * 1e6
    sched_us = ours["kvtier_seconds"] / ours["request_steps"] * 1e6
    print(
        f"engine without kvtier: {base_us:8.1f} µs per request-step, engine prefix-cache hit rate "
        f"{base['local_rate']:.2%}"
    )
    print(
        f"engine with kvtier:    {ours_us:8.1f} µs per request-step ({ours_us / base_us:.2f}x), of which "
        f"kvtier {sched_us:.1f} µs; engine hit rate {ours['local_rate']:.2%} + kvtier hit rate "
        f"{ours['hit_rate']:.2%}"
    )
    print(f"RESULT sched_us_per_step={sched_us:.1f} hit_rate={ours['hit_rate']:.4f}")


if __name__ == "__main__":
    main()
