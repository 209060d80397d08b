"""kvtier's copy threads start off the cores the engine computes on (when there are others)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from helpers import HANG_S
from kvtier.sim.kv_cache import KVCache
from kvtier.worker.affinity import copy_threads_off_compute_cores, usable_cpus
from kvtier.worker.side import WorkerSide

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity")
    or len(usable_cpus()) < 2
    or len(os.sched_getaffinity(0)) < 2,
    reason="needs two usable cores",
)


def _bound_to(cores: set[int], work):
    """Run `work()` on a thread bound to `cores` (as vLLM binds a CPU worker's main thread)."""
    out = {}

    def run():
        # joined, it may linger in /proc a moment more
        out["tid"] = threading.get_native_id()
        os.sched_setaffinity(0, cores)
        out["result"] = work()
        out["after"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(HANG_S)
    return out


def _task_affinities() -> dict[int, set[int]]:
    """Each live thread's CPUs (a thread of an earlier test may end while they are read: left out)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            out[int(task.name)] = os.sched_getaffinity(int(task.name))
        except ProcessLookupError:
            continue
    return out


def test_threads_started_inside_run_on_the_other_cores_and_the_caller_keeps_its_own():
    compute = {min(os.sched_getaffinity(0))}

    def work():
        seen = {}
        with copy_threads_off_compute_cores() as cores:
            child = threading.Thread(target=lambda: seen.update(cores=os.sched_getaffinity(0)))
            child.start()
            child.join(HANG_S)
        return cores, seen["cores"]

    out = _bound_to(compute, work)
    cores, child_cores = out["result"]
    assert cores == child_cores and cores and not cores & compute
    # the caller's binding is restored
    assert out["after"] == compute


def test_a_worker_registered_from_a_bound_thread_copies_on_the_other_cores():
    compute = {min(os.sched_getaffinity(0))}
    kv = KVCache(num_groups=1, num_blocks=8, block_size=4)
    worker = WorkerSide(num_slots=4, blocks_per_chunk=1, layer_groups=kv.layer_groups)
    before = set(_task_affinities())
    try:
        caller = _bound_to(compute, lambda: worker.register_kv_caches(kv.tensors))["tid"]
        # the bound caller's own thread can still be listed (bound to `compute`) just after its join
        started = {
            tid: cpus
            for tid, cpus in _task_affinities().items()
            if tid not in before and tid != caller
        }
        assert started, "the worker started no copy thread"
        assert all(not cpus & compute for cpus in started.values()), started
    finally:
        worker.shutdown()
