"""A served soak: vLLM's OpenAI-compatible server with kvtier (CPU + disk + Redis tiers), under faults.

Two servers of the tiny random-weight Llama, both on CPU and bound to the same cores
(`VLLM_CPU_NUM_OF_RESERVED_CPU=1`; the core ids each logged are compared), both with a
KV cache of `--num-gpu-blocks-override` blocks, small enough to evict:
- the baseline, stock vLLM (`kvtier vllm serve` without kvtier), answers every distinct
  prompt of the workload once; then it stops;
- the kvtier server (`kvtier serve`, or `kvtier vllm serve` with a fault-injecting connector
  class from tests/kvtier_fault_connector.py where the fault needs one) gets a few clients
  replaying multi-turn conversations on shared system prompts (workload.py), a fixed
  number of requests, while one fault is injected mid-run (faults.py).

Checks, for every run: every request completed; every output equals the baseline's for
the same prompt (greedy token ids); kvtier served hits; at the end no transfer job in
flight and no slot pinned (`kvtier:jobs_in_flight`, `kvtier:tier_jobs_in_flight`,
`kvtier:pinned_slots` on /metrics); the resident memory of the server's process tree has
no growth trend after warm-up (mean of the last third of the samples against the middle
third); after shutdown (SIGTERM) the server exited 0, no process of it, no /dev/shm
segment it mapped and no temporary file of the disk tier is left, and every chunk file
left passes `kvtier inspect`'s check. Plus each fault's own checks.

    .venv/bin/python benchmarks/soak.py --all                  # every fault, one run each
    .venv/bin/python benchmarks/soak.py --fault redis_kill --fault disk_corrupt --quick

Prints a table per run and, last, `RESULT requests=… faults=… compared=… mismatches=… max_rss_mib=…`.
Exit status 1 when a check failed. The disk_full fault mounts a tmpfs (root only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from .config import FULL, QUICK, SoakConfig
from .faults import FAULTS, Fault
from .report import Check, RunReport
from .run import run_fault
from .stack import close_stack, open_stack, start_baseline
from .workload import baseline_outputs

__all__ = ["main", "table"]

ROOT = Path(__file__).resolve().parents[2]


def table(report: RunReport) -> str:
    lines = [
        f"== {report.fault}: {FAULTS[report.fault].what}",
        f"   {report.requests} requests, {report.completed} completed, {report.compared} compared, "
        f"{report.mismatches} mismatches, {report.retried} retried, {report.hit_tokens:.0f} kvtier hit tokens, "
        f"max RSS {report.max_rss_mib:.0f} MiB, {report.seconds:.0f} s",
    ]
    lines += [f"   [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}" for c in report.checks]
    if report.facts.get("rss_growth_mib_by_process"):
        lines.append(f"   RSS growth by process, MiB: {report.facts['rss_growth_mib_by_process']}")
    shown = {
        k: v
        for k, v in report.facts.items()
        if k in ("mismatched", "errors", "sigterm_at", "restarted_at")
    }
    if shown and not report.ok:
        lines.append(f"   facts: {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--fault", action="append", choices=sorted(FAULTS), default=[], help="a fault (repeatable)"
    )
    parser.add_argument(
        "--all", action="store_true", help="every fault, one run each ('none' not included)"
    )
    parser.add_argument("--quick", action="store_true", help="the small workload `make test` runs")
    parser.add_argument("--requests", type=int, help="requests per run")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "soak", help="logs go here")
    args = parser.parse_args(argv)
    names = [n for n in FAULTS if n != "none"] if args.all else args.fault
    if not names:
        parser.error("name a --fault or give --all")
    cfg = QUICK if args.quick else FULL
    if args.requests:
        cfg = dataclasses.replace(cfg, num_requests=args.requests)
    return _soak(cfg, [FAULTS[n] for n in names], args.out)


def _soak(cfg: SoakConfig, faults: list[Fault], out: Path) -> int:
    from kvtier.integrations.vllm.tiny_model import ensure_tiny_llama

    model = ensure_tiny_llama(
        Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"))
    )
    print(
        f"soak: {len(faults)} run(s) of {cfg.num_requests} requests, {cfg.concurrency} clients; logs in {out}"
    )
    baseline = start_baseline(model, cfg, out)
    try:
        baselines = {}
        cores = baseline.core_ids()
        for fault in faults:
            baselines.update(
                baseline_outputs(baseline, cfg.workload_for(fault.name), cfg.concurrency)
            )
        print(f"baseline: {len(baselines)} distinct prompts answered, core ids {cores}", flush=True)
    finally:
        baseline.stop()
    reports = []
    for fault in faults:
        stack = open_stack(model, cfg, out / fault.name, [fault])
        report = RunReport(fault.name, cfg.num_requests)
        try:
            report = run_fault(stack, cfg, fault, baselines)
            report.checks.insert(
                0,
                Check(
                    "both servers on the same cores",
                    stack.engine.core_ids() == cores,
                    f"{stack.engine.core_ids()} vs {cores}",
                ),
            )
        finally:
            report.checks += close_stack(stack, report.facts.get("damaged_paths", set()))
        reports.append(report)
        print(table(report), flush=True)
    return _summary(reports)


def _summary(reports: list[RunReport]) -> int:
    print(
        "\n| fault | requests | completed | compared | mismatches | retried | hit tokens | max RSS MiB | "
        "RSS growth MiB | checks |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in reports:
        checks = "all ok" if r.ok else "FAILED: " + "; ".join(c.name for c in r.failed())
        print(
            f"| {r.fault} | {r.requests} | {r.completed} | {r.compared} | {r.mismatches} | {r.retried} | "
            f"{r.hit_tokens:.0f} | {r.max_rss_mib:.0f} | {r.rss_growth_mib} | {checks} |"
        )
    total = {k: sum(getattr(r, k) for r in reports) for k in ("requests", "compared", "mismatches")}
    max_rss = max((r.max_rss_mib for r in reports), default=0.0)
    print(
        f"RESULT requests={total['requests']} faults={len(reports)} compared={total['compared']} "
        f"mismatches={total['mismatches']} max_rss_mib={max_rss:.0f}"
    )
    return 0 if all(r.ok for r in reports) else 1
