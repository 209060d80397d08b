"""bench_mrc: the online miss-ratio curve (`kvtier.mrc`, SHARDS) against exact LRU replays.

For the Mooncake conversation trace and a synthetic chat/agent trace, every request's prompt
blocks in trace order (`kvtier.sim.belady.block_stream`, one kvtier offload key per block) are
fed to a `MissRatioCurve` as lookups, and to exact LRU caches of 0.25x ... 8x a tier's capacity
(`--capacity`: a share of the trace's distinct blocks). The table shows both hit ratios per
factor; the cost is the estimator's time per lookup, beside an exact LRU cache's of one capacity
(the baseline, measured in the same run; least of its runs), and its memory (tracemalloc, after
the whole trace).

Then the check against `kvtier simulate`: the trace (its first `--sim-requests`) is replayed
through the real scheduler and CPU tier (LRU) at 1x; the CPU tier's own curve from that replay
predicts the hit ratio at each factor, and a replay at each factor measures it: chunks loaded /
chunks asked for (whole chunks after the engine's own prefix cache, as the curve counts them).
"own stream" is that replay's own curve at its own size. The replays differ from the 1x one in
what the tier is asked: what a larger tier loads fills the engine's prefix cache, which then
serves later requests itself. max_abs_error is the estimator's against exact LRU on the same
stream; sim_max_abs_error the 1x curve's against the replays.

    python benchmarks/bench_mrc.py [--quick] [--trace PATH] [--capacity 0.05] [--max-samples N]
                                   [--sim-requests 3000]

--quick: the conversation trace's first 3,000 requests and 150 synthetic conversations, and
replays of 1,000 and 150. Last
line: RESULT max_abs_error=… us_per_lookup=… memory_bytes=… sim_max_abs_error=… (goals: <= 0.03,
<= 1 us, bounded). A lookup's time includes the store of the same key (a cache stores what it
missed), as a tier's curve sees a chunk asked for and then written.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import kvtier.sim.replay
from kvtier.keys import OffloadKey
from kvtier.mrc import CAPACITY_FACTORS, DEFAULT_MAX_SAMPLES, MissRatioCurve
from kvtier.sim import SimOptions, simulate
from kvtier.sim.belady import block_stream
from kvtier.sim.synthetic import synthetic
from kvtier.sim.trace import offload_keys
from mooncake import DEFAULT_TRACE, load_trace


def key_stream(requests: Sequence) -> list[OffloadKey]:
    """The trace's block stream as offload keys (one bytes object per distinct block, as a tier
    sees the same key objects a request's state holds)."""
    blocks = block_stream(requests)
    distinct = sorted(set(blocks))
    keys = dict(zip(distinct, offload_keys(distinct), strict=True))
    return [keys[b] for b in blocks]


def exact_lru(stream: Sequence[OffloadKey], capacity: int) -> tuple[float, float]:
    """(hit ratio, seconds) of an exact LRU cache of `capacity` keys: every lookup is stored on a miss."""
    start = time.perf_counter()
    cache = OrderedDict()
    hits = 0
    for key in stream:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / len(stream), time.perf_counter() - start


def estimate(
    stream: Sequence[OffloadKey], max_samples: int, repeats: int = 1
) -> tuple[MissRatioCurve, float]:
    """The estimator fed the whole stream, and the seconds that took (the least of `repeats` runs:
    this machine is shared, and the least is the one least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        mrc = MissRatioCurve(max_samples)
        lookup = mrc.lookup
        store = mrc.store
        start = time.perf_counter()
        # a cache that stores what it misses (and refreshes what it hits)
        for key in stream:
            lookup(key)
            store(key)
        best = min(best, time.perf_counter() - start)
    return mrc, best


def memory_of(stream: Sequence[OffloadKey], max_samples: int) -> int:
    """Bytes the estimator holds after the whole stream (tracemalloc)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mrc, _ = estimate(stream, max_samples)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del mrc
    return held


def run(
    name: str, stream: list[OffloadKey], capacity_share: float, max_samples: int
) -> tuple[float, float, float]:
    """Print one trace's table; returns (max abs error, estimator seconds, exact LRU seconds per pass)."""
    distinct = len(set(stream))
    capacity = max(1, round(capacity_share * distinct))
    mrc, seconds = estimate(stream, max_samples, repeats=3)
    print(
        f"\n{name}: {len(stream):,} lookups, {distinct:,} distinct keys, capacity {capacity:,} chunks "
        f"({capacity_share:.0%}), sampling rate {mrc.sampling_rate:.4f}, {mrc.num_samples:,} samples"
    )
    print(f"  {'factor':>6} {'chunks':>9} {'exact LRU':>10} {'predicted':>10} {'error':>8}")
    worst = 0.0
    lru_seconds = float("inf")
    for factor in CAPACITY_FACTORS:
        chunks = max(1, round(factor * capacity))
        exact, spent = exact_lru(stream, chunks)
        lru_seconds = min(lru_seconds, spent)
        predicted = mrc.hit_ratio(chunks)
        worst = max(worst, abs(predicted - exact))
        print(
            f"  {factor:>6g} {chunks:>9,} {exact:>10.4f} {predicted:>10.4f} {predicted - exact:>+8.4f}"
        )
    print(
        f"  estimator {seconds / len(stream) * 1e6:.3f} us/lookup, exact LRU (one capacity) "
        f"{lru_seconds / len(stream) * 1e6:.3f} us/lookup"
    )
    return worst, seconds, lru_seconds


# the engine's own cache (as bench_hints)
ENGINE_BLOCKS = {"conversation": 2048, "synthetic": 256}


def simulated(name: str, requests: Sequence, capacity_share: float) -> float:
    """The CPU tier's curve from a replay at 1x against replays at each factor; returns the max error."""
    curves: list[MissRatioCurve] = []
    read_report = kvtier.sim.replay.read_report

    # the replay's manager is closed after its report
    def keep_curve(engine, manager, *args, **kwargs):
        curves.append(manager.mrc)
        return read_report(engine, manager, *args, **kwargs)

    kvtier.sim.replay.read_report = keep_curve
    try:
        engine_blocks = ENGINE_BLOCKS[name]
        base = simulate(
            requests,
            SimOptions(policy="lru", host_fraction=capacity_share, engine_blocks=engine_blocks),
        )
        capacity = base.host_slots
        curve = curves[-1]
        print(
            f"\n{name} through kvtier simulate: {len(requests):,} requests, engine cache {engine_blocks:,} blocks, "
            f"CPU tier {capacity:,} chunks (LRU), {curve.num_lookups:,} chunks asked for"
        )
        print(
            f"  {'factor':>6} {'chunks':>9} {'simulated':>10} {'predicted':>10} {'error':>8} {'own stream':>11}"
        )
        worst = 0.0
        for factor in CAPACITY_FACTORS:
            chunks = max(1, round(factor * capacity))
            report = simulate(
                requests, SimOptions(policy="lru", host_slots=chunks, engine_blocks=engine_blocks)
            )
            measured = report.counters["loaded_chunks"] / max(1, curves[-1].num_lookups)
            predicted = curve.hit_ratio(chunks)
            worst = max(worst, abs(predicted - measured))
            print(
                f"  {factor:>6g} {chunks:>9,} {measured:>10.4f} {predicted:>10.4f} {predicted - measured:>+8.4f} "
                f"{curves[-1].hit_ratio(chunks):>11.4f}"
            )
        return worst
    finally:
        kvtier.sim.replay.read_report = read_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3,000 conversation requests, 150 synthetic conversations",
    )
    parser.add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE, help="the Mooncake conversation trace"
    )
    parser.add_argument(
        "--capacity",
        type=float,
        default=0.05,
        help="the tier's capacity, a share of distinct blocks",
    )
    parser.add_argument(
        "--max-samples", type=int, default=DEFAULT_MAX_SAMPLES, help="the estimator's sample bound"
    )
    parser.add_argument(
        "--sim-requests", type=int, default=None, help="requests replayed by kvtier simulate"
    )
    args = parser.parse_args()
    requests = {
        "conversation": load_trace(args.trace, limit=3000 if args.quick else None),
        "synthetic": synthetic(150 if args.quick else 1500, seed=1),
    }
    traces = {name: key_stream(reqs) for name, reqs in requests.items()}
    sim_requests = args.sim_requests or (1000 if args.quick else 3000)
    worst = 0.0
    seconds = 0.0
    lru_seconds = 0.0
    lookups = 0
    for name, stream in traces.items():
        err, spent, lru_spent = run(name, stream, args.capacity, args.max_samples)
        worst = max(worst, err)
        seconds += spent
        lru_seconds += lru_spent
        lookups += len(stream)
    sim_worst = max(
        simulated(name, reqs[:sim_requests], args.capacity) for name, reqs in requests.items()
    )
    memory = max(memory_of(stream, args.max_samples) for stream in traces.values())
    us = seconds / lookups * 1e6
    print(f"\nestimator / exact LRU time per lookup: {seconds / lru_seconds:.2f}x")
    print(
        f"RESULT max_abs_error={worst:.4f} us_per_lookup={us:.3f} memory_bytes={memory} "
        f"sim_max_abs_error={sim_worst:.4f}"
    )


if __name__ == "__main__":
    main()
