"""When does each tier pay off: the time to first token of a request whose whole prefix sits in
one tier (RAM, local disk, Redis, S3), recomputed, loaded whole (`load_policy: "always"`) and
loaded as the cost model decides (`"cost"`), for prefixes of 256 to 32k tokens.

Arithmetic, not a measurement: every TTFT comes from the decision code the scheduler runs
(`kvtier.costmodel.choose_load`, whose docstring states the model) with the fixed figures of the
simulator's cost model (`kvtier.sim.CostModel.snapshot`). The defaults are issue 22's
accelerator-like figures: an 8B model (128 KiB of KV per token) prefilling 8,000 tokens/s, a
host link of 25 GB/s, a local disk of 3 GB/s, Redis at 1.2 GB/s (10 GbE, 0.5 ms a round trip),
S3 at 0.3 GB/s (30 ms to the first byte), and a 30 ms engine step: a request whose chunks come
up from a secondary tier waits for the next step at least (the disk's 0.1 ms and the host link's
0.01 ms of latency are ours). Chunks are vLLM's default block, 16 tokens. The baseline, recomputing, is taken
in the same run: each figure is a saving against it.

    python benchmarks/plot_payoff.py [--quick] [--svg docs/payoff.svg] [--step-ms 30] ...

Prints a Markdown table (TTFT saving against recomputing, per tier and prefix length, always vs
cost) and writes the plot. --quick: one point per octave (the table's), else four. Last line:
RESULT ram_breakeven_tokens=<n> disk_breakeven_tokens=<n> redis_breakeven_tokens=<n>
s3_breakeven_tokens=<n|never> <tier>_cost_vs_recompute=<TTFT ratio at 32k> cost_never_worse=<0|1>
(a breakeven: the shortest whole-chunk prefix that loads faster than it recomputes).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from kvtier.costmodel import CostSnapshot, choose_load
from kvtier.sim import CostModel

# (name, medium, colour)
TIERS = (
    ("RAM", "cpu", "#2a9d4b"),
    ("local disk", "disk", "#1f77b4"),
    ("Redis", "redis", "#e08a00"),
    ("S3", "s3", "#c62828"),
)
ISSUE_COSTS = {
    "prefill_tokens_per_s": 8000.0,
    "kv_bytes_per_token": 131_072,
    "cpu_gb_per_s": 25.0,
    "disk_gb_per_s": 3.0,
    "redis_gb_per_s": 1.2,
    "s3_gb_per_s": 0.3,
    "cpu_latency_ms": 0.01,
    "disk_latency_ms": 0.1,
    "redis_latency_ms": 0.5,
    "s3_latency_ms": 30.0,
}
MIN_TOKENS = 256
MAX_TOKENS = 32_768
POLICIES = ("always", "cost")


@dataclass(frozen=True)
class Point:
    """One tier at one prefix length: TTFT in seconds recomputing and under each policy."""

    tokens: int
    recompute_s: float
    # by policy
    ttft_s: dict[str, float]

    def saving(self, policy: str) -> float:
        return self.recompute_s - self.ttft_s[policy]


def ttft(
    medium: str, tokens: int, chunk_tokens: int, costs: CostSnapshot, model: CostModel, policy: str
) -> float:
    """Expected TTFT of a prefix of `tokens` (whole chunks) found in `medium`, under `policy`."""
    num_chunks = tokens // chunk_tokens
    choice = choose_load(
        [medium] * num_chunks, chunk_tokens * model.kv_bytes_per_token, chunk_tokens, costs, policy
    )
    return (
        choice.load_s + (num_chunks - choice.num_chunks) * chunk_tokens / costs.prefill_tokens_per_s
    )


def point(
    medium: str, tokens: int, chunk_tokens: int, costs: CostSnapshot, model: CostModel
) -> Point:
    by_policy = {p: ttft(medium, tokens, chunk_tokens, costs, model, p) for p in POLICIES}
    return Point(tokens, tokens / costs.prefill_tokens_per_s, by_policy)


def lengths(points_per_octave: int, chunk_tokens: int) -> list[int]:
    """Log-spaced prefix lengths from MIN_TOKENS to MAX_TOKENS, in whole chunks."""
    octaves = int(math.log2(MAX_TOKENS / MIN_TOKENS))
    raw = (
        MIN_TOKENS * 2 ** (k / points_per_octave) for k in range(octaves * points_per_octave + 1)
    )
    return sorted({max(1, round(t / chunk_tokens)) * chunk_tokens for t in raw})


def breakeven(medium: str, chunk_tokens: int, costs: CostSnapshot, model: CostModel) -> int | None:
    """The shortest prefix (whole chunks, up to MAX_TOKENS) that loads faster than it recomputes."""
    # the cost policy on the longest prefix picks the head with the largest saving: none, and no
    # shorter prefix saves either (a head of a prefix is a prefix) -- one pass instead of a scan
    best = choose_load(
        [medium] * (MAX_TOKENS // chunk_tokens),
        chunk_tokens * model.kv_bytes_per_token,
        chunk_tokens,
        costs,
        "cost",
    )
    if best.num_chunks == 0:
        return None
    for tokens in range(chunk_tokens, MAX_TOKENS + 1, chunk_tokens):
        if (
            ttft(medium, tokens, chunk_tokens, costs, model, "always")
            < tokens / costs.prefill_tokens_per_s
        ):
            return tokens
    return None


def markdown_table(curves: dict[str, list[Point]], shown: list[int]) -> str:
    """A row per shown length: recompute TTFT, then per tier the saving always / cost."""
    head = (
        "| prefix tokens | recompute | "
        + " | ".join(f"{name} always | {name} cost" for name, _, _ in TIERS)
        + " |"
    )
    lines = [head, "|" + " ---: |" * (2 + 2 * len(TIERS))]
    for tokens in shown:
        row = [f"{tokens:,}", f"{1000 * _at(curves['cpu'], tokens).recompute_s:,.0f} ms"]
        for _, medium, _ in TIERS:
            p = _at(curves[medium], tokens)
            row += [_cell(p, policy) for policy in POLICIES]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _at(points: list[Point], tokens: int) -> Point:
    return next(p for p in points if p.tokens == tokens)


def _cell(p: Point, policy: str) -> str:
    saving = p.saving(policy)
    return f"{1000 * saving:+,.0f} ms ({saving / p.recompute_s:+.0%})"


# -- the plot: an SVG written by hand (the project keeps matplotlib out of its install) ----------

W = 760
H = 460
LEFT = 70
RIGHT = 170
TOP = 48
BOTTOM = 56
Y_TICKS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def svg(curves: dict[str, list[Point]], model: CostModel, step_ms: float) -> str:
    """TTFT relative to recomputing (log) against prefix length (log), a line per tier and policy."""
    y_lo, y_hi = Y_TICKS[0], Y_TICKS[-1]

    def x(tokens: float) -> float:
        return LEFT + (W - LEFT - RIGHT) * math.log(tokens / MIN_TOKENS) / math.log(
            MAX_TOKENS / MIN_TOKENS
        )

    def y(ratio: float) -> float:
        ratio = min(max(ratio, y_lo), y_hi)
        return TOP + (H - TOP - BOTTOM) * (1 - math.log(ratio / y_lo) / math.log(y_hi / y_lo))

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="15">When does each tier pay off?</text>',
        f'<text x="{W / 2}" y="37" text-anchor="middle" fill="#555">{_subtitle(model, step_ms)}</text>',
    ]
    out += _axes(x, y)
    # the dashed line on top: where both agree, it runs inside the solid one
    for policy in (
        "cost",
        "always",
    ):
        for _, medium, colour in TIERS:
            pts = " ".join(
                f"{x(p.tokens):.1f},{y(p.ttft_s[policy] / p.recompute_s):.1f}"
                for p in curves[medium]
            )
            out.append(
                f'<polyline points="{pts}" fill="none" stroke="{colour}" {_STROKES[policy]}/>'
            )
    out += _legend()
    out.append("</svg>")
    return "\n".join(out) + "\n"


_STROKES = {
    "cost": 'stroke-width="6" stroke-opacity="0.45"',
    "always": 'stroke-width="2" stroke-dasharray="7,5"',
}


def _subtitle(model: CostModel, step_ms: float) -> str:
    return (
        f"{model.kv_bytes_per_token // 1024} KiB of KV per token, "
        f"prefill {model.prefill_tokens_per_s:,.0f} tokens/s, host link {model.cpu_gb_per_s:g} GB/s, "
        f"engine step {step_ms:g} ms"
    )


def _axes(x, y) -> list[str]:
    x0 = LEFT
    x1 = W - RIGHT
    y0 = TOP
    y1 = H - BOTTOM
    out = [
        f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" fill="none" stroke="#888"/>'
    ]
    tokens = MIN_TOKENS
    while tokens <= MAX_TOKENS:
        out.append(
            f'<line x1="{x(tokens):.1f}" y1="{y0}" x2="{x(tokens):.1f}" y2="{y1}" stroke="#eee"/>'
        )
        label = f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)
        out.append(f'<text x="{x(tokens):.1f}" y="{y1 + 16}" text-anchor="middle">{label}</text>')
        tokens *= 2
    for ratio in Y_TICKS:
        colour = "#444" if ratio == 1.0 else "#eee"
        out.append(
            f'<line x1="{x0}" y1="{y(ratio):.1f}" x2="{x1}" y2="{y(ratio):.1f}" stroke="{colour}"/>'
        )
        out.append(
            f'<text x="{x0 - 6}" y="{y(ratio) + 4:.1f}" text-anchor="end">{ratio:g}&#215;</text>'
        )
    out.append(
        f'<text x="{x1 - 4}" y="{y(1.0) - 5:.1f}" text-anchor="end" fill="#444">recompute</text>'
    )
    out.append(
        f'<text x="{(x0 + x1) / 2}" y="{H - 14}" text-anchor="middle">prefix length, tokens (log)</text>'
    )
    out.append(
        f'<text transform="translate(18,{(y0 + y1) / 2}) rotate(-90)" text-anchor="middle">'
        "TTFT ÷ TTFT recomputing (log; below 1 saves time)</text>"
    )
    return out


def _legend() -> list[str]:
    lx, ly = W - RIGHT + 16, TOP + 10
    out = []
    for i, (name, _, colour) in enumerate(TIERS):
        yy = ly + 20 * i
        out.append(
            f'<line x1="{lx}" y1="{yy}" x2="{lx + 26}" y2="{yy}" stroke="{colour}" stroke-width="2.5"/>'
        )
        out.append(f'<text x="{lx + 32}" y="{yy + 4}">{name}</text>')
    yy = ly + 20 * len(TIERS) + 14
    for i, (label, policy) in enumerate((("cost (solid)", "cost"), ("always (dashed)", "always"))):
        out.append(
            f'<line x1="{lx}" y1="{yy + 20 * i}" x2="{lx + 26}" y2="{yy + 20 * i}" stroke="#333" '
            f"{_STROKES[policy]}/>"
        )
        out.append(f'<text x="{lx + 32}" y="{yy + 20 * i + 4}">{label}</text>')
    for i, line in enumerate(
        ("a dashed line inside a", "solid one: the cost model", "loads it all too")
    ):
        out.append(
            f'<text x="{lx}" y="{yy + 58 + 15 * i}" font-size="11" fill="#555">{line}</text>'
        )
    return out


# -- the run ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="One point per octave (the table's), not four."
    )
    parser.add_argument(
        "--svg",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "docs" / "payoff.svg",
        help="Where the plot goes (default: docs/payoff.svg).",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=30.0,
        help="One engine step: a request whose chunks come up from a tier waits this long at least.",
    )
    parser.add_argument(
        "--chunk-tokens", type=int, default=16, help="Tokens per chunk (vLLM's block size)."
    )
    for name, value in ISSUE_COSTS.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(value),
            default=value,
            help=f"The cost model's {name} (default: {value}).",
        )
    return parser.parse_args()


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main() -> None:
    args = parse_args()
    model = CostModel(**{name: getattr(args, name) for name in ISSUE_COSTS})
    costs = model.snapshot(step_s=args.step_ms / 1000)
    chunk = args.chunk_tokens
    shown = lengths(1, chunk)
    plotted = sorted(set(lengths(1 if args.quick else 4, chunk)) | set(shown))
    curves = {
        medium: [point(medium, t, chunk, costs, model) for t in plotted] for _, medium, _ in TIERS
    }
    print(f"# {_subtitle(model, args.step_ms)}; chunk {chunk} tokens")
    print(
        ", ".join(
            f"{name} {model.read(m).bytes_per_s / 1e9:g} GB/s + {1000 * model.read(m).latency_s:g} ms"
            for name, m, _ in TIERS[1:]
        )
    )
    print(
        "TTFT saving against recomputing the prefix (positive: faster; always = load it all, cost = kvtier's "
        "decision):\n"
    )
    print(markdown_table(curves, shown) + "\n")
    never_worse = all(
        p.ttft_s["cost"] <= min(p.recompute_s, p.ttft_s["always"]) + 1e-12
        for points in curves.values()
        for p in points
    )
    args.svg.parent.mkdir(parents=True, exist_ok=True)
    args.svg.write_text(svg(curves, model, args.step_ms))
    print(f"plot: {_shown(args.svg)}")
    figures = {
        f"{'ram' if m == 'cpu' else m}_breakeven_tokens": breakeven(m, chunk, costs, model)
        for _, m, _ in TIERS
    }
    figures |= {
        f"{'ram' if m == 'cpu' else m}_cost_vs_recompute": round(
            p.ttft_s["cost"] / p.recompute_s, 3
        )
        for _, m, _ in TIERS
        for p in curves[m][-1:]
    }
    print(
        "RESULT "
        + " ".join(f"{k}={'never' if v is None else v}" for k, v in figures.items())
        + f" cost_never_worse={int(never_worse)}"
    )


if __name__ == "__main__":
    main()
