"""A served soak: vLLM's OpenAI-compatible server with kvtier (CPU + disk + Redis tiers), under faults.

Two servers of the tiny random-weight Llama, both on CPU and bound to the same cores
(`VLLM_CPU_NUM_OF_RESERVED_CPU=1`; the core ids each logged are compared), both with a
KV cache of `--num-gpu-blocks-override` blocks, small enough to evict:
- the baseline, stock vLLM (`kvtier vllm serve` without kvtier), answers every distinct
  prompt of the workload once; then it stops;
- the kvtier server (`kvtier serve`, or `kvtier vllm serve` with a fault-injecting connector
  class from tests/kvtier_fault_connector.py where the fault needs one) gets a few clients
  replaying multi-turn conversations on shared system prompts (soak_workload.py), a fixed
  number of requests, while one fault is injected mid-run (soak_faults.py).

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
import contextlib
import dataclasses
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from soak_faults import FAULTS, Fault
from soak_run import Check, Run, Stack, disk_leftovers, wait_until
from soak_serving import EngineSpec, ServedEngine, is_alive
from soak_tiers import DiskDir, RedisProcess
from soak_workload import Clients, RssSampler, Workload, baseline_outputs, fresh_tokens

__all__ = ["FULL", "QUICK", "RunReport", "SoakConfig", "close_stack", "open_stack", "run_fault", "start_baseline",
           "table"]

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class SoakConfig:
    workload: Workload = field(default_factory=Workload)
    num_requests: int = 240  # per run
    concurrency: int = 4  # clients (and vLLM's --max-num-seqs)
    active_conversations: int = 8  # in progress at once, their turns interleaved
    num_gpu_blocks: int = 32  # 4,096 tokens of vLLM KV cache: far less than the conversations in progress
    cpu_bytes: str = "24MiB"  # 12 chunks of the tiny Llama (2 MiB each): the disk and Redis tiers serve most
    disk_bytes: str = "256MiB"
    tmpfs_bytes: int = 448 << 20  # the disk_full fault's filesystem: disk_bytes + 64 spare files + room
    job_timeout_s: float = 2.0
    run_timeout_s: float = 1800.0
    # memory growth allowed between the middle and the last third of the samples: where kvtier keeps its
    # state (the API server and vLLM's engine core: the manager, the tiers, their threads), and in vLLM's
    # worker, which grows by itself on this workload (stock vLLM: +89 MiB in 500 requests, docs/reliability.md)
    rss_tolerance_mib: float = 16.0
    worker_rss_tolerance_mib: float = 180.0

    def workload_for(self, fault: str) -> Workload:
        """Each fault's run replays conversations of its own (their baselines are computed once)."""
        return dataclasses.replace(self.workload, seed=FAULTS[fault].seed)


FULL = SoakConfig()
QUICK = SoakConfig(Workload(num_conversations=8, num_system_prompts=2, system_tokens=384, turns=3,
                            user_tokens=(64, 160), reply_tokens=(16, 32), max_tokens=6),
                   num_requests=48, concurrency=3, active_conversations=8, num_gpu_blocks=20, run_timeout_s=900.0)


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
    rss_growth_mib: float | None = None  # the whole tree
    scheduler_rss_growth_mib: float | None = None  # every process but vLLM's worker(s)
    worker_rss_growth_mib: float | None = None
    seconds: float = 0.0
    checks: list[Check] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


# -- servers ----------------------------------------------------------------------------------


def _spec(model: Path, cfg: SoakConfig, kvtier: dict | None = None, **kwargs) -> EngineSpec:
    return EngineSpec(model, kvtier, num_gpu_blocks=cfg.num_gpu_blocks, max_num_seqs=cfg.concurrency, **kwargs)


def start_baseline(model: Path, cfg: SoakConfig, log_dir: Path) -> ServedEngine:
    engine = ServedEngine(_spec(model, cfg), log_dir / "baseline.log")
    engine.start()
    return engine


def open_stack(model: Path, cfg: SoakConfig, log_dir: Path, faults: list[Fault] = ()) -> Stack:
    """Redis, a disk directory and a kvtier server started as `faults` need (at most one connector)."""
    connectors = {f.connector for f in faults} - {None}
    if len(connectors) > 1:
        raise ValueError(f"faults need different connector classes: {connectors}")
    redis = RedisProcess()
    redis.start()
    disk = DiskDir(cfg.tmpfs_bytes if any(f.needs_tmpfs for f in faults) else None)
    flags = Path(tempfile.mkdtemp(prefix="kvtier-soak-flags-"))
    env = {k: v for f in faults for k, v in f.env(flags, cfg.job_timeout_s).items()}
    settings = {"cpu_bytes": cfg.cpu_bytes, "disk_path": str(disk.path), "disk_bytes": cfg.disk_bytes,
                "redis_url": redis.url, "job_timeout_s": cfg.job_timeout_s}
    engine = ServedEngine(_spec(model, cfg, settings, connector=connectors.pop() if connectors else None, env=env),
                          log_dir / "kvtier.log")
    try:
        engine.start()
    except BaseException:
        redis.close()
        disk.close()
        flags.rmdir()
        raise
    return Stack(engine, redis, disk, flags)


def close_stack(stack: Stack, damaged: set[str] = frozenset()) -> list[Check]:
    """SIGTERM the kvtier server; check what it leaves behind; remove Redis and the disk directory."""
    engine = stack.engine
    shm = set(engine.remember_shm())
    tree = engine.pids()
    try:
        status = engine.stop(signal.SIGTERM)
        shm_left = sorted(n for n in shm if Path("/dev/shm", n).exists())
        alive = [pid for pid in tree if is_alive(pid)]
        num_tmp, bad = disk_leftovers(stack.disk.path)
        torn = sorted(set(bad) - set(damaged))  # files the fault damaged and nothing read since stay bad
        return [Check("shutdown: exit status 0", status == 0, f"status={status}"),
                Check("shutdown: no process left", not alive, f"alive={alive}"),
                Check("shutdown: no /dev/shm segment left", bool(shm) and not shm_left,
                      f"mapped={sorted(shm)} left={shm_left}"),
                Check("shutdown: no temp file, no torn chunk file", num_tmp == 0 and not torn,
                      f"tmp={num_tmp} bad={torn[:3]}")]
    finally:
        stack.redis.close()
        stack.disk.close()
        for path in stack.flags_dir.iterdir():
            path.unlink()
        stack.flags_dir.rmdir()


# -- one run --------------------------------------------------------------------------------


def run_fault(stack: Stack, cfg: SoakConfig, fault: Fault, baselines: dict) -> RunReport:
    """Replay `cfg.num_requests` requests against the stack's server while `fault` strikes; check."""
    workload = cfg.workload_for(fault.name)
    clients = Clients(stack.engine, workload.sessions(cfg.num_requests, seed=workload.seed), cfg.concurrency,
                      workload.max_tokens, active=cfg.active_conversations, retry=fault.retry)
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
    report = RunReport(fault.name, cfg.num_requests, seconds=time.monotonic() - started, facts=run.facts)
    _compare(report, clients, baselines)
    _rss(report, sampler, stack.engine.num_starts)
    _write_rss_csv(stack.engine.log_path.with_name(f"rss-{fault.name}.csv"), sampler)
    report.hit_tokens = run.delta("kvtier:hit_tokens_total", "start")
    end = run.snapshots["end"][1]
    report.checks = [
        Check("all requests completed", joined and report.completed == report.requests,
              f"{report.completed}/{report.requests}" + ("" if joined else " (clients still running)")),
        Check("outputs equal the baseline", report.compared == report.completed and report.mismatches == 0,
              f"compared={report.compared} mismatches={report.mismatches}"),
        Check("kvtier served hits", report.hit_tokens > 0, f"hit tokens={report.hit_tokens:.0f}"),
        Check("end: no job in flight, no slot pinned", settled,
              " ".join(f"{n}={end.sum('kvtier:' + n):.0f}" for n in ("jobs_in_flight", "tier_jobs_in_flight",
                                                                      "pinned_slots"))
              + ("" if end.has("kvtier:jobs_in_flight") else " (no jobs_in_flight gauge)")),
        Check("memory: no growth after warm-up", report.rss_growth_mib is not None
              and report.scheduler_rss_growth_mib <= cfg.rss_tolerance_mib
              and report.worker_rss_growth_mib <= cfg.worker_rss_tolerance_mib,
              f"max {report.max_rss_mib:.0f} MiB; growth: API server + engine core "
              f"{report.scheduler_rss_growth_mib} MiB, worker {report.worker_rss_growth_mib} MiB"),
        *fault.checks(run)]
    return report


def _settle(run: Run, fault: Fault, timeout_s: float = 90.0) -> bool:
    """Until no job is in flight, no slot pinned and the fault is over (bounded).

    Gauges are reported at engine steps, so the server is kept stepping: first one request of
    fresh tokens (two new chunks: a store through every tier after the fault), then tiny ones
    (no whole block: no kvtier job). None of these is compared or counted.
    """
    probes = iter(range(10**6))

    def quiet() -> bool:
        page = run.snap("end")
        done = all(page.sum(f"kvtier:{n}") == 0 for n in ("jobs_in_flight", "tier_jobs_in_flight", "pinned_slots"))
        if done and fault.settled(page) and page.has("kvtier:jobs_in_flight"):
            return True
        with contextlib.suppress(OSError):
            run.engine.post("/v1/completions", {"model": "tiny", "prompt": fresh_tokens(4, next(probes)),
                                                "max_tokens": 1, "temperature": 0.0}, timeout=120)
        return False

    with contextlib.suppress(OSError):
        run.engine.post("/v1/completions", {"model": "tiny", "prompt": fresh_tokens(2 * 128 + 16, -1),
                                            "max_tokens": 1, "temperature": 0.0}, timeout=300)
    ok = wait_until(quiet, timeout_s, 1.0)
    if not ok:
        run.snap("end")
    return ok


def _compare(report: RunReport, clients: Clients, baselines: dict) -> None:
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
                first = next((i for i, (a, b) in pairs if a != b), min(len(expected), len(outcome.token_ids)))
                report.facts.setdefault("mismatched", []).append(
                    {"prompt_tokens": len(outcome.prompt), "cached_tokens": outcome.cached_tokens,
                     "attempts": outcome.attempts, "first_diff": first, "ended_at": round(outcome.ended_at, 1)})


def _rss(report: RunReport, sampler: RssSampler, last_start: int) -> None:
    """Max RSS over the run; growth = mean of the last third of the last server's samples minus
    the middle third's (the first third is warm-up: the CPU tier's slab and vLLM fill up), for
    the tree, for vLLM's worker(s) and for the other processes, and per process."""
    samples = [rss for _, start, rss in sampler.samples if start == last_start]
    report.max_rss_mib = max((sum(rss.values()) / 2**20 for _, _, rss in sampler.samples), default=0.0)
    report.facts["rss_samples"] = len(samples)
    report.rss_growth_mib = _growth([sum(rss.values()) for rss in samples])
    if report.rss_growth_mib is None:
        return
    report.worker_rss_growth_mib = _growth([sum(v for n, v in rss.items() if _is_worker(n)) for rss in samples])
    report.scheduler_rss_growth_mib = _growth([sum(v for n, v in rss.items() if not _is_worker(n))
                                               for rss in samples])
    report.facts["rss_growth_mib_by_process"] = {
        name: _growth([rss.get(name, 0) for rss in samples]) for name in samples[-1]}


def _is_worker(process: str) -> bool:
    return process.startswith("VLLM::Worker")


def _write_rss_csv(path: Path, sampler: RssSampler) -> None:
    """Every sample: seconds, server start, MiB of the tree and of each process."""
    names = sorted({name for _, _, rss in sampler.samples for name in rss})
    rows = [",".join(["t_s", "start", "total_mib", *names])]
    rows += [",".join([f"{t:.2f}", str(start), f"{sum(rss.values()) / 2**20:.1f}",
                       *(f"{rss.get(n, 0) / 2**20:.1f}" for n in names)]) for t, start, rss in sampler.samples]
    path.write_text("\n".join(rows) + "\n")


def _growth(values: list[int]) -> float | None:
    third = len(values) // 3
    if third < 3:
        return None
    return round((statistics.fmean(values[2 * third:]) - statistics.fmean(values[third:2 * third])) / 2**20, 1)


# -- the command line -------------------------------------------------------------------------


def table(report: RunReport) -> str:
    lines = [f"== {report.fault}: {FAULTS[report.fault].what}",
             f"   {report.requests} requests, {report.completed} completed, {report.compared} compared, "
             f"{report.mismatches} mismatches, {report.retried} retried, {report.hit_tokens:.0f} kvtier hit tokens, "
             f"max RSS {report.max_rss_mib:.0f} MiB, {report.seconds:.0f} s"]
    lines += [f"   [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}" for c in report.checks]
    if report.facts.get("rss_growth_mib_by_process"):
        lines.append(f"   RSS growth by process, MiB: {report.facts['rss_growth_mib_by_process']}")
    shown = {k: v for k, v in report.facts.items() if k in ("mismatched", "errors", "sigterm_at", "restarted_at")}
    if shown and not report.ok:
        lines.append(f"   facts: {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fault", action="append", choices=sorted(FAULTS), default=[], help="a fault (repeatable)")
    parser.add_argument("--all", action="store_true", help="every fault, one run each ('none' not included)")
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

    model = ensure_tiny_llama(Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier")))
    print(f"soak: {len(faults)} run(s) of {cfg.num_requests} requests, {cfg.concurrency} clients; logs in {out}")
    baseline = start_baseline(model, cfg, out)
    try:
        baselines, cores = {}, baseline.core_ids()
        for fault in faults:
            baselines.update(baseline_outputs(baseline, cfg.workload_for(fault.name), cfg.concurrency))
        print(f"baseline: {len(baselines)} distinct prompts answered, core ids {cores}", flush=True)
    finally:
        baseline.stop()
    reports = []
    for fault in faults:
        stack = open_stack(model, cfg, out / fault.name, [fault])
        report = RunReport(fault.name, cfg.num_requests)
        try:
            report = run_fault(stack, cfg, fault, baselines)
            report.checks.insert(0, Check("both servers on the same cores", stack.engine.core_ids() == cores,
                                          f"{stack.engine.core_ids()} vs {cores}"))
        finally:
            report.checks += close_stack(stack, report.facts.get("damaged_paths", set()))
        reports.append(report)
        print(table(report), flush=True)
    return _summary(reports)


def _summary(reports: list[RunReport]) -> int:
    print("\n| fault | requests | completed | compared | mismatches | retried | hit tokens | max RSS MiB | "
          "RSS growth MiB | checks |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in reports:
        checks = "all ok" if r.ok else "FAILED: " + "; ".join(c.name for c in r.failed())
        print(f"| {r.fault} | {r.requests} | {r.completed} | {r.compared} | {r.mismatches} | {r.retried} | "
              f"{r.hit_tokens:.0f} | {r.max_rss_mib:.0f} | {r.rss_growth_mib} | {checks} |")
    total = {k: sum(getattr(r, k) for r in reports) for k in ("requests", "compared", "mismatches")}
    max_rss = max((r.max_rss_mib for r in reports), default=0.0)
    print(f"RESULT requests={total['requests']} faults={len(reports)} compared={total['compared']} "
          f"mismatches={total['mismatches']} max_rss_mib={max_rss:.0f}")
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
