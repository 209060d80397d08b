"""The served soak's sizes: the workload, requests per run, clients, the kvtier server's tiers, bounds.

`FULL` is what `python benchmarks/soak.py` runs; `QUICK` what `--quick` and tests/test_soak.py run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .faults import FAULTS
from .workload import Workload

__all__ = ["FULL", "QUICK", "SoakConfig"]


@dataclass(frozen=True)
class SoakConfig:
    workload: Workload = field(default_factory=Workload)
    # per run
    num_requests: int = 240
    # clients (and vLLM's --max-num-seqs)
    concurrency: int = 4
    # in progress at once, their turns interleaved
    active_conversations: int = 8
    # 4,096 tokens of vLLM KV cache: far less than the conversations in progress
    num_gpu_blocks: int = 32
    # 12 chunks of the tiny Llama (2 MiB each): the disk and Redis tiers serve most
    cpu_bytes: str = "24MiB"
    disk_bytes: str = "256MiB"
    # the disk_full fault's filesystem: disk_bytes + 64 spare files + room
    tmpfs_bytes: int = 448 << 20
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
QUICK = SoakConfig(
    Workload(
        num_conversations=8,
        num_system_prompts=2,
        system_tokens=384,
        turns=3,
        user_tokens=(64, 160),
        reply_tokens=(16, 32),
        max_tokens=6,
    ),
    num_requests=48,
    concurrency=3,
    active_conversations=8,
    num_gpu_blocks=20,
    run_timeout_s=900.0,
)
