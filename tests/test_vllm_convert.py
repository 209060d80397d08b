"""kvtier's view of vLLM's KV-cache groups, built from the installed vLLM's own spec classes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvtier.scheduler import GroupKind

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")

ATTENTION = {"block_size": 128, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}


def group(spec, layers=("model.layers.0.self_attn.attn",)):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return KVCacheGroupSpec(layer_names=list(layers), kv_cache_spec=spec)


def test_full_attention_and_sliding_window_groups():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvtier.integrations.vllm.convert import group_spec

    full = group_spec(group(FullAttentionSpec(**ATTENTION)), blocks_per_chunk=4)
    assert (full.kind, full.tokens_per_block, full.blocks_per_chunk) == (GroupKind.FULL, 128, 4)
    window = group_spec(group(SlidingWindowSpec(**ATTENTION, sliding_window=256)), blocks_per_chunk=1)
    assert (window.kind, window.sliding_window) == (GroupKind.SLIDING_WINDOW, 256)


def test_a_group_mixing_window_and_full_layers_is_loaded_whole():
    # issue #8 defect 10: vLLM without its hybrid manager merges a model's sliding-window and
    # full-attention layers into one FullAttentionSpec that carries `sliding_window`
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.integrations.vllm.convert import group_spec

    merged = group_spec(group(FullAttentionSpec(**ATTENTION, sliding_window=256)), blocks_per_chunk=1)
    assert merged.kind is GroupKind.FULL and merged.sliding_window is None


def test_kinds_kvtier_cannot_serve_say_why():
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    from kvtier.integrations.vllm.convert import group_spec

    mla = group_spec(group(MLAAttentionSpec(**{**ATTENTION, "num_kv_heads": 1})), blocks_per_chunk=1)
    mamba = group_spec(group(MambaSpec(block_size=128, shapes=((4, 4),), dtypes=(torch.float32,)), ["m.0", "m.1"]), 1)
    assert mla.kind is GroupKind.UNSUPPORTED and mla.reason.startswith("MLAAttentionSpec (layers ['model.layers.0")
    assert mamba.kind is GroupKind.UNSUPPORTED and "MambaSpec (layers ['m.0', 'm.1'])" in mamba.reason


def test_evictable_blocks_are_the_cached_ones_the_next_allocations_take():
    """vLLM's free queue hands out never-cached blocks first, then cached ones, least recently
    freed first: a lazy store mode must see exactly the cached blocks within its lookahead."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from kvtier.integrations.vllm.convert import evictable_blocks

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    blocks = pool.get_new_blocks(5)
    cached = blocks[:3]
    for i, block in enumerate(cached):
        block.set_block_hash(make_block_hash_with_group_id(bytes([i]) * 32, 0), 16)
    pool.free_blocks(blocks)  # cached ones go to the tail in this order, the others to the head
    num_free = pool.get_num_free_blocks()
    assert evictable_blocks(pool, num_free) == [b.block_id for b in cached]
    assert evictable_blocks(pool, num_free - 1) == [b.block_id for b in cached[:2]]
    assert evictable_blocks(pool, num_free - 3) == []
    taken = pool.get_new_blocks(num_free - 2)  # evicts the first cached block
    assert cached[0] in taken
    assert evictable_blocks(pool, 2) == [b.block_id for b in cached[1:]]
