"""Shared pieces of the end-to-end tests that run real vLLM on CPU."""

from __future__ import annotations

import gc
import os
import random
from pathlib import Path

import pytest

CACHE_DIR = Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"))
TESTS_DIR = Path(__file__).resolve().parent
# vLLM on CPU is not bitwise reproducible across engines: two runs *without* kvtier differ by
# 1 ulp (4.8e-7) in some logprobs (measured on the 2-core machine). Across engines a tolerance
# far below any token-changing difference is asserted; within one engine, bit equality.
# ~20 ulp at the logprob magnitudes here (-7 .. -9)
LOGPROB_TOL = 1e-5
# how long an engine's processes get to exit on their own (idle here: ~4 s)
SHUTDOWN_S = 60
SHM = Path("/dev/shm")


def mapped_shm(pid: int, prefix: str = "") -> set[str]:
    """Names of the /dev/shm files under `prefix` that process `pid` maps (from /proc/<pid>/maps)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    # gone, or not ours to read
    except OSError:
        return set()
    return {Path(line.split()[-1]).name for line in lines if f" {SHM}/{prefix}" in line}


def engine_env() -> None:
    """Settings every test engine needs; set before the engine spawns its processes."""
    from kvtier.integrations.vllm.binding import pin_reserved_cpus

    # GiB: a 20-40 s start instead of 90 s
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM waits 5 s for its workers to exit before it signals them; on 2 busy cores that is short.
    # Half the EngineCore's own grace: a stuck worker is still signalled before that runs out
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(SHUTDOWN_S // 2))
    # engines with and without kvtier compute on the same cores
    pin_reserved_cpus()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])
    )


def make_llm(
    model: Path,
    connector: str | None = None,
    module: str = "kvtier.integrations.vllm",
    extra: dict | None = None,
    role: str = "kv_both",
    **kwargs,
):
    from vllm import LLM

    from kvtier.integrations.vllm import kv_transfer_config

    if connector is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(
            connector, module, role, **(extra or {"cpu_bytes": "1GiB"})
        )
    # (a caller may give a transfer config of its own: a MultiConnector's)
    kwargs.setdefault("max_model_len", 4096)
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        **kwargs,
    )


def shutdown(llm) -> None:
    # vLLM's default gives the EngineCore 5 s, its own wait for the workers included, before it
    # kills it; killed, it leaves kvtier's host slab behind (a loaded machine took longer)
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)
    del llm
    gc.collect()


def reference(llm):
    """A shared stock engine (`plain_llama`) as a fresh one: vLLM's prefix cache emptied, so no
    prefix of another module's workload is served from it."""
    assert (
        llm.reset_prefix_cache()
    ), "vLLM refused to empty its prefix cache (requests still running)"
    return llm


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def conversations(
    num_convs: int, system_tokens: int, seed: int = 0
) -> tuple[list[int], list[list[list[int]]]]:
    """A shared system prompt and, per conversation, the user messages of each turn."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 8192) for _ in range(system_tokens)]
    users = [
        [[rng.randrange(3, 8192) for _ in range(rng.randint(90, 260))] for _ in range(3)]
        for _ in range(num_convs)
    ]
    return system, users


def generate(
    llm,
    prompts: list[list[int]],
    max_tokens: int = 8,
    cache_salt: str | None = None,
    kv_transfer_params: dict | None = None,
) -> list[dict]:
    """Greedy outputs with the top-3 logprobs, in prompt order, from one `generate` call (one batch);
    `cache_salt` isolates the prompts' cache entries as a tenant's; `kv_transfer_params` reach the
    connector as the OpenAI server passes them (`SamplingParams.extra_args`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=3,
        ignore_eos=True,
        detokenize=False,
        extra_args=extra,
    )
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p), **salt) for p in prompts], params, use_tqdm=False
    )
    return [summarize(o) for o in outs]


def run_turns(llm, system, users, reset_between_turns: bool, max_tokens: int = 8):
    """Greedy multi-turn chat; each turn's prompt is the whole history. Returns per-turn outputs."""
    histories = [list(system) for _ in users]
    turns = []
    for turn in range(len(users[0])):
        for history, convo in zip(histories, users, strict=True):
            history.extend(convo[turn])
        outs = generate(llm, histories, max_tokens)
        turns.append(outs)
        for history, out in zip(histories, outs, strict=True):
            history.extend(out["token_ids"])
        if reset_between_turns:
            llm.reset_prefix_cache(reset_connector=False)
    return turns


def summarize(out) -> dict:
    completion = out.outputs[0]
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": [
            sorted((t, lp.logprob) for t, lp in step.items()) for step in completion.logprobs
        ],
        "num_cached_tokens": out.num_cached_tokens,
        "num_prompt_tokens": len(out.prompt_token_ids),
    }


def assert_same_outputs(
    expected: list[dict], got: list[dict], where: str, tol: float = LOGPROB_TOL
) -> None:
    """Same token ids, same top-3 tokens, logprobs within `tol` (0: bit for bit)."""
    assert len(expected) == len(got), where
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        at = f"{where}, request {i}"
        assert b["token_ids"] == a["token_ids"], at
        for step_a, step_b in zip(a["logprobs"], b["logprobs"], strict=True):
            assert [t for t, _ in step_b] == [t for t, _ in step_a], at
            lp_a, lp_b = [lp for _, lp in step_a], [lp for _, lp in step_b]
            assert lp_b == (lp_a if tol == 0 else pytest.approx(lp_a, abs=tol)), at


# A Llama small enough to write in a test (~70 KB): vLLM builds its configs from it without an engine
SMALL_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}


def write_small_llama(path: Path, seed: int = 0, **settings) -> Path:
    """`config.json` (SMALL_LLAMA, `settings` override it) and random `model.safetensors` at `path`;
    `seed` picks the weights, so two calls with one seed write byte-identical files."""
    import json

    import torch
    from safetensors.torch import save_file

    config = {**SMALL_LLAMA, **settings}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    tensors = {
        "model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=gen)
    }
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(
            hidden, hidden, generator=gen
        )
    save_file(
        {name: t.to(torch.bfloat16) for name, t in tensors.items()}, str(path / "model.safetensors")
    )
    return path


def scheduler_connector(model: Path, extra: dict):
    """vLLM's scheduler-side KVTierConnector, built as an engine builds it (from a VllmConfig of the
    tiny model and a KV-cache config of one full-attention group), without an engine around it."""
    import torch
    from vllm.config import ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvtier.integrations.vllm import kv_transfer_config
    from kvtier.integrations.vllm.connector import KVTierConnector

    model_config = ModelConfig(
        model=str(model), dtype="float32", skip_tokenizer_init=True, max_model_len=1024
    )
    vllm_config = VllmConfig(
        model_config=model_config, kv_transfer_config=kv_transfer_config(**extra)
    )
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=4,
        head_size=64,
        dtype=torch.float32,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=["model.layers.0.self_attn.attn"], kv_cache_spec=spec)
        ],
    )
    return vllm_config, KVTierConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
