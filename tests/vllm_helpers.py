"""Shared pieces of the end-to-end tests that run real vLLM on CPU."""

from __future__ import annotations

import os
import random
from pathlib import Path

CACHE_DIR = Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"))
TESTS_DIR = Path(__file__).resolve().parent


def engine_env() -> None:
    """Settings every test engine needs; set before the engine spawns its processes."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a 20-40 s start instead of 90 s
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))


def make_llm(model: Path, connector: str | None = None, module: str = "kvtier.integrations.vllm",
             extra: dict | None = None, **kwargs):
    from vllm import LLM

    from kvtier.integrations.vllm import kv_transfer_config

    transfer = None
    if connector is not None:
        transfer = kv_transfer_config(connector, module, **(extra or {"cpu_bytes": "1GiB"}))
    return LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=4096, seed=0,
               enforce_eager=True, kv_transfer_config=transfer, **kwargs)


def conversations(num_convs: int, system_tokens: int, seed: int = 0) -> tuple[list[int], list[list[list[int]]]]:
    """A shared system prompt and, per conversation, the user messages of each turn."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 8192) for _ in range(system_tokens)]
    users = [[[rng.randrange(3, 8192) for _ in range(rng.randint(90, 260))] for _ in range(3)]
             for _ in range(num_convs)]
    return system, users


def run_turns(llm, system, users, reset_between_turns: bool, max_tokens: int = 8):
    """Greedy multi-turn chat; each turn's prompt is the whole history. Returns per-turn outputs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True, detokenize=False)
    histories = [list(system) for _ in users]
    turns = []
    for turn in range(len(users[0])):
        for history, convo in zip(histories, users, strict=True):
            history.extend(convo[turn])
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(h)) for h in histories], params, use_tqdm=False)
        turns.append([summarize(o) for o in outs])
        for history, out in zip(histories, outs, strict=True):
            history.extend(out.outputs[0].token_ids)
        if reset_between_turns:
            llm.reset_prefix_cache(reset_connector=False)
    return turns


def summarize(out) -> dict:
    completion = out.outputs[0]
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": [sorted((t, lp.logprob) for t, lp in step.items()) for step in completion.logprobs],
        "num_cached_tokens": out.num_cached_tokens,
        "num_prompt_tokens": len(out.prompt_token_ids),
    }
