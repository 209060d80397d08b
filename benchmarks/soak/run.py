"""One run of the served soak: its stack, its clients, what it observed, and its checks.

- `Stack`: a kvtier server and the tiers it uses (Redis, a disk directory, the fault flags' folder).
- `Run`: one fault's run on a stack: the clients, `/metrics` snapshots by label, and facts the
  fault recorded; `at(fraction)` waits for that share of the requests.
- `run_fault`: one run, start to checks: the clients replay the workload while the fault
  strikes, the server settles, then the checks every run shares plus the fault's own.
- Helpers the faults and the shutdown checks share: the chunk files of a disk tier root, what
  `kvtier inspect` finds wrong there, a bounded wait, and a served prompt sent again.

Thread-safety: none; the soak's main thread uses them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from servers.redis import RedisServer

from .disk import DiskDir
from .report import Check, RunReport, compare_outputs, record_rss, write_rss_csv
from .serving import Metrics, ServedEngine
from .workload import Clients, RssSampler, fresh_tokens

# faults.py and config.py import this module
if TYPE_CHECKING:
    from .config import SoakConfig
    from .faults import Fault

__all__ = [
    "Run",
    "Stack",
    "chunk_files",
    "disk_leftovers",
    "resend_served_prompt",
    "run_fault",
    "wait_until",
]


@dataclass
class Stack:
    """A kvtier server and the tiers it uses: Redis, a disk directory, the fault flag files' folder."""

    engine: ServedEngine
    redis: RedisServer
    disk: DiskDir
    flags_dir: Path


@dataclass
class Run:
    """One fault's run on a `Stack`: the clients, metrics snapshots and what the fault did."""

    stack: Stack
    clients: Clients
    num_requests: int
    baselines: dict
    timeout_s: float
    # label -> (server start, page)
    snapshots: dict[str, tuple[int, Metrics]] = field(default_factory=dict)
    facts: dict[str, object] = field(default_factory=dict)

    @property
    def engine(self) -> ServedEngine:
        return self.stack.engine

    def at(self, fraction: float) -> bool:
        """Wait until that share of the requests has ended (bounded by the run's timeout)."""
        return self.clients.wait_done(int(self.num_requests * fraction), self.timeout_s)

    def snap(self, label: str) -> Metrics:
        page = self.engine.metrics()
        self.snapshots[label] = (self.engine.num_starts, page)
        return page

    def delta(self, name: str, since: str, until: str = "end", **labels: str) -> float:
        """A counter's growth between two snapshots (from zero when the server restarted in between)."""
        start, before = self.snapshots[since]
        end, after = self.snapshots[until]
        return after.sum(name, **labels) - (before.sum(name, **labels) if start == end else 0.0)


def run_fault(stack: Stack, cfg: SoakConfig, fault: Fault, baselines: dict) -> RunReport:
    """Replay `cfg.num_requests` requests against the stack's server while `fault` strikes; check."""
    workload = cfg.workload_for(fault.name)
    clients = Clients(
        stack.engine,
        workload.sessions(cfg.num_requests, seed=workload.seed),
        cfg.concurrency,
        workload.max_tokens,
        active=cfg.active_conversations,
        retry=fault.retry,
    )
    run = Run(stack, clients, cfg.num_requests, baselines, cfg.run_timeout_s)
    started = time.monotonic()
    run.snap("start")
    sampler = RssSampler(stack.engine, interval_s=0.25).start()
    clients.start()
    try:
        fault.inject(run)
    finally:
        clients.resume()
        joined = clients.join(cfg.run_timeout_s)
    settled = _settle(run, fault)
    sampler.stop()
    report = RunReport(
        fault.name, cfg.num_requests, seconds=time.monotonic() - started, facts=run.facts
    )
    compare_outputs(report, clients, baselines)
    record_rss(report, sampler, stack.engine.num_starts)
    write_rss_csv(stack.engine.log_path.with_name(f"rss-{fault.name}.csv"), sampler)
    report.hit_tokens = run.delta("kvtier:hit_tokens_total", "start")
    end = run.snapshots["end"][1]
    report.checks = [
        Check(
            "all requests completed",
            joined and report.completed == report.requests,
            f"{report.completed}/{report.requests}"
            + ("" if joined else " (clients still running)"),
        ),
        Check(
            "outputs equal the baseline",
            report.compared == report.completed and report.mismatches == 0,
            f"compared={report.compared} mismatches={report.mismatches}",
        ),
        Check("kvtier served hits", report.hit_tokens > 0, f"hit tokens={report.hit_tokens:.0f}"),
        Check(
            "end: no job in flight, no slot pinned",
            settled,
            " ".join(
                f"{n}={end.sum('kvtier:' + n):.0f}"
                for n in ("jobs_in_flight", "tier_jobs_in_flight", "pinned_slots")
            )
            + ("" if end.has("kvtier:jobs_in_flight") else " (no jobs_in_flight gauge)"),
        ),
        Check(
            "memory: no growth after warm-up",
            report.rss_growth_mib is not None
            and report.scheduler_rss_growth_mib <= cfg.rss_tolerance_mib
            and report.worker_rss_growth_mib <= cfg.worker_rss_tolerance_mib,
            f"max {report.max_rss_mib:.0f} MiB; growth: API server + engine core "
            f"{report.scheduler_rss_growth_mib} MiB, worker {report.worker_rss_growth_mib} MiB",
        ),
        *fault.checks(run),
    ]
    return report


def _settle(run: Run, fault: Fault, timeout_s: float = 90.0) -> bool:
    """Until the fault is over, then no job in flight and no slot pinned (bounded).

    Gauges are reported at engine steps, so the server is kept stepping with tiny requests (no
    whole block: no kvtier job). Once the fault is over (a tier's breaker closed again), one
    request of fresh tokens (two new chunks) stores through every tier: what a fault's checks of
    the tiers read (sent before, it found the breaker open on a slow machine and stored nothing).
    None of these is compared or counted.
    """
    probes = iter(range(10**6))

    def complete(prompt: list[int], timeout: float) -> None:
        with contextlib.suppress(OSError):
            run.engine.post(
                "/v1/completions",
                {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0},
                timeout=timeout,
            )

    def step() -> None:
        complete(fresh_tokens(4, next(probes)), timeout=120)

    def over() -> bool:
        if fault.settled(run.snap("end")):
            return True
        step()
        return False

    def quiet() -> bool:
        page = run.snap("end")
        done = all(
            page.sum(f"kvtier:{n}") == 0
            for n in ("jobs_in_flight", "tier_jobs_in_flight", "pinned_slots")
        )
        if done and fault.settled(page) and page.has("kvtier:jobs_in_flight"):
            return True
        step()
        return False

    fault_over = wait_until(over, timeout_s, 1.0)
    complete(fresh_tokens(2 * 128 + 16, -1), timeout=300)
    ok = wait_until(quiet, timeout_s, 1.0)
    if not ok:
        run.snap("end")
    return fault_over and ok


def wait_until(predicate, timeout_s: float, interval_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def chunk_files(root: Path) -> list[Path]:
    """The chunk files under a disk tier root (spares and temporary files left out)."""
    return [p for p in root.glob("*/??/*.kv")]


def disk_leftovers(root: Path) -> tuple[int, dict[str, str]]:
    """(temporary files, {bad chunk file: why}) under a disk tier root, by `kvtier inspect`'s pass."""
    from kvtier.cli.inspect import inspect_namespace, namespace_dirs

    num_tmp = 0
    bad = {}
    for directory in namespace_dirs(root):
        report = inspect_namespace(directory, verify=True)
        num_tmp += report.num_tmp_files
        bad.update(report.bad_files)
    return num_tmp, bad


def resend_served_prompt(run: Run) -> tuple[int, bool]:
    """Send again the first prompt of the run that was answered: (cached prompt tokens, output equal
    to the baseline's). Only meaningful while the clients are paused (nothing else runs)."""
    prompt = next(o.prompt for o in run.clients.outcomes if o.token_ids is not None)
    status, reply = run.engine.post(
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": list(prompt),
            "max_tokens": len(run.baselines[prompt]),
            "temperature": 0.0,
            "seed": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    if status != 200:
        return 0, False
    details = reply.get("usage", {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0), reply["choices"][0][
        "token_ids"
    ] == run.baselines[prompt]
