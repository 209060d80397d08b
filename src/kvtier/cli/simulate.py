"""`kvtier simulate TRACE`: replay a trace through the real scheduler and tiers (`kvtier.sim`).

    kvtier simulate ../shared/traces/mooncake_conversation.jsonl --host-fraction 0.05
    kvtier simulate synthetic:200 --policy arc --json
    kvtier simulate agentic:100 --engine-blocks 256 --hints exact
    kvtier simulate TRACE --sweep --capacities 0.01,0.05,0.2 --policies lru,arc --out out/sweep

TRACE is a Mooncake JSONL file, `synthetic[:N]` for N generated chat/agent conversations
(`kvtier.sim.synthetic`) or `agentic[:N]` for N agent sessions (`kvtier.sim.agentic`), both seeded
by `--seed`; `--hints exact|noisy` gives each request its client's hints (`kvtier.sim.hints`).
Every field of `SimOptions` and of its cost model is a flag (`host_fraction` -> `--host-fraction`),
so the simulator's options and this command never disagree. `--sweep` replays every capacity x
policy and writes the PNG and CSV there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.cli.output import Console, progress
from kvtier.errors import ConfigError

__all__ = ["add_simulate_flags", "simulate_main"]

_SIM = "sim_"
_COST = "cost_"


def add_simulate_flags(parser: argparse.ArgumentParser) -> None:
    from kvtier.cli.config import add_dataclass_flags
    from kvtier.sim.costs import CostModel
    from kvtier.sim.options import SimOptions

    parser.add_argument(
        "trace",
        metavar="TRACE",
        help="A Mooncake JSONL trace, synthetic[:N] (N conversations) or agentic[:N] (N sessions).",
    )
    parser.add_argument("--limit", type=int, default=None, help="Replay only the first N requests.")
    parser.add_argument(
        "--seed", type=int, default=0, help="Seed of a generated trace (default: 0)."
    )
    add_dataclass_flags(parser.add_argument_group("simulation"), SimOptions, _SIM, skip=("costs",))
    add_dataclass_flags(
        parser.add_argument_group("cost model (load decisions and TTFT estimate)"), CostModel, _COST
    )
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument(
        "--sweep",
        action="store_true",
        help="Replay every capacity x policy; write a PNG and a CSV.",
    )
    sweep.add_argument(
        "--capacities",
        type=_floats,
        default=[0.01, 0.05, 0.2],
        help="Host tier sizes as fractions of the trace's distinct blocks (default: 0.01,0.05,0.2).",
    )
    sweep.add_argument(
        "--policies",
        type=lambda text: text.split(","),
        default=None,
        help="Policies to compare, comma-separated (default: every registered one).",
    )
    sweep.add_argument(
        "--out", type=Path, default=Path("out/simulate"), help="Where --sweep writes."
    )
    sweep.add_argument(
        "--workers", type=int, default=1, help="Replays run in this many processes at once."
    )


def simulate_main(args: argparse.Namespace, console: Console | None = None) -> int:
    from kvtier.cli.config import given_flags
    from kvtier.sim.costs import CostModel
    from kvtier.sim.options import SimOptions
    from kvtier.sim.replay import simulate

    console = console or Console.standard()
    requests = _load(args.trace, args.limit, args.seed)
    options = SimOptions(**given_flags(args, _SIM), costs=CostModel(**given_flags(args, _COST)))
    if args.sweep:
        return _sweep(args, requests, options, console)
    with progress(None, console, total=len(requests), desc="replaying", unit="req") as bar:
        shown = [0]

        def advance(done: int, total: int) -> None:
            bar.update(done - shown[0])
            shown[0] = done

        report = simulate(requests, options, progress=advance)
    figures = report.to_dict()
    if args.json:
        print(json.dumps({"trace": args.trace, **figures}, indent=2), file=console.out)
    else:
        print(render(args.trace, figures), file=console.out)
    return 0


def render(trace: str, d: dict[str, Any]) -> str:
    """The report as a few aligned lines (every figure is in `--json`)."""
    tiers = ", ".join(f"{tier} {rate:.1%}" for tier, rate in d.get("tier_hit_rates", {}).items())
    moved = ", ".join(
        f"{tier} {direction} {_bytes(n)}"
        for tier, by_dir in d.get("bytes_moved", {}).items()
        for direction, n in by_dir.items()
        if n
    )
    evictions = ", ".join(f"{tier} {n:,}" for tier, n in d.get("evictions", {}).items())
    ttft = d.get("ttft", {})
    lines = [
        f"trace          {trace}: {d['num_requests']:,} requests, {d['prompt_tokens']:,} prompt tokens, "
        f"{d['unique_blocks']:,} distinct blocks",
        f"capacity       host tier {d['host_slots']:,} slots ({d['host_slots'] / max(1, d['unique_blocks']):.1%} "
        f"of the distinct blocks), engine {d['engine_blocks']:,} blocks, policy {d['policy']}",
        f"hit rate       engine {d['engine_hit_rate']:.1%}  +  kvtier {d['kvtier_hit_rate']:.1%}"
        f"{f' ({tiers})' if tiers else ''}  =  {d['total_hit_rate']:.1%}",
        f"bytes moved    {moved or 'none'}",
        f"evictions      {evictions or 'none'}",
        f"deferrals      {d['deferrals']:,} ({d['deferral_timeouts']:,} reached their bound)",
        f"decisions      {_decisions(d.get('load_decisions', {}))} (load_policy {d.get('load_policy', 'cost')})",
    ]
    if {"baseline_s", "with_kvtier_s"} <= ttft.keys():
        lines.append(
            f"TTFT estimate  prefill {ttft['baseline_s']:,.1f} s without kvtier, "
            f"{ttft['with_kvtier_s']:,.1f} s with it ({ttft.get('saving_fraction', 0.0):.0%} less; "
            f"cost model in --json)"
        )
    elif ttft:
        lines.append("TTFT estimate  " + ", ".join(f"{k} {v:,.3g}" for k, v in ttft.items()))
    lines.append(f"replayed in    {d['wall_s']:.1f} s ({d['num_steps']:,} engine steps)")
    return "\n".join(lines)


def _sweep(args: argparse.Namespace, requests: list, options: Any, console: Console) -> int:
    from kvtier.policies import policy_names
    from kvtier.sim.sweep import sweep

    policies = args.policies or list(policy_names())
    with progress(
        None, console, total=len(policies) * len(args.capacities), desc="sweeping", unit="replay"
    ) as bar:
        result = sweep(
            requests,
            args.capacities,
            policies,
            args.out,
            options=options,
            workers=args.workers,
            progress=lambda line: bar.update(1),
        )
    figures = result.to_dict()
    if args.json:
        print(json.dumps({"trace": args.trace, **figures}, indent=2), file=console.out)
    else:
        print(render_sweep(figures["points"], args.capacities), file=console.out)
        console.note(f"CSV: {figures['csv']}   PNG: {figures['png']}")
    return 0


def render_sweep(points: list[dict[str, Any]], capacities: list[float]) -> str:
    """Total hit rate per policy (rows) and capacity (columns), the ceilings last."""
    rates = {(p["policy"], p["capacity_fraction"]): p["total_hit_rate"] for p in points}
    policies = list(dict.fromkeys(p["policy"] for p in points))
    width = max(len(name) for name in policies + ["policy"])
    lines = [
        f"{'policy':<{width}}  "
        + "  ".join(f"{f:>8.1%}" for f in capacities)
        + "   (total hit rate at "
        "host-tier capacity, fraction of the distinct blocks)"
    ]
    for policy in policies:
        cells = [rates.get((policy, f)) for f in capacities]
        lines.append(
            f"{policy:<{width}}  "
            + "  ".join("       -" if r is None else f"{r:>8.4f}" for r in cells)
        )
    return "\n".join(lines)


def _load(trace: str, limit: int | None, seed: int) -> list:
    name, _, count = trace.partition(":")
    if name in ("synthetic", "agentic"):
        from kvtier.sim.agentic import agentic
        from kvtier.sim.synthetic import synthetic

        if count and not count.isdigit():
            raise ConfigError(
                f"TRACE: expected {name}:N with N {name} conversations or sessions, got {trace!r}"
            )
        if name == "synthetic":
            generate = synthetic
            default_count = 200
        else:
            generate = agentic
            default_count = 100
        requests = generate(int(count) if count else default_count, seed=seed)
        return requests[:limit] if limit is not None else requests
    from kvtier.sim.trace import load_mooncake

    return load_mooncake(trace, limit=limit)


def _floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _decisions(by_decision: dict[str, dict[str, int]]) -> str:
    """ "load 120 (cpu 100, disk 20), partial 0, recompute 3 (disk 3)": per decision, per tier."""
    from kvtier.costmodel import DECISIONS

    parts = []
    for decision in DECISIONS:
        by_tier = by_decision.get(decision, {})
        tiers = ", ".join(f"{tier} {n:,}" for tier, n in by_tier.items())
        parts.append(f"{decision} {sum(by_tier.values()):,}" + (f" ({tiers})" if tiers else ""))
    return ", ".join(parts)


def _bytes(num_bytes: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:,.1f} {unit}"
    return f"{num_bytes} B"
