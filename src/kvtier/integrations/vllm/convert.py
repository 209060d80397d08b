"""vLLM objects -> kvtier's own small types (with `identity` and `layout`, the only places that read vLLM's
fields): requests, steps, the scheduler's config, the namespace."""

from __future__ import annotations

import json
import logging
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.identity import engine_digest, weights_identity
from kvtier.integrations.vllm.layout import EngineLayout, engine_layout
from kvtier.scheduler import RequestView, ScheduledBatch, SchedulerOffloadConfig, StepView
from kvtier.scheduler.config import ROLES
from kvtier.tiers.namespace import Namespace

__all__ = [
    "block_hash_bytes",
    "evict_lookahead",
    "evictable_blocks",
    "kv_role",
    "load_mode_for",
    "namespace_for",
    "request_view",
    "scheduler_config",
    "step_view",
    "worker_rank",
]

logger = logging.getLogger(__name__)

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
        tenant=getattr(request, "cache_salt", None),
        engine_request=request,
    )


def step_view(scheduler_output: Any) -> StepView:
    """A `StepView` of a `SchedulerOutput` (new, resumed and running requests, in its order).

    Read in place, no object per request (issue 37): the block id lists are vLLM's own (the
    scheduler copies what it keeps, within `build_connector_meta`), the running requests' columns
    are copies of vLLM's lists, the new requests' read from their `NewRequestData`.
    """
    counts = scheduler_output.num_scheduled_tokens
    new_reqs = scheduler_output.scheduled_new_reqs
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None)
    req_ids = [new.req_id for new in new_reqs]
    req_ids += cached.req_ids
    new_block_ids = [new.block_ids for new in new_reqs]
    new_block_ids += cached.new_block_ids
    num_computed = [new.num_computed_tokens for new in new_reqs]
    num_computed += cached.num_computed_tokens
    is_new_or_resumed = [True] * len(new_reqs)
    if resumed:
        is_new_or_resumed += [req_id in resumed for req_id in cached.req_ids]
    else:
        is_new_or_resumed += [False] * len(cached.req_ids)
    batch = ScheduledBatch(
        req_ids,
        new_block_ids,
        is_new_or_resumed,
        num_computed,
        [counts.get(req_id, 0) for req_id in req_ids],
    )
    return StepView(
        batch,
        set(scheduler_output.preempted_req_ids or ()),
        set(scheduler_output.finished_req_ids or ()),
    )


def evict_lookahead(vllm_config: Any, layout: EngineLayout) -> int:
    """How many free-queue blocks ahead a lazy store mode looks: what two steps can allocate,
    for every group (vLLM's own lazy CPU offloading reserves as much)."""
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    per_group = [-(-tokens // g.tokens_per_block) for g in layout.groups]
    return 2 * sum(per_group)


def evictable_blocks(block_pool: Any, lookahead: int) -> list[int]:
    """Ids of the cached blocks among the first `lookahead` of vLLM's free queue — the blocks the
    next allocations evict, first to go first (`BlockPool.get_new_blocks` pops from its head)."""
    found = []
    for i, block in enumerate(block_pool.free_block_queue.iter_blocks_after(None)):
        if i >= lookahead:
            break
        if block.block_hash is not None and not block.is_null:
            found.append(block.block_id)
    return found


def load_mode_for(cfg: KVTierConfig, num_groups: int) -> str:
    """`cfg.load_mode`, except that a model with several KV-cache groups always loads
    asynchronously: a failed synchronous load can only be reported as engine block ids, which
    repeat across groups, and vLLM stops the engine on such a report."""
    if cfg.load_mode == "sync" and num_groups > 1:
        logger.warning(
            "kvtier: load_mode 'sync' is not possible with %d KV-cache groups (a failed load could "
            "not be reported); loading asynchronously",
            num_groups,
        )
        return "async"
    return cfg.load_mode


def scheduler_config(
    cfg: KVTierConfig, vllm_config: Any, layout: EngineLayout
) -> SchedulerOffloadConfig:
    return SchedulerOffloadConfig(
        load_mode=load_mode_for(cfg, len(layout.groups)),
        store_mode=cfg.store_mode,
        groups=layout.groups,
        offload_prompt_only=cfg.offload_prompt_only,
        max_defer_s=cfg.max_defer_s,
        max_deferrals=cfg.max_deferrals,
        job_timeout_s=cfg.job_timeout_s,
        num_workers=layout.num_workers,
        hash_block_size=vllm_config.cache_config.block_size,
        load_policy=cfg.load_policy,
        chunk_bytes=layout.payload_bytes * len(layout.groups),
        role=kv_role(vllm_config),
        handoff_wait_s=cfg.handoff_wait_s,
        consumer_stores=cfg.consumer_stores,
        # vLLM's async scheduling plans step k+1 before step k ran (its batch queue holds two)
        steps_planned_ahead=1
        if getattr(vllm_config.scheduler_config, "async_scheduling", False)
        else 0,
    )


def kv_role(vllm_config: Any) -> str:
    """vLLM's `kv_role` of this engine ("kv_both" when it names none)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    role = getattr(transfer, "kv_role", None)
    return role if role in ROLES else "kv_both"


def worker_rank(vllm_config: Any, num_workers: int) -> int:
    """This worker's rank among the engine's `num_workers` workers: tp rank + pp rank x tp size.

    Read from vLLM's parallel state, which exists in a worker once its distributed
    environment is up (before its connector is built).
    """
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        if num_workers == 1:
            return 0
        raise ConfigError(
            "kvtier cannot tell this worker's rank: vLLM's model-parallel groups are not initialized"
        )
    tp = parallel_state.get_tp_group()
    return tp.rank_in_group + parallel_state.get_pp_group().rank_in_group * tp.world_size


def namespace_for(
    cfg: KVTierConfig, vllm_config: Any, kv_cache_config: Any, layout: EngineLayout | None = None
) -> Namespace:
    """What makes this engine's chunk bytes incompatible with another's (see `kvtier.tiers.namespace`).

    The model is named by what the engine computes with (`identity.engine_digest`: quantization,
    dtype, `hf_overrides`, config.json, …) and by its weights' content (`identity.weights_identity`),
    never by its path: replicas at other paths share, and weights replaced at one path do not.
    The KV-cache groups (spec class, page bytes, layers) and the device pin the layout. Computed
    once, at start, in the scheduler process (after vLLM loaded the weights): it hashes the
    weights, so it is not part of the `EngineLayout` every worker derives too. `layout`: the
    engine's, if derived already (None derives it).
    """
    layout = layout or engine_layout(cfg, vllm_config, kv_cache_config)
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    groups = [
        [type(g.kv_cache_spec).__name__, g.kv_cache_spec.page_size_bytes, list(g.layer_names)]
        for g in kv_cache_config.kv_cache_groups
    ]
    parallel = vllm_config.parallel_config
    namespace = Namespace(
        model=",".join(
            getattr(model.hf_config, "architectures", None) or [type(model.hf_config).__name__]
        ),
        dtype=f"{model.dtype}/{cache.cache_dtype}",
        kv_layout=f"{vllm_config.device_config.device_type}:{json.dumps(groups, separators=(',', ':'))}",
        block_size=cache.block_size,
        blocks_per_chunk=cfg.blocks_per_chunk,
        hash_algo=getattr(cache, "prefix_caching_hash_algo", "sha256"),
        world_size=layout.num_workers,
        slot_bytes=layout.slot_bytes,
        extra=f"tp={parallel.tensor_parallel_size},pp={parallel.pipeline_parallel_size}",
        engine=engine_digest(vllm_config),
        weights=weights_identity(model, vllm_config.load_config),
        label=f"{model.model}@{model.revision or ''} quantization={model.quantization}",
    )
    logger.info(
        "kvtier: namespace %s (%s; engine %s; weights %s)",
        namespace.id_hex,
        namespace.label,
        namespace.engine,
        namespace.weights,
    )
    return namespace


def block_hash_bytes(vllm_config: Any) -> int:
    """Bytes of the engine's block hashes; an unknown algorithm stops the engine at start."""
    algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")
    if algo not in _HASH_BYTES:
        raise ConfigError(
            f"kvtier does not know vLLM's prefix_caching_hash_algo {algo!r}; "
            f"use one of {sorted(_HASH_BYTES)}"
        )
    return _HASH_BYTES[algo]
