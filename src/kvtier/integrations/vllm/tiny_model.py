"""A small random-weight Llama for tests and the demo (no download: weights are generated).

Seeded, so every machine builds byte-identical weights; cached by its settings in a
directory of the caller's choice. Config and safetensors only: engines run it with
`skip_tokenizer_init=True` and token-id prompts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["TINY_LLAMA", "ensure_tiny_llama"]

# hidden 512, 8 layers, fp32: ~32M parameters, a 2k-token prefill in ~1.6 s on 2 CPU cores
TINY_LLAMA = {
    "hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1376, "num_attention_heads": 8,
    "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
_SEED = 0


def ensure_tiny_llama(cache_dir: str | os.PathLike) -> Path:
    """Path of the tiny Llama under `cache_dir`, generating it on first use."""
    tag = f"tiny-llama-h{TINY_LLAMA['hidden_size']}-l{TINY_LLAMA['num_hidden_layers']}-s{_SEED}"
    path = Path(cache_dir) / tag
    if (path / "model.safetensors").exists() and (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(_SEED)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, torch_dtype="float32")).to(torch.float32)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "kvtier.json").write_text(json.dumps({"seed": _SEED, **TINY_LLAMA}))
    if path.exists():
        shutil.rmtree(path)  # an incomplete earlier attempt
    tmp.replace(path)  # the model appears whole or not at all
    return path
