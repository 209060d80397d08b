"""`sweep`: hit rate against host-tier capacity, one replay per (policy, capacity), with
Belady's MIN as the ceiling; writes a CSV and a PNG.

    from kvtier.sim import load_mooncake, sweep
    result = sweep(load_mooncake(path), [0.01, 0.05, 0.2], ["lru", "arc", "turns"], "out/")
    print(result.csv_path, result.png_path, result.to_dict())

Capacities are fractions of the trace's distinct blocks (the host tier's slots; the engine's
own cache stays `options.engine_blocks`). Each point is one `simulate` run with the given
options (`SimOptions`), only `policy` and `host_fraction` changed. The ceiling at each
capacity is MIN over the same block stream with room for the host tier's slots plus the
engine's blocks — everything the two caches together could hold — so no policy, eager or
lazy, can reach above it; `belady_host_only` (room for the host tier alone) is in the CSV too.

The CSV has one row per point: policy, capacity_fraction, host_slots, engine_hit_rate,
kvtier_hit_rate, total_hit_rate, evictions, ttft_saving_fraction, wall_s; Belady rows have
policy "belady" (and "belady_host_only") and hit rates in `total_hit_rate` only.

Thread-safety: `sweep` builds everything it uses; replays may run in worker processes.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sim.belady import belady_hits, block_stream
from kvtier.sim.options import SimOptions
from kvtier.sim.replay import simulate
from kvtier.sim.report import SimulationReport
from kvtier.sim.trace import TraceRequest
from kvtier.sim.workload import num_unique_blocks

__all__ = ["SweepPoint", "SweepResult", "sweep"]

_FIELDS = (
    "policy",
    "capacity_fraction",
    "host_slots",
    "engine_hit_rate",
    "kvtier_hit_rate",
    "total_hit_rate",
    "evictions",
    "ttft_saving_fraction",
    "wall_s",
)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One (policy, capacity) of a sweep."""

    policy: str
    capacity_fraction: float
    host_slots: int
    total_hit_rate: float
    engine_hit_rate: float = 0.0
    kvtier_hit_rate: float = 0.0
    evictions: int = 0
    ttft_saving_fraction: float = 0.0
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}


@dataclass(slots=True)
class SweepResult:
    """Every point of a sweep, and where its CSV and PNG are."""

    points: list[SweepPoint]
    csv_path: Path
    png_path: Path | None
    reports: list[SimulationReport] = field(default_factory=list)

    def rate(self, policy: str, capacity_fraction: float) -> float:
        """Total hit rate of `policy` (or "belady") at `capacity_fraction`."""
        for point in self.points:
            if point.policy == policy and point.capacity_fraction == capacity_fraction:
                return point.total_hit_rate
        raise KeyError(f"no point for {policy!r} at {capacity_fraction}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": [p.to_dict() for p in self.points],
            "csv": str(self.csv_path),
            "png": str(self.png_path) if self.png_path else None,
        }


def sweep(
    requests: Sequence[TraceRequest],
    capacities: Sequence[float],
    policies: Sequence[str],
    out_dir: str | Path,
    options: SimOptions | None = None,
    *,
    workers: int = 1,
    progress: Callable[[str], None] | None = None,
    plot: bool = True,
) -> SweepResult:
    """Replay `requests` for every policy and capacity; write `sweep.csv` and `sweep.png` into `out_dir`.

    Args:
        capacities: host-tier sizes, fractions of the trace's distinct blocks (0 < f).
        policies: store policies: eviction policy names (`kvtier.policies.policy_names()`), eager,
            or prefixed "lazy-" for the lazy store mode (`SimOptions.label`).
        options: everything else about the replays (default `SimOptions()`).
        workers: replays run in this many processes at once.
        progress: called with a line after each point.
        plot: write the PNG (needs matplotlib).
    """
    if not capacities or not policies or any(not f > 0 for f in capacities):
        raise ConfigError("sweep: give at least one capacity (fractions > 0) and one policy")
    base = options or SimOptions()
    jobs = [(policy, fraction) for policy in policies for fraction in capacities]
    runs = [
        replace(base, **SimOptions.parse_label(policy), host_fraction=fraction, host_slots=None)
        for policy, fraction in jobs
    ]
    reports = _run_all(requests, runs, workers, progress)
    points = [_point(fraction, report) for (_, fraction), report in zip(jobs, reports, strict=True)]
    points += _ceilings(requests, capacities, base)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = _write_csv(points, out / "sweep.csv")
    png_path = None
    if plot:
        png_path = _plot(points, out / "sweep.png", len(requests), base.engine_blocks)
    return SweepResult(points, csv_path, png_path, reports)


def _run_all(
    requests: Sequence[TraceRequest],
    runs: list[SimOptions],
    workers: int,
    progress: Callable[[str], None] | None,
) -> list[SimulationReport]:
    reports: list[SimulationReport] = []
    if workers <= 1:
        for opts in runs:
            reports.append(simulate(requests, opts))
            _tell(progress, reports[-1])
        return reports
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for report in pool.map(simulate, [requests] * len(runs), runs):
            reports.append(report)
            _tell(progress, report)
    return reports


def _tell(progress: Callable[[str], None] | None, report: SimulationReport) -> None:
    if progress is not None:
        progress(
            f"{report.policy} at {report.host_slots} slots: total hit rate {report.total_hit_rate:.4f} "
            f"({report.wall_s:.1f} s)"
        )


def _point(fraction: float, report: SimulationReport) -> SweepPoint:
    return SweepPoint(
        report.policy,
        fraction,
        report.host_slots,
        report.total_hit_rate,
        report.engine_hit_rate,
        report.kvtier_hit_rate,
        sum(report.evictions.values()),
        report.ttft.saving_fraction,
        report.wall_s,
    )


def _ceilings(
    requests: Sequence[TraceRequest], capacities: Sequence[float], opts: SimOptions
) -> list[SweepPoint]:
    stream = block_stream(requests, opts.trace_block_tokens)
    prompt_tokens = sum(r.input_length for r in requests) or 1
    unique = num_unique_blocks(requests)
    points = []
    for fraction in capacities:
        slots = max(1, round(fraction * unique))
        for name, room in (("belady", slots + opts.engine_blocks), ("belady_host_only", slots)):
            rate = belady_hits(stream, room) * opts.trace_block_tokens / prompt_tokens
            points.append(SweepPoint(name, fraction, slots, rate))
    return points


def _write_csv(points: list[SweepPoint], path: Path) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_FIELDS)
        writer.writeheader()
        for point in points:
            writer.writerow(point.to_dict())
    return path


def _plot(points: list[SweepPoint], path: Path, num_requests: int, engine_blocks: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(p.policy for p in points if p.policy != "belady_host_only"):
        line = sorted(
            (p.capacity_fraction * 100, p.total_hit_rate) for p in points if p.policy == policy
        )
        style = {"marker": "o", "label": policy}
        if policy == "belady":
            style = {"color": "black", "linestyle": "--", "label": "Belady's MIN (ceiling)"}
        ax.plot([x for x, _ in line], [y for _, y in line], **style)
    ax.set_xscale("log")
    ticks = sorted({p.capacity_fraction * 100 for p in points})
    ax.set_xticks(ticks, [f"{t:g}%" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("host tier capacity, % of the trace's distinct blocks")
    ax.set_ylabel("prefix hit rate (engine + kvtier)")
    ax.set_title(f"{num_requests:,} requests, engine cache {engine_blocks:,} blocks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
