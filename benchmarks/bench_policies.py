"""Eviction policies on the Mooncake conversation trace, against Belady's MIN.

`kvtier.sim.sweep` replays the trace through the real scheduler, CPU tier and worker (the fake
engine with a fixed prefix cache of 2,048 blocks, one per 512-token trace block) with the host
tier at 1 %, 5 % and 20 % of the trace's distinct blocks, for eager-LRU (today's default),
eager-ARC and `turns` (conversation depth, `kvtier.policies.turns`), each also in the lazy store
mode (`lazy-…`: chunks stored when the engine is about to evict them, `kvtier.scheduler.lazy`),
and computes Belady's MIN
over the same block stream with room for the host tier plus the engine cache (the ceiling).
Prints the total prefix hit rate (engine + kvtier) of each, each policy's gain over LRU, and the
share of the LRU-to-ceiling gap it closes; writes sweep.csv and sweep.png.

`best` is the policy with the highest hit rate at 5 % among those that do not lose to LRU at
20 % (by more than 0.001).

    python benchmarks/bench_policies.py [--quick] [--trace PATH] [--out DIR] [--workers N]

--quick: the first 3,000 requests. Last line:
RESULT lru_5pct=<x> best_5pct=<y> belady_5pct=<z> best_policy=<name>
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvtier.sim import SimOptions, sweep
from mooncake import DEFAULT_TRACE, load_trace

CAPACITIES = (0.01, 0.05, 0.20)
POLICIES = ("lru", "arc", "turns", "lazy-lru", "lazy-arc", "lazy-turns")
ENGINE_BLOCKS = 2048


def choose_best(result, policies) -> str:
    """The highest at 5 % among the policies that do not lose to LRU at 20 %."""
    fair = [p for p in policies if result.rate(p, 0.20) >= result.rate("lru", 0.20) - 0.001]
    return max(fair, key=lambda p: result.rate(p, 0.05))


def print_table(result, policies) -> None:
    print(
        f"{'policy':<12}"
        + "".join(f"{f'{c:.0%}':>10}" for c in CAPACITIES)
        + "".join(f"{f'gap@{c:.0%}':>10}" for c in CAPACITIES)
    )
    for policy in (*policies, "belady"):
        rates = [result.rate(policy, c) for c in CAPACITIES]
        gaps = [_gap(result, policy, c) for c in CAPACITIES]
        print(
            f"{policy:<12}"
            + "".join(f"{r:>10.4f}" for r in rates)
            + "".join(f"{g:>10}" for g in gaps)
        )
    print("gap@: share of the gap between LRU and Belady's MIN that the policy closes")


def _gap(result, policy: str, capacity: float) -> str:
    lru = result.rate("lru", capacity)
    ceiling = result.rate("belady", capacity)
    if policy == "belady" or ceiling - lru < 1e-9:
        return "-"
    return f"{(result.rate(policy, capacity) - lru) / (ceiling - lru):+.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first 3,000 requests")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where sweep.csv and sweep.png go (default: a temp dir)",
    )
    parser.add_argument("--workers", type=int, default=1, help="replays in parallel processes")
    args = parser.parse_args()
    requests = load_trace(args.trace, limit=3000 if args.quick else None)
    out = args.out or Path(tempfile.mkdtemp(prefix="kvtier-bench-policies-"))
    print(
        f"{len(requests)} requests; engine cache {ENGINE_BLOCKS} blocks; host tier at "
        f"{', '.join(f'{c:.0%}' for c in CAPACITIES)} of the distinct blocks; policies {', '.join(POLICIES)}"
    )
    started = time.perf_counter()
    # the demo extra; without it: no PNG
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    result = sweep(
        requests,
        CAPACITIES,
        POLICIES,
        out,
        SimOptions(engine_blocks=ENGINE_BLOCKS),
        workers=args.workers,
        progress=lambda line: print("  " + line, flush=True),
        plot=has_matplotlib,
    )
    print(
        f"{len(result.reports)} replays in {time.perf_counter() - started:.0f} s; "
        f"one replay {min(r.wall_s for r in result.reports):.1f}-{max(r.wall_s for r in result.reports):.1f} s"
    )
    print_table(result, POLICIES)
    best = choose_best(result, POLICIES)
    lru = result.rate("lru", 0.05)
    top = result.rate(best, 0.05)
    print(
        f"best: {best}, {top / lru:.3f}x LRU's hit rate at 5 %; csv {result.csv_path}, png {result.png_path}"
    )
    print(
        f"RESULT lru_5pct={lru:.4f} best_5pct={top:.4f} belady_5pct={result.rate('belady', 0.05):.4f} "
        f"best_policy={best}"
    )


if __name__ == "__main__":
    main()
