"""What one run of the served soak found: its checks, its figures, its memory samples.

- `Check`: one named verdict, with the figures behind it.
- `RunReport`: a run's counts (requests, completed, compared with the baseline, mismatches),
  hit tokens, resident memory and its growth, checks and the facts the fault recorded.
- `compare_outputs`, `record_rss`, `write_rss_csv`: how `run_fault` (run.py) fills it.

Thread-safety: none; the soak's main thread uses them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .workload import Clients, RssSampler

__all__ = ["Check", "RunReport", "compare_outputs", "record_rss", "write_rss_csv"]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class RunReport:
    fault: str
    requests: int
    completed: int = 0
    compared: int = 0
    mismatches: int = 0
    retried: int = 0
    hit_tokens: float = 0.0
    max_rss_mib: float = 0.0
    # the whole tree
    rss_growth_mib: float | None = None
    # every process but vLLM's worker(s)
    scheduler_rss_growth_mib: float | None = None
    worker_rss_growth_mib: float | None = None
    seconds: float = 0.0
    checks: list[Check] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


def compare_outputs(report: RunReport, clients: Clients, baselines: dict) -> None:
    for outcome in clients.outcomes:
        if outcome.token_ids is None:
            report.facts.setdefault("errors", []).append(outcome.error)
            continue
        report.completed += 1
        report.retried += outcome.attempts > 1
        expected = baselines.get(outcome.prompt)
        if expected is not None:
            report.compared += 1
            if outcome.token_ids != expected:
                report.mismatches += 1
                pairs = enumerate(zip(expected, outcome.token_ids, strict=False))
                first = next(
                    (i for i, (a, b) in pairs if a != b), min(len(expected), len(outcome.token_ids))
                )
                report.facts.setdefault("mismatched", []).append(
                    {
                        "prompt_tokens": len(outcome.prompt),
                        "cached_tokens": outcome.cached_tokens,
                        "attempts": outcome.attempts,
                        "first_diff": first,
                        "ended_at": round(outcome.ended_at, 1),
                    }
                )


def record_rss(report: RunReport, sampler: RssSampler, last_start: int) -> None:
    """Max RSS over the run; growth = mean of the last third of the last server's samples minus
    the middle third's (the first third is warm-up: the CPU tier's slab and vLLM fill up), for
    the tree, for vLLM's worker(s) and for the other processes, and per process."""
    samples = [rss for _, start, rss in sampler.samples if start == last_start]
    report.max_rss_mib = max(
        (sum(rss.values()) / 2**20 for _, _, rss in sampler.samples), default=0.0
    )
    report.facts["rss_samples"] = len(samples)
    report.rss_growth_mib = _growth([sum(rss.values()) for rss in samples])
    if report.rss_growth_mib is None:
        return
    report.worker_rss_growth_mib = _growth(
        [sum(v for n, v in rss.items() if _is_worker(n)) for rss in samples]
    )
    report.scheduler_rss_growth_mib = _growth(
        [sum(v for n, v in rss.items() if not _is_worker(n)) for rss in samples]
    )
    report.facts["rss_growth_mib_by_process"] = {
        name: _growth([rss.get(name, 0) for rss in samples]) for name in samples[-1]
    }


def _is_worker(process: str) -> bool:
    return process.startswith("VLLM::Worker")


def write_rss_csv(path: Path, sampler: RssSampler) -> None:
    """Every sample: seconds, server start, MiB of the tree and of each process."""
    names = sorted({name for _, _, rss in sampler.samples for name in rss})
    rows = [",".join(["t_s", "start", "total_mib", *names])]
    rows += [
        ",".join(
            [
                f"{t:.2f}",
                str(start),
                f"{sum(rss.values()) / 2**20:.1f}",
                *(f"{rss.get(n, 0) / 2**20:.1f}" for n in names),
            ]
        )
        for t, start, rss in sampler.samples
    ]
    path.write_text("\n".join(rows) + "\n")


def _growth(values: list[int]) -> float | None:
    third = len(values) // 3
    if third < 3:
        return None
    return round(
        (statistics.fmean(values[2 * third :]) - statistics.fmean(values[third : 2 * third]))
        / 2**20,
        1,
    )
