"""vLLM objects -> kvtier's own small types (the only place that reads vLLM's fields)."""

from __future__ import annotations

from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.scheduler import GroupKind, GroupSpec, RequestView, ScheduledRequest, SchedulerOffloadConfig, StepView

__all__ = ["block_hash_bytes", "num_slots_for", "request_view", "scheduler_config", "step_view"]

# vLLM's prefix-caching hash algorithms -> digest bytes (sha256: 32; xxh3_128: 16)
_HASH_BYTES = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}


def request_view(request: Any) -> RequestView:
    """A `RequestView` over a live `vllm.v1.request.Request` (its hash list is shared)."""
    return RequestView(
        req_id=request.request_id,
        block_hashes=request.block_hashes,
        num_tokens=request.num_tokens,
        num_prompt_tokens=request.num_prompt_tokens,
        num_computed_tokens=request.num_computed_tokens,
        kv_transfer_params=request.kv_transfer_params,
    )


def step_view(scheduler_output: Any) -> StepView:
    """A `StepView` of a `SchedulerOutput` (new, resumed and running requests)."""
    scheduled = []
    counts = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        scheduled.append(ScheduledRequest(new.req_id, tuple(list(ids) for ids in new.block_ids), True,
                                          new.num_computed_tokens, counts.get(new.req_id, 0)))
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", set()) or set()
    for i, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        scheduled.append(ScheduledRequest(
            req_id, None if new_ids is None else tuple(list(ids) for ids in new_ids), req_id in resumed,
            cached.num_computed_tokens[i], counts.get(req_id, 0)))
    return StepView(scheduled, set(scheduler_output.preempted_req_ids or ()),
                    set(scheduler_output.finished_req_ids or ()))


def _group_spec(group: Any, blocks_per_chunk: int) -> GroupSpec:
    spec = group.kv_cache_spec
    kind_name = type(spec).__name__
    window = getattr(spec, "sliding_window", None)
    if kind_name == "FullAttentionSpec" and window is None:
        return GroupSpec(GroupKind.FULL, spec.block_size, blocks_per_chunk)
    if kind_name in ("SlidingWindowSpec", "FullAttentionSpec") and window:
        return GroupSpec(GroupKind.SLIDING_WINDOW, spec.block_size, blocks_per_chunk, sliding_window=window)
    return GroupSpec(GroupKind.UNSUPPORTED, spec.block_size, blocks_per_chunk)


def scheduler_config(cfg: KVTierConfig, vllm_config: Any, kv_cache_config: Any) -> SchedulerOffloadConfig:
    groups = tuple(_group_spec(g, cfg.blocks_per_chunk) for g in kv_cache_config.kv_cache_groups)
    parallel = vllm_config.parallel_config
    return SchedulerOffloadConfig(
        groups=groups,
        offload_prompt_only=cfg.offload_prompt_only,
        max_defer_s=cfg.max_defer_s,
        max_deferrals=cfg.max_deferrals,
        num_workers=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
        hash_block_size=vllm_config.cache_config.block_size,
    )


def num_slots_for(cfg: KVTierConfig, kv_cache_config: Any) -> int:
    """Slots of the CPU tier: both sides compute it alike from the KV-cache config.

    A slot holds one chunk of one group: `blocks_per_chunk` pages of each of its layers.
    """
    slot_bytes = max(
        cfg.blocks_per_chunk * g.kv_cache_spec.page_size_bytes * len(g.layer_names)
        for g in kv_cache_config.kv_cache_groups
    )
    return cfg.cpu_bytes // slot_bytes


def block_hash_bytes(vllm_config: Any) -> int:
    """Bytes of the engine's block hashes; an unknown algorithm stops the engine at start."""
    algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")
    if algo not in _HASH_BYTES:
        raise ConfigError(f"kvtier does not know vLLM's prefix_caching_hash_algo {algo!r}; "
                          f"use one of {sorted(_HASH_BYTES)}")
    return _HASH_BYTES[algo]
