"""The demo's figures: the table, the per-turn lines, the JSON summary and the plot.

Each takes the two `kvtier.cli.demo.RunResult`s (without kvtier, with kvtier) of the same workload.
Turn 1 is reported apart from the later turns: only later turns re-send a history.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

__all__ = ["pct", "plot", "report", "summary"]


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (inclusive method); the value itself for a single one."""
    if len(values) <= 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _later(r) -> list[float]:
    return [t for turn in r.ttft_by_turn[1:] for t in turn]


def summary(base, ours) -> dict[str, Any]:
    """The figures of both runs (milliseconds, tokens per second, hit rate) for `--json`."""
    runs = {}
    for r in (base, ours):
        runs[r.name] = {
            "ttft_p50_ms_turn1": pct(r.ttft_by_turn[0], 50) * 1e3,
            "ttft_p50_ms_later": pct(_later(r), 50) * 1e3,
            "ttft_p90_ms_later": pct(_later(r), 90) * 1e3,
            "ttft_p50_ms_by_turn": [pct(t, 50) * 1e3 for t in r.ttft_by_turn],
            "prompt_tokens_per_s": r.prompt_tokens / r.seconds,
            "output_tokens_per_s": r.output_tokens / r.seconds,
            "kvtier_hit_rate": r.kvtier_hit_tokens / r.prompt_tokens,
            "requests": sum(len(t) for t in r.ttft_by_turn),
            "seconds": r.seconds,
            "engine_start_seconds": r.start_seconds,
        }
    return {"runs": runs, "ttft_p50_later_ratio": pct(_later(base), 50) / pct(_later(ours), 50)}


def report(base, ours, out_dir: Path) -> str:
    """The markdown table and per-turn lines; also writes the plot to `out_dir`."""
    rows = [
        "| run | TTFT p50, turn 1 | TTFT p50, turns 2+ | TTFT p90, turns 2+ | throughput | kvtier hit rate |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in (base, ours):
        later = _later(r)
        rows.append(
            f"| {r.name} | {pct(r.ttft_by_turn[0], 50) * 1e3:,.0f} ms | {pct(later, 50) * 1e3:,.0f} ms | "
            f"{pct(later, 90) * 1e3:,.0f} ms | {r.prompt_tokens / r.seconds:,.0f} prompt tok/s, "
            f"{r.output_tokens / r.seconds:,.1f} output tok/s | {r.kvtier_hit_tokens / r.prompt_tokens:.1%} |"
        )
    by_turn = "\n".join(
        f"TTFT p50 by turn, {r.name:>14}: "
        + "  ".join(f"{pct(t, 50) * 1e3:6,.0f} ms" for t in r.ttft_by_turn)
        for r in (base, ours)
    )
    ratio = summary(base, ours)["ttft_p50_later_ratio"]
    plot(base, ours, out_dir / "ttft_per_turn.png")
    return (
        "\n".join(rows)
        + f"\n\n{by_turn}\n\np50 TTFT of reused turns: {ratio:.1f}x lower with kvtier"
    )


def plot(base, ours, path: Path) -> None:
    """TTFT p50 and p90 per turn, both runs, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for r, color in ((base, "tab:gray"), (ours, "tab:blue")):
        turns = range(1, len(r.ttft_by_turn) + 1)
        ax.plot(
            turns,
            [pct(t, 50) * 1e3 for t in r.ttft_by_turn],
            "o-",
            color=color,
            label=f"{r.name} p50",
        )
        ax.plot(
            turns,
            [pct(t, 90) * 1e3 for t in r.ttft_by_turn],
            "^--",
            color=color,
            alpha=0.6,
            label=f"{r.name} p90",
        )
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (ms, log)")
    ax.set_xticks(range(1, len(base.ttft_by_turn) + 1))
    ax.set_title(f"{len(base.ttft_by_turn[0])} chats x {len(base.ttft_by_turn)} turns, vLLM on CPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
