"""How soon a tier that the load-or-recompute decision wrote off is loaded from again once it
recovers, and what exploring costs while it really is slow (issue 32, defect 2), in real time
against a real `redis-server`.

The real stack (fake engine, `OffloadScheduler`, `TieredManager` with a Redis tier) with tiny
chunks (4 tokens), and the engine's prefill pinned at 40 tokens/s (0.1 s a chunk: what the
decision weighs a Redis read against), so that only the tier's own speed decides:

- **stall**: Redis is stopped (SIGSTOP) for 1.5 s while a request promotes 3 chunks from it, with
  `job_timeout_s` 0.5 s: the reads expire and write Redis off. Then Redis answers at full speed,
  and a request arrives every 50 ms, each with a prefix only in Redis. Printed: when the first
  request loads from Redis again, and how many of the requests load, against a baseline of the
  same stream through a fresh stack whose Redis never stalled.
- **slow**: Redis behind a 0.5 s-latency link (`servers/throttle.py`): reading a chunk takes
  longer than recomputing it, for real. A request every 50 ms for `--seconds`: how many
  explorations read from it, how many requests loaded from it (none should), and how long the
  requests waited for it (`deferrals`: the idle steps requests spent waiting; none should).

    python benchmarks/bench_recovery.py [--quick] [--seconds S]

Last line: RESULT recovery_s=<first load after the resume> loads_vs_fresh=<loads after the stall /
loads of the fresh stack> slow_explorations_per_s=<x> slow_loads=<n> slow_deferrals=<n>
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvtier.costmodel import PrefillRate
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import FakeEngine, KVCache
from kvtier.sim.fake_engine import make_slab
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.redis import RedisStore
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.tiered import TieredManager
from servers.redis import RedisServer
from servers.throttle import ThrottledProxy

BLOCK = 4
# 3 chunks
PREFIX_TOKENS = 12
# between two requests
GAP_S = 0.05
STALL_S = 1.5
TIER_JOB_TIMEOUT_S = 0.5


class Stack:
    """The real stack over a Redis tier at `url`, its prefill speed pinned."""

    def __init__(self, url: str, num_prefixes: int):
        self.slab = make_slab(KVCache(1, 32, BLOCK), 1, 4)
        namespace = Namespace(
            "bench-recovery", "float32", "sim", BLOCK, 1, "sha256", 1, self.slab.rows.shape[1]
        )
        self.tier = RemoteTier(
            RedisStore(url, timeout_ms=5000), namespace, prefix=f"recovery-{time.time_ns()}"
        )
        self.manager = TieredManager(
            CPUTierManager(4),
            [self.slab.rows],
            [(self.tier, TierRules())],
            job_timeout_s=TIER_JOB_TIMEOUT_S,
        )
        config = SchedulerOffloadConfig(
            groups=(GroupSpec(tokens_per_block=BLOCK),),
            max_defer_s=5.0,
            max_deferrals=10**6,
            chunk_bytes=self.slab.rows.shape[1],
        )
        self.scheduler = OffloadScheduler(config, self.manager)
        # never measured
        self.scheduler.costs.prefill = PrefillRate(prior_tokens_per_s=40.0, min_tokens=10**9)
        self.engine = FakeEngine(self.scheduler, num_blocks=32, block_size=BLOCK, slab=self.slab)
        self.prefixes = [prompt(PREFIX_TOKENS, seed=s) for s in range(1, 1 + num_prefixes)]

    def store_prefixes(self) -> None:
        """Every prefix computed once (into Redis), then pushed out of the 4-slot RAM tier."""
        for i, p in enumerate(self.prefixes):
            self.serve(f"first-{i}", p)
            self.tier.drain(10.0)
        for i in range(2):
            # (seeds equal mod 1000 collide)
            self.serve(f"filler-{i}", prompt(PREFIX_TOKENS, seed=900 + i))
            self.tier.drain(10.0)

    def serve(self, req_id: str, tokens: list[int]):
        request = self.engine.add_request(req_id, tokens, 1)
        deadline = time.monotonic() + 60.0
        while self.engine.waiting or self.engine.running or self.engine.parked:
            if time.monotonic() > deadline:
                raise RuntimeError(f"request {req_id} not done after 60 s")
            self.engine.step()
        return request

    def stream(self, seconds: float, first: int = 1) -> list[tuple[float, int]]:
        """A request every GAP_S for `seconds`, each with the next prefix: (its start, tokens loaded)."""
        started = time.monotonic()
        out: list[tuple[float, int]] = []
        for i in range(int(seconds / GAP_S)):
            while time.monotonic() < started + GAP_S * i:
                time.sleep(0.002)
            self.engine.reset_prefix_cache()
            request = self.serve(
                f"q-{i}", self.prefixes[first + i % (len(self.prefixes) - first)] + [7]
            )
            out.append((time.monotonic() - started, request.num_external_tokens))
        return out

    def close(self) -> None:
        self.manager.close()
        self.engine.close()


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(n)]


def stall(
    server: RedisServer, seconds: float
) -> tuple[list[tuple[float, int]], list[tuple[float, int]], int]:
    """(the fresh stack's stream, the stream after the stall, explorations after the stall)."""
    num_prefixes = 1 + int(seconds / GAP_S)
    fresh = Stack(server.url, num_prefixes)
    try:
        fresh.store_prefixes()
        baseline = fresh.stream(seconds)
    finally:
        fresh.close()
    stack = Stack(server.url, num_prefixes)
    try:
        stack.store_prefixes()
        stack.engine.reset_prefix_cache()
        server.pause()
        stalled_at = time.monotonic()
        # its promotions expire: Redis written off
        stalled = stack.serve("stalled", stack.prefixes[0] + [7])
        expired = stack.manager.tier_stats()[0].counters.get("expired_jobs", 0)
        if stalled.num_external_tokens or not expired:
            raise RuntimeError(
                f"the stalled request's reads did not expire ({expired} expired jobs)"
            )
        while time.monotonic() < stalled_at + STALL_S:
            time.sleep(0.01)
        server.resume()
        stack.tier.drain(10.0)
        explored_before = stack.scheduler.stats.explorations["redis"]
        after = stack.stream(seconds)
        return baseline, after, stack.scheduler.stats.explorations["redis"] - explored_before
    finally:
        stack.close()


def slow(server: RedisServer, seconds: float) -> tuple[list[tuple[float, int]], int, int]:
    """(the stream behind a 0.5 s link, explorations, deferrals)."""
    num_prefixes = 1 + int(seconds / GAP_S)
    with ThrottledProxy(server.port, 1e9) as link:
        stack = Stack(f"redis://{link.host}:{link.port}/0", num_prefixes)
        try:
            stack.store_prefixes()
            link.latency_s = 0.5
            # loads at the prior: measured slow
            stack.serve("measure", stack.prefixes[0] + [7])
            stack.tier.drain(10.0)
            explored_before = stack.scheduler.stats.explorations["redis"]
            deferrals_before = stack.scheduler.stats.deferrals
            out = stack.stream(seconds)
            return (
                out,
                stack.scheduler.stats.explorations["redis"] - explored_before,
                stack.scheduler.stats.deferrals - deferrals_before,
            )
        finally:
            stack.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 s streams (else 20 s)")
    parser.add_argument(
        "--seconds", type=float, default=None, help="how long each stream of requests runs"
    )
    args = parser.parse_args()
    seconds = args.seconds or (5.0 if args.quick else 20.0)
    with RedisServer.temporary() as server:
        baseline, after, explorations = stall(server, seconds)
        slow_stream, slow_explorations, slow_deferrals = slow(server, seconds)
    loaded = [at for at, tokens in after if tokens]
    fresh_loads = sum(1 for _, tokens in baseline if tokens)
    print(
        f"stall: Redis stopped {STALL_S} s (tier jobs expire after {TIER_JOB_TIMEOUT_S} s), then a request "
        f"every {GAP_S * 1e3:.0f} ms for {seconds:.0f} s"
    )
    print(
        f"  fresh stack, same stream: {fresh_loads} of {len(baseline)} requests loaded from Redis"
    )
    print(
        f"  after the stall: {len(loaded)} of {len(after)} loaded; the first {loaded[0] if loaded else 'none'} s "
        f"after the resume; {explorations} explorations"
    )
    slow_loads = sum(1 for _, tokens in slow_stream if tokens)
    print(
        f"slow: Redis behind a 0.5 s-latency link, a request every {GAP_S * 1e3:.0f} ms for {seconds:.0f} s: "
        f"{slow_explorations} explorations, {slow_loads} requests loaded from it, {slow_deferrals} deferrals"
    )
    recovery = f"{loaded[0]:.2f}" if loaded else "never"
    print(
        f"RESULT recovery_s={recovery} loads_vs_fresh={len(loaded) / max(1, fresh_loads):.2f} "
        f"slow_explorations_per_s={slow_explorations / seconds:.2f} slow_loads={slow_loads} "
        f"slow_deferrals={slow_deferrals}"
    )


if __name__ == "__main__":
    main()
