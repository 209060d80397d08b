"""`EngineLayout`: the engine's facts both halves of `KVTierConnector` need, derived once per process.

vLLM builds the connector once in the engine core (scheduler half) and once in every worker;
each builds one `EngineLayout` from vLLM's configs (`engine_layout`) and hands it to its half,
which reads the facts from it and derives none of them again. Every process derives them from
the same pickled configs with the same code; the host slab's size check (`kvtier.slab`) and the
scheduler's slot check (`kvtier.jobs.check_slab_slots`) stop the engine if they still differ.
The slot size is the workers' own formula (`kvtier.worker.layouts.chunk_bytes`) over the pages
vLLM declares, and each worker checks it against the tensors it registers.

The namespace is not here: it hashes the weights, so only the scheduler half computes it, from
this layout (`convert.namespace_for`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.scheduler import GroupKind, GroupSpec
from kvtier.slab import slab_name
from kvtier.worker.layouts import chunk_bytes

__all__ = [
    "EngineLayout",
    "check_slot_bytes",
    "engine_layout",
    "group_spec",
    "slot_bytes_for",
    "worker_slab_name",
    "world_size",
]


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """What kvtier must know of one engine, the same in every process of it.

    num_workers: workers of the engine (tensor x pipeline parallel ranks); each holds a slab
        and must report every job.
    num_slots: slots of each worker's slab, i.e. of the CPU tier: `cpu_bytes` is the host RAM
        of the whole engine, as vLLM's own `cpu_bytes_to_use`, so each slab gets
        `cpu_bytes / num_workers`. 0 is refused where a slab is made.
    slot_bytes: bytes of one slot of one worker: a chunk (`blocks_per_chunk` pages of every
        layer) of the largest group.
    blocks_per_chunk: engine blocks per chunk.
    slab_names: each worker rank's shared-memory slab, in rank order.
    groups: kvtier's view of each KV-cache group, in vLLM's order.
    layer_groups: the layer names of each group, in the same order.
    """

    num_workers: int
    num_slots: int
    slot_bytes: int
    blocks_per_chunk: int
    slab_names: tuple[str, ...]
    groups: tuple[GroupSpec, ...]
    layer_groups: tuple[tuple[str, ...], ...]

    @property
    def payload_bytes(self) -> int:
        """Bytes of one chunk across every worker rank."""
        return self.slot_bytes * self.num_workers


def engine_layout(cfg: KVTierConfig, vllm_config: Any, kv_cache_config: Any) -> EngineLayout:
    """This engine's layout, from kvtier's config and vLLM's."""
    num_workers = world_size(vllm_config)
    slot_bytes = slot_bytes_for(cfg.blocks_per_chunk, kv_cache_config)
    groups = kv_cache_config.kv_cache_groups
    return EngineLayout(
        num_workers=num_workers,
        num_slots=cfg.cpu_bytes // (slot_bytes * num_workers),
        slot_bytes=slot_bytes,
        blocks_per_chunk=cfg.blocks_per_chunk,
        slab_names=tuple(worker_slab_name(vllm_config, rank) for rank in range(num_workers)),
        groups=tuple(group_spec(g, cfg.blocks_per_chunk) for g in groups),
        layer_groups=tuple(tuple(g.layer_names) for g in groups),
    )


def check_slot_bytes(layout: EngineLayout, measured: int | None) -> None:
    """A worker's slot size, measured in the KV tensors it registered, must be the layout's, which
    the scheduler half sizes the slabs with (both apply `kvtier.worker.layouts.chunk_bytes`).
    `measured`: None if the worker has no KV caches registered (nothing to check).

    Raises:
        ConfigError: they differ (vLLM's tensors are not laid out as its KV-cache spec says).
    """
    if measured is not None and measured != layout.slot_bytes:
        raise ConfigError(
            f"kvtier: this worker's KV caches give {measured}-byte slots, but vLLM's KV-cache spec "
            f"gives {layout.slot_bytes} bytes (blocks_per_chunk {layout.blocks_per_chunk}): the "
            "scheduler would size the host slabs differently; this KV-cache layout is not supported"
        )


def world_size(vllm_config: Any) -> int:
    """Workers of one engine: tensor x pipeline parallel ranks."""
    parallel = vllm_config.parallel_config
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size


def slot_bytes_for(blocks_per_chunk: int, kv_cache_config: Any) -> int:
    """Bytes of one slot: the workers' formula (`kvtier.worker.layouts.chunk_bytes`) over the pages
    vLLM's KV-cache spec declares, one per layer, for the largest group."""
    return max(
        chunk_bytes(blocks_per_chunk, [g.kv_cache_spec.page_size_bytes] * len(g.layer_names))
        for g in kv_cache_config.kv_cache_groups
    )


def worker_slab_name(vllm_config: Any, rank: int) -> str:
    """Rank `rank`'s slab: named by the engine instance (`VllmConfig.instance_id`, set once where
    the config is made and pickled to the engine core and its workers alike) and its DP rank."""
    parallel = vllm_config.parallel_config
    dp_rank = getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
    return slab_name(vllm_config.instance_id, dp_rank, rank)


def group_spec(group: Any, blocks_per_chunk: int) -> GroupSpec:
    """kvtier's view of one of vLLM's KV-cache groups.

    A group is sliding-window only if every layer in it is, i.e. its spec is a
    `SlidingWindowSpec`. A `FullAttentionSpec` that carries a `sliding_window` is what vLLM
    makes of a model mixing both kinds when its hybrid KV-cache manager is off: one group
    whose blocks are all kept, read by full-attention layers too — so kvtier loads it whole.
    (Exact class names: subclasses such as MLA's lay KV out differently.)
    """
    spec = group.kv_cache_spec
    kind_name = type(spec).__name__
    if kind_name == "FullAttentionSpec":
        return GroupSpec(GroupKind.FULL, spec.block_size, blocks_per_chunk)
    if kind_name == "SlidingWindowSpec" and getattr(spec, "sliding_window", None):
        return GroupSpec(
            GroupKind.SLIDING_WINDOW,
            spec.block_size,
            blocks_per_chunk,
            sliding_window=spec.sliding_window,
            extra_retained_tokens=int(getattr(spec, "extra_retained_tokens", 0) or 0),
        )
    layers = list(getattr(group, "layer_names", ()))
    reason = f"{kind_name} (layers {layers[:3]}{'…' if len(layers) > 3 else ''}) is not a kind kvtier serves"
    return GroupSpec(GroupKind.UNSUPPORTED, spec.block_size, blocks_per_chunk, reason=reason)
