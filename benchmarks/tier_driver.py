"""Driving a secondary tier with jobs at full speed (shared by bench_disk.py, bench_remote.py, s3_bench.py)."""

from __future__ import annotations

import hashlib
import time

import numpy as np

from kvtier.tiers.secondary import TierJob


def bench_key(i: int) -> bytes:
    """The i-th key of a run: a 32-byte hash and a 4-byte group index, like an offload key."""
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + bytes(4)


def run_jobs(
    tier,
    rows: np.ndarray,
    count: int,
    batch: int,
    is_store: bool,
    poll_s: float,
    first_key: int = 0,
) -> float:
    """Seconds to store (or load) keys first_key..first_key+count-1 through `rows`: jobs of `batch`
    keys, as many in flight as `rows` holds, polling the tier's results every `poll_s` (the manager
    polls once per engine step)."""
    free_sets = [list(range(i, i + batch)) for i in range(0, len(rows), batch)]
    running: dict[int, list[int]] = {}
    next_key = first_key
    end = first_key + count
    job_id = 0
    start = time.perf_counter()
    while next_key < end or running:
        while free_sets and next_key < end:
            row_ids = free_sets.pop()
            num = min(batch, end - next_key)
            job = TierJob(
                job_id=job_id,
                is_store=is_store,
                keys=tuple(bench_key(next_key + i) for i in range(num)),
                buffers=tuple((memoryview(rows[r]),) for r in row_ids[:num]),
            )
            if is_store:
                tier.submit_store(job)
            else:
                tier.submit_load(job)
            running[job_id] = row_ids
            next_key += num
            job_id += 1
        for result in tier.get_finished():
            if result.failed_keys:
                raise RuntimeError(
                    f"job {result.job_id}: {len(result.failed_keys)} keys failed ({result.error})"
                )
            free_sets.append(running.pop(result.job_id))
        time.sleep(poll_s)
    return time.perf_counter() - start
