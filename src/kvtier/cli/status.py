"""`kvtier status URL`: each tier's predicted hit ratio at other sizes, read from a server's `/metrics`.

It reads `kvtier:tier_predicted_hit_ratio{tier, capacity_factor}` (`kvtier.mrc`: an online,
sampled LRU estimate from each tier's own lookups) and `kvtier:tier_capacity_bytes`, prints one
row per tier (and engine, when a server runs several) and one line of advice per tier, naming the
setting that sizes it (its descriptor's `sized_by`, `kvtier.tiers.registry`; a tier registered only
in the server's process, an out-of-tree one, is named by its name). URL is the server
(`http://host:8000`) or its metrics page; plain urllib.
"""

from __future__ import annotations

import argparse
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import TextIO

from kvtier.cli.output import human_bytes
from kvtier.errors import KVTierError
from kvtier.tiers.registry import tier_descriptor, tier_descriptors

__all__ = ["TierCurve", "advice", "parse_curves", "sized_by", "status_main"]

_SAMPLE = re.compile(
    r"^(kvtier:tier_(?:predicted_hit_ratio|capacity_bytes))\{([^}]*)\}\s+(\S+)", re.MULTILINE
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# a hit ratio change smaller than this is "about the same"
_CHANGE = 0.01


@dataclass
class TierCurve:
    """One tier's curve as a server exports it."""

    tier: str
    engine: str = ""
    capacity_bytes: float = 0.0
    # capacity factor -> predicted hit ratio
    ratios: dict[float, float] = field(default_factory=dict)


def fetch_metrics(url: str, timeout_s: float = 5.0) -> str:
    """The text of `url`'s metrics page (`/metrics` appended to a bare server address)."""
    if "://" not in url:
        url = f"http://{url}"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise KVTierError(
            f"cannot read {url}: {reason}; is the server running (kvtier serve) and is this "
            "its address and port?"
        ) from None


def parse_curves(text: str) -> list[TierCurve]:
    """The tiers' curves in a Prometheus text page, in the order they appear."""
    curves: dict[tuple[str, str], TierCurve] = {}
    for name, labels_text, value in _SAMPLE.findall(text):
        labels = dict(_LABEL.findall(labels_text))
        tier = labels.get("tier", "?")
        engine = labels.get("engine", "")
        curve = curves.setdefault((tier, engine), TierCurve(tier, engine))
        if name.endswith("capacity_bytes"):
            curve.capacity_bytes = float(value)
        elif "capacity_factor" in labels:
            curve.ratios[float(labels["capacity_factor"])] = float(value)
    return [c for c in curves.values() if c.ratios]


def sized_by(tier: str) -> str:
    """What sizes tier `tier`: its descriptor's `sized_by` when this process registered it; the
    server may run an out-of-tree tier this one never imported, named then by its name."""
    if tier in {d.name for d in tier_descriptors()}:
        return tier_descriptor(tier).sized_by
    return f"the {tier} tier's size"


def advice(curve: TierCurve) -> str:
    """One line: what doubling (or halving) the tier's size would do to its hit ratio."""
    setting = sized_by(curve.tier)
    ratios = curve.ratios
    now = ratios.get(1.0)
    double = ratios.get(2.0)
    half = ratios.get(0.5)
    if now is None or double is None:
        return f"{curve.tier}: no curve at 1x and 2x yet"
    if double - now >= _CHANGE:
        return f"{curve.tier}: doubling {setting} would raise its hit ratio from {now:.2f} to {double:.2f}"
    if half is not None and now - half < _CHANGE:
        return (
            f"{curve.tier}: halving {setting} would lower its hit ratio only from {now:.2f} to {half:.2f}: "
            "it has more room than this traffic reuses"
        )
    return f"{curve.tier}: doubling {setting} would not help ({now:.2f} -> {double:.2f}): it is sized about right"


def render(curves: list[TierCurve], url: str, out: TextIO) -> None:
    factors = sorted({f for c in curves for f in c.ratios})
    engines = len({c.engine for c in curves}) > 1
    print(f"kvtier at {url}: predicted hit ratio per tier at other sizes", file=out)
    print(
        "(an LRU estimate from each tier's own lookups since the server started: the tier's eviction policy\n"
        " may do better or worse than LRU)\n",
        file=out,
    )
    head = f"{'tier':<12} {'capacity':>10}  " + "  ".join(f"{f:g}x".rjust(5) for f in factors)
    print(head, file=out)
    for c in curves:
        name = f"{c.tier}[{c.engine}]" if engines else c.tier
        size = human_bytes(c.capacity_bytes) if c.capacity_bytes else "server's"
        row = "  ".join(
            f"{c.ratios[f]:.2f}".rjust(5) if f in c.ratios else "    -" for f in factors
        )
        print(f"{name:<12} {size:>10}  {row}", file=out)
    print(file=out)
    for c in curves:
        print(advice(c), file=out)


def status_main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    text = fetch_metrics(args.url, args.timeout)
    curves = parse_curves(text)
    if not curves:
        why = "no kvtier metrics at all; is this a vLLM server with kvtier as its KV connector?"
        if "kvtier:" in text:
            why = "no tier has been looked up yet (send some requests)"
        raise KVTierError(f"{args.url} serves metrics but no kvtier curves: {why}")
    render(curves, args.url, out)
    return 0
