"""Small random-weight models for tests and the demo (no download: weights are generated).

Seeded, so every machine builds byte-identical weights; cached by their settings in a
directory of the caller's choice. Config and safetensors only: engines run them with
`skip_tokenizer_init=True` and token-id prompts.

- `ensure_tiny_llama`: a Llama (hidden 512, 8 layers, fp32): full attention only.
- `ensure_tiny_gemma3`: a Gemma 3 whose layers alternate sliding-window (256 tokens) and
  full attention: vLLM serves it with two KV-cache groups, or with one group mixing both
  kinds when a connector turns its hybrid KV-cache manager off.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

__all__ = ["TINY_GEMMA3", "TINY_LLAMA", "ensure_tiny_gemma3", "ensure_tiny_llama"]

# hidden 512, 8 layers, fp32: ~32M parameters, a 2k-token prefill in ~1.6 s on 2 CPU cores
TINY_LLAMA = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1376,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY_GEMMA3 = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 8192,
    "max_position_embeddings": 8192,
    "sliding_window": 256,
    "query_pre_attn_scalar": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}
_SEED = 0


def ensure_tiny_llama(cache_dir: str | os.PathLike) -> Path:
    """Path of the tiny Llama under `cache_dir`, generating it on first use."""
    tag = f"tiny-llama-h{TINY_LLAMA['hidden_size']}-l{TINY_LLAMA['num_hidden_layers']}-s{_SEED}"

    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, torch_dtype="float32"))

    return _ensure(Path(cache_dir) / tag, build, TINY_LLAMA)


def ensure_tiny_gemma3(cache_dir: str | os.PathLike) -> Path:
    """Path of the tiny Gemma 3 (sliding-window and full-attention layers), generated on first use."""
    tag = f"tiny-gemma3-h{TINY_GEMMA3['hidden_size']}-l{TINY_GEMMA3['num_hidden_layers']}-s{_SEED}"

    def build():
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3ForCausalLM(Gemma3TextConfig(**TINY_GEMMA3, torch_dtype="float32"))

    return _ensure(Path(cache_dir) / tag, build, TINY_GEMMA3)


def _is_complete(path: Path) -> bool:
    return (path / "model.safetensors").exists() and (path / "config.json").exists()


def _ensure(path: Path, build, settings: dict) -> Path:
    if _is_complete(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Processes that start at once (test workers, replicas of the demo) build it one at a time:
    # the second finds it whole instead of removing it under the first one's readers.
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_complete(path):
            _build(path, build, settings)
    return path


def _build(path: Path, build, settings: dict) -> None:
    import torch

    torch.manual_seed(_SEED)
    model = build().to(torch.float32)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "kvtier.json").write_text(json.dumps({"seed": _SEED, **settings}))
    if path.exists():
        # an incomplete earlier attempt
        shutil.rmtree(path)
    # the model appears whole or not at all
    tmp.replace(path)
