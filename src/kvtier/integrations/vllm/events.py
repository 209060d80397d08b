"""kvtier's offloading events -> vLLM KV cache events (`BlockStored` / `BlockRemoved`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvtier.base import OffloadingEvent
from kvtier.keys import split_offload_key

__all__ = ["to_kv_events"]

_MEDIUM = {"cpu": "CPU", "disk": "DISK", "redis": "REDIS"}


def to_kv_events(events: Iterable[OffloadingEvent]) -> Iterator[KVCacheEvent]:
    """One vLLM event per kvtier event and group; a chunk is named by its last block's hash."""
    for event in events:
        medium = _MEDIUM.get(event.medium, event.medium.upper())
        by_group: dict[int, list[bytes]] = {}
        for key in event.keys:
            block_hash, group = split_offload_key(key)
            by_group.setdefault(group, []).append(block_hash)
        for group, hashes in by_group.items():
            if event.removed:
                yield BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)
            else:
                yield BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0,
                                  lora_id=None, medium=medium, lora_name=None, group_idx=group)
