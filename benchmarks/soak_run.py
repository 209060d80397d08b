"""One run of the served soak (benchmarks/soak.py): its stack, its clients, what it observed.

- `Stack`: a kvtier server and the tiers it uses (Redis, a disk directory, the fault flags' folder).
- `Run`: one fault's run on a stack: the clients, `/metrics` snapshots by label, and facts the
  fault recorded; `at(fraction)` waits for that share of the requests.
- `Check`: one named verdict, with the figures behind it.
- Helpers the faults and the shutdown checks share: the chunk files of a disk tier root, what
  `kvtier inspect` finds wrong there, a bounded wait, and a served prompt sent again.

Thread-safety: none; the soak's main thread uses them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from soak_serving import Metrics, ServedEngine
from soak_tiers import DiskDir, RedisProcess
from soak_workload import Clients

__all__ = ["Check", "Run", "Stack", "chunk_files", "disk_leftovers", "resend_served_prompt", "wait_until"]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Stack:
    """A kvtier server and the tiers it uses: Redis, a disk directory, the fault flag files' folder."""

    engine: ServedEngine
    redis: RedisProcess
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
    snapshots: dict[str, tuple[int, Metrics]] = field(default_factory=dict)  # label -> (server start, page)
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

    num_tmp, bad = 0, {}
    for directory in namespace_dirs(root):
        report = inspect_namespace(directory, verify=True)
        num_tmp += report.num_tmp_files
        bad.update(report.bad_files)
    return num_tmp, bad


def resend_served_prompt(run: Run) -> tuple[int, bool]:
    """Send again the first prompt of the run that was answered: (cached prompt tokens, output equal
    to the baseline's). Only meaningful while the clients are paused (nothing else runs)."""
    prompt = next(o.prompt for o in run.clients.outcomes if o.token_ids is not None)
    status, reply = run.engine.post("/v1/completions", {
        "model": "tiny", "prompt": list(prompt), "max_tokens": len(run.baselines[prompt]), "temperature": 0.0,
        "seed": 0, "ignore_eos": True, "return_token_ids": True})
    if status != 200:
        return 0, False
    details = reply.get("usage", {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0), reply["choices"][0]["token_ids"] == run.baselines[prompt]
