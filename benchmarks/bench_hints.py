"""Client hints (issue 23): no hints, exact hints and noisy hints, against LRU and Belady's MIN.

Two traces, each replayed (`kvtier.sim.simulate`: the real scheduler, CPU tier and worker under the
fake engine) with the host tier at 1 %, 5 % and 20 % of the trace's distinct blocks:
- conversation: Mooncake's conversation trace, the engine cache 2,048 blocks (as bench_policies);
- agentic: `kvtier.sim.agentic` (100 sessions of a median 43 turns, sub-agents; seed 1), whose token
  counts are a tenth of full size, and so is its engine cache: 256 blocks.

Per trace and capacity: `lru` (LRU, no hints: the baseline), then the configured default policy
(`KVTierConfig().eviction_policy`) with `nohints`, `hints` (each request carrying its client's
hints, derived from the trace's conversations by `kvtier.sim.hints`: session, next_turn_s,
end_session) and `noisy` (the same, each request's hint wrong with probability 0.2, seed 0), and
`belady` (MIN over the same block stream with room for the host tier plus the engine cache: the
ceiling). Prints each trace's total prefix hit rate (engine + kvtier) and the share of the
LRU-to-Belady gap each closes.

Goals (issue 23), on the conversation trace: hints close >= 50 % of the gap at 5 %, noisy hints
>= 30 %, and hints are never below no hints at any capacity (checked on both traces).

    python benchmarks/bench_hints.py [--quick] [--trace PATH] [--only conversation|agentic] [--capacities 0.05,...]

--quick: the conversation trace's first 3,000 requests and 40 agentic sessions. Last line (the
conversation trace):
RESULT lru_5pct=<x> nohints_5pct=<x> hints_5pct=<x> noisy_5pct=<x> belady_5pct=<x> gap_closed_hints=<x>
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvtier.config import KVTierConfig
from kvtier.sim import SimOptions, TraceRequest, simulate
from kvtier.sim.agentic import agentic
from kvtier.sim.belady import belady_hits, block_stream
from kvtier.sim.workload import num_unique_blocks
from mooncake import DEFAULT_TRACE, load_trace

CAPACITIES = (0.01, 0.05, 0.20)
VARIANTS = ("lru", "nohints", "hints", "noisy")
HINTS = {"lru": "trace", "nohints": "trace", "hints": "exact", "noisy": "noisy"}
ENGINE_BLOCKS = {"conversation": 2048, "agentic": 256}
# (variant or "belady", capacity) -> total hit rate
Rates = dict[tuple[str, float], float]


def replay_all(
    name: str, requests: Sequence[TraceRequest], policy: str, capacities: Sequence[float]
) -> Rates:
    """Every variant at every capacity, and the ceiling."""
    base = SimOptions(engine_blocks=ENGINE_BLOCKS[name], policy=policy)
    rates: Rates = {}
    for capacity in capacities:
        for variant in VARIANTS:
            options = replace(
                base,
                host_fraction=capacity,
                hints=HINTS[variant],
                policy="lru" if variant == "lru" else policy,
            )
            report = simulate(requests, options)
            rates[variant, capacity] = report.total_hit_rate
            print(
                f"  {name} {variant:<8} at {capacity:.0%}: {report.total_hit_rate:.4f} "
                f"({report.wall_s:.1f} s, {sum(report.evictions.values()):,} evictions)",
                flush=True,
            )
        rates["belady", capacity] = _belady(requests, capacity, base)
    return rates


def gap_closed(rates: Rates, variant: str, capacity: float) -> float | None:
    """The share of the LRU-to-Belady gap `variant` closes at `capacity` (None: no gap)."""
    lru = rates["lru", capacity]
    ceiling = rates["belady", capacity]
    if ceiling - lru < 1e-9:
        return None
    return (rates[variant, capacity] - lru) / (ceiling - lru)


def _gap_cell(rates: Rates, variant: str, capacity: float) -> str:
    """The share of LRU's gap to Belady that `variant` closes at `capacity`, or "-"."""
    if variant == "belady":
        return "-"
    gap = gap_closed(rates, variant, capacity)
    if gap is None:
        return "-"
    return f"{gap:+.0%}"


def print_table(name: str, rates: Rates, policy: str, capacities: Sequence[float]) -> None:
    print(f"{name}: total hit rate (engine + kvtier); default policy {policy}")
    print(
        f"{'variant':<10}"
        + "".join(f"{f'{c:.0%}':>10}" for c in capacities)
        + "".join(f"{f'gap@{c:.0%}':>10}" for c in capacities)
    )
    for variant in (*VARIANTS, "belady"):
        cells = [rates[variant, c] for c in capacities]
        gaps = [_gap_cell(rates, variant, c) for c in capacities]
        print(
            f"{variant:<10}"
            + "".join(f"{r:>10.4f}" for r in cells)
            + "".join(f"{g:>10}" for g in gaps)
        )
    print("gap@: share of the gap between LRU and Belady's MIN that the variant closes")


def check_goals(results: dict[str, Rates], capacities: Sequence[float]) -> None:
    """Say which of issue 23's goals hold (of those the capacities measured)."""
    if "conversation" in results and 0.05 in capacities:
        rates = results["conversation"]
        hints = gap_closed(rates, "hints", 0.05)
        noisy = gap_closed(rates, "noisy", 0.05)
        print(
            f"goal: hints close >= 50 % of the gap at 5 % (conversation): {_share(hints)} "
            f"{'met' if hints is not None and hints >= 0.5 else 'NOT met'}"
        )
        print(
            f"goal: noisy hints close >= 30 % (conversation): {_share(noisy)} "
            f"{'met' if noisy is not None and noisy >= 0.3 else 'NOT met'}"
        )
    below = [
        f"{name} {variant} at {c:.0%} ({rates[variant, c]:.4f} < {rates['nohints', c]:.4f})"
        for name, rates in results.items()
        for variant in ("hints", "noisy")
        for c in capacities
        if rates[variant, c] < rates["nohints", c] - 1e-9
    ]
    print("goal: never below no hints: " + ("met" if not below else "NOT met: " + "; ".join(below)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="3,000 conversation requests, 40 agentic sessions"
    )
    parser.add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE, help="the Mooncake conversation trace"
    )
    parser.add_argument(
        "--only", choices=("conversation", "agentic"), default=None, help="one trace only"
    )
    parser.add_argument(
        "--capacities",
        type=lambda text: [float(f) for f in text.split(",")],
        default=CAPACITIES,
        help="host tier sizes, fractions of the distinct blocks (default: 0.01,0.05,0.2)",
    )
    args = parser.parse_args()
    capacities = args.capacities
    policy = KVTierConfig().eviction_policy
    traces = {
        "conversation": lambda: load_trace(args.trace, limit=3000 if args.quick else None),
        "agentic": lambda: agentic(40 if args.quick else 100, seed=1),
    }
    results: dict[str, Rates] = {}
    started = time.perf_counter()
    for name, load in traces.items():
        if args.only in (None, name):
            requests = load()
            print(
                f"{name}: {len(requests):,} requests, {num_unique_blocks(requests):,} distinct blocks, "
                f"engine cache {ENGINE_BLOCKS[name]:,} blocks",
                flush=True,
            )
            results[name] = replay_all(name, requests, policy, capacities)
    print(
        f"{len(results) * len(capacities) * len(VARIANTS)} replays in {time.perf_counter() - started:.0f} s"
    )
    for name, rates in results.items():
        print_table(name, rates, policy, capacities)
    check_goals(results, capacities)
    if "conversation" in results and 0.05 in capacities:
        r = results["conversation"]
        closed = gap_closed(r, "hints", 0.05)
        print(
            f"RESULT lru_5pct={r['lru', 0.05]:.4f} nohints_5pct={r['nohints', 0.05]:.4f} "
            f"hints_5pct={r['hints', 0.05]:.4f} noisy_5pct={r['noisy', 0.05]:.4f} "
            f"belady_5pct={r['belady', 0.05]:.4f} gap_closed_hints={0.0 if closed is None else closed:.3f}"
        )


def _belady(requests: Sequence[TraceRequest], capacity: float, opts: SimOptions) -> float:
    """MIN's hit rate with room for the host tier's slots and the engine's blocks (as `sweep`)."""
    room = max(1, round(capacity * num_unique_blocks(requests))) + opts.engine_blocks
    prompt_tokens = sum(r.input_length for r in requests) or 1
    return (
        belady_hits(block_stream(requests, opts.trace_block_tokens), room)
        * opts.trace_block_tokens
        / prompt_tokens
    )


def _share(value: float | None) -> str:
    return "no gap" if value is None else f"{value:.0%}"


if __name__ == "__main__":
    main()
