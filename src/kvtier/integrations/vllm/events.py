"""kvtier's offloading events -> vLLM's KV cache events, in the shape vLLM gives its own blocks, so that a
KV-aware router (llm-d, Dynamo, Ray Serve) indexes kvtier's tiers as it indexes the engine's GPU blocks.

A tier reports a chunk by its key alone (`kvtier.base.OffloadingEvent`). What a router needs beside it —
the chunk's token ids, the hash of every block in it, its parent (the hash of the block before it), LoRA
and `cache_salt` (`extra_keys`, filled by vLLM's own `generate_block_hash_extra_keys`), the session — is
taken from the live request when the scheduler offers the chunk to the tiers (`chunk_infos`, called once
per offer for the chunks of the current step only) and kept by `KVEventTranslator` while a tier holds the
chunk. It is taken then, not when a tier announces the chunk: the request may have ended by then (a lazy
store mode writes a chunk when the engine is about to evict it), and a description kept for later would
hold the whole request alive; in bench_sched_side's quick run 85 % of the chunks offered were stored.

Cost (issue 37): per chunk, no call into vLLM's helpers unless the request has LoRA, multimodal inputs or
prompt embeddings (a plain request's blocks have no extra keys but the first one's `cache_salt`), and
vLLM's integer-hash setting (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`) read once, when the translator is built.

Media: every event names its tier in the engine's vocabulary, as the tier's descriptor declares
it (`kvtier.tiers.secondary.TierDescriptor`: `event_medium`, `locality`, and `ownership`
`kvtier:<name>`): cpu is `CPU`/`LOCAL`, disk `STORAGE`/`LOCAL`, redis and s3 `STORAGE`/`REMOTE`.

(`ownership` is set for the CPU tier too, unlike vLLM's own offloading connector: a router can then tell
kvtier's RAM from vLLM's native CPU offloading on the same engine.) A chunk of `blocks_per_chunk` blocks is
announced as that many blocks, as vLLM's offloading connector does; its `BlockRemoved` lists the same hashes.

Bound: one `ChunkInfo` per chunk a tier holds (~0.5 KB for 16 tokens, ~0.9 KB for 128), at most `max_entries`,
plus the last `_MAX_DROPPED` no tier holds any more; past that the oldest are forgotten and their chunks' events
carry the hash alone (`token_ids=[]`, `block_size=0`, vLLM's own placeholder), as do chunks the engine never
offered (a disk found at start, a shared store's).

Thread-safety: not thread-safe; vLLM's scheduler thread calls it.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from vllm import envs
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

from kvtier.base import OffloadingEvent
from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey, split_offload_key
from kvtier.scheduler.config import GroupSpec
from kvtier.tiers.registry import tier_descriptor, tier_descriptors
from kvtier.tiers.secondary import TierDescriptor

logger = logging.getLogger(__name__)


class _Media(NamedTuple):
    """What the events of a tier nobody registered say of it: any name, checked by no one."""

    event_medium: str
    locality: str
    ownership: str


# what the events of tiers nobody registered (a custom manager's) say of them, by name
_UNREGISTERED: dict[str, _Media] = {}

__all__ = [
    "ChunkInfo",
    "KVEventTranslator",
    "chunk_info",
    "chunk_infos",
    "engine_publishes_events",
    "group_event_kinds",
]

# chunks no tier holds, still described (see KVEventTranslator._dropped)
_MAX_DROPPED = 4096


@dataclass(slots=True)
class ChunkInfo:
    """What a `BlockStored` of one chunk says beside its medium: one entry per block for hashes and extra keys."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    # uint32, the chunk's tokens
    token_ids: array
    block_size: int
    group: int
    lora_id: int | None = None
    lora_name: str | None = None
    # untagged, as vLLM publishes them
    extra_keys: list[tuple[Any, ...] | None] | None = None
    session_id: str | None = None
    # the tiers that hold it now (a tuple: a set would double an entry's size)
    tiers: tuple[str, ...] = ()

    def enter(self, tier: str) -> None:
        if tier not in self.tiers:
            self.tiers += (tier,)

    def leave(self, tier: str) -> None:
        self.tiers = tuple(t for t in self.tiers if t != tier)


def chunk_info(
    request: Any,
    spec: GroupSpec,
    group: int,
    chunk: int,
    hash_block_size: int,
    session_id: str | None,
) -> ChunkInfo:
    """`ChunkInfo` of chunk `chunk` of `group` of a live `vllm.v1.request.Request`, as vLLM's block pool
    describes its own blocks (`BlockPool.cache_full_blocks`): hashes and extra keys per block of the group's
    block size, the parent is the hash of the block before the chunk."""
    return chunk_infos(request, {group: spec}, [(group, chunk)], hash_block_size, session_id)[0]


def chunk_infos(
    request: Any,
    specs: Sequence[GroupSpec] | Mapping[int, GroupSpec],
    chunks: Sequence[tuple[int, int]],
    hash_block_size: int,
    session_id: str | None,
) -> list[ChunkInfo]:
    """`chunk_info` of each (group, chunk) of `chunks` (`specs[group]` its group's), in one loop: what the
    request says of all its chunks (LoRA, session, whether any block has extra keys) is read once.

    A request with no multimodal inputs, LoRA nor prompt embeddings has extra keys in its first block
    only, its `cache_salt`: every other block's are None without asking vLLM's
    `generate_block_hash_extra_keys` (issue 37: 40k calls in a quick benchmark run).
    """
    raw = request.block_hashes
    tokens = request.all_token_ids
    lora = request.lora_request
    lora_id = lora.adapter_id if lora else None
    lora_name = lora.name if lora else None
    session = session_id or getattr(request, "session_id", None)
    # blocks past the first have no extra keys
    plain = not request.mm_features and lora is None and request.prompt_embeds is None
    salted = bool(request.cache_salt)
    infos = []
    for group, chunk in chunks:
        spec = specs[group]
        tpb = spec.tokens_per_block
        bpc = spec.blocks_per_chunk
        scale = tpb // hash_block_size
        first_block = chunk * bpc
        start = first_block * tpb
        # the first block's cache_salt, or vLLM's keys
        asks_vllm = not plain or (start == 0 and salted)
        extra = _extra_keys(request, start, tpb, bpc) if asks_vllm else [None] * bpc
        infos.append(
            ChunkInfo(
                # the hash of each block's last hash block
                block_hashes=tuple(
                    raw[(first_block + 1) * scale - 1 : (first_block + bpc) * scale : scale]
                ),
                parent_block_hash=raw[first_block * scale - 1] if first_block else None,
                token_ids=array("I", tokens[start : start + bpc * tpb]),
                block_size=tpb,
                group=group,
                lora_id=lora_id,
                lora_name=lora_name,
                extra_keys=extra,
                session_id=session,
            )
        )
    return infos


def _extra_keys(
    request: Any, start: int, tpb: int, bpc: int
) -> list[tuple[Any, ...] | None] | None:
    """The untagged extra keys of `bpc` blocks of `tpb` tokens from token `start`, as vLLM's block pool
    publishes them."""
    extra = []
    mm_idx = 0
    for j in range(bpc):
        keys, mm_idx = generate_block_hash_extra_keys(
            request, start + j * tpb, start + (j + 1) * tpb, mm_idx
        )
        extra.append(keys)
    return to_event_extra_keys(extra)


def engine_publishes_events(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (`--kv-events-config` with `enable_kv_cache_events`)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def group_event_kinds(kv_cache_config: Any) -> tuple[tuple[str | None, int | None], ...]:
    """(kv_cache_spec_kind, sliding window) of each KV-cache group, as vLLM's KVCacheManager tags its events."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    return tuple(
        (
            get_kv_cache_spec_kind(g.kv_cache_spec).value,
            get_kv_cache_spec_sliding_window(g.kv_cache_spec),
        )
        for g in kv_cache_config.kv_cache_groups
    )


class KVEventTranslator:
    """Turns the tiers' events into vLLM's, from the `ChunkInfo` recorded when the chunks were offered.

    Args:
        max_entries: the most chunks described at once (the oldest recorded are forgotten first).
        group_kinds: `group_event_kinds` of the engine (empty: events carry no spec kind).
    """

    def __init__(self, max_entries: int, group_kinds: Sequence[tuple[str | None, int | None]] = ()):
        self.max_entries = max_entries
        self.group_kinds = tuple(group_kinds)
        # vLLM's `maybe_convert_block_hash` reads this through `envs` (os.environ) per hash: 68k
        # reads in a quick benchmark run (issue 37). Read once: vLLM's own caches it too once the
        # engine has started (`envs.enable_envs_cache`)
        self._int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        self._infos: OrderedDict[OffloadKey, ChunkInfo] = OrderedDict()
        # chunks no tier holds any more, the latest few: a disk written on RAM's evictions (`on_evict`)
        # announces a chunk some steps after RAM dropped it
        self._dropped: OrderedDict[OffloadKey, ChunkInfo] = OrderedDict()

    def __len__(self) -> int:
        return len(self._infos)

    def record(self, key: OffloadKey, info: ChunkInfo) -> None:
        """Describe `key` (a chunk being offered to the tiers now); keeps the tiers of an earlier record."""
        old = self._infos.pop(key, None) or self._dropped.pop(key, None)
        if old is not None:
            info.tiers = old.tiers
        self._infos[key] = info
        if len(self._infos) > self.max_entries:
            # forgotten, but its removal still names all its blocks
            self._drop(next(iter(self._infos)))

    def translate(self, events: Iterable[OffloadingEvent]) -> list[KVCacheEvent]:
        """One vLLM event per kvtier event and group, in order; a chunk no tier holds any more is forgotten."""
        out: list[KVCacheEvent] = []
        gone: set[OffloadKey] = set()
        for event in events:
            by_group: dict[int, list[Any]] = {}
            # what each of the event's BlockStored says of its tier
            media = None if event.removed else _descriptor(event.medium)
            for key in event.keys:
                info = self._infos.get(key)
                if event.removed:
                    if info is not None:
                        info.leave(event.medium)
                        gone.add(key)
                    hashes, group = self._hashes(key, info or self._dropped.get(key))
                    by_group.setdefault(group, []).extend(hashes)
                else:
                    info = info or self._dropped.get(key) or self._placeholder(key)
                    if key not in self._infos:
                        self.record(key, info)
                    info.enter(event.medium)
                    out.append(self._stored(info, media))
            out.extend(self._removed(event.medium, by_group))
        # after the batch: a removal may come before another tier's store of the chunk
        for key in gone:
            info = self._infos.get(key)
            if info is not None and not info.tiers:
                self._drop(key)
        return out

    def remove_all(self, tiers: Container[str]) -> list[KVCacheEvent]:
        """`BlockRemoved` of every chunk described in one of `tiers` (reset, for tiers that do not report
        what a reset drops), which no longer hold it."""
        by_tier: dict[str, dict[int, list[Any]]] = {}
        for key, info in list(self._infos.items()):
            for tier in [t for t in info.tiers if t in tiers]:
                hashes, group = self._hashes(key, info)
                by_tier.setdefault(tier, {}).setdefault(group, []).extend(hashes)
                info.leave(tier)
            if not info.tiers:
                self._drop(key)
        return [e for tier, by_group in by_tier.items() for e in self._removed(tier, by_group)]

    def remove_unannounced(self) -> list[KVCacheEvent]:
        """`BlockRemoved` of every chunk held by a tier whose reset does not announce what it drops
        (`TierDescriptor.announces_reset`): what a reset of every tier must publish for them."""
        silent = [d.name for d in tier_descriptors() if not d.announces_reset]
        return self.remove_all(silent)

    def _drop(self, key: OffloadKey) -> None:
        self._dropped[key] = self._infos.pop(key)
        if len(self._dropped) > _MAX_DROPPED:
            self._dropped.popitem(last=False)

    @staticmethod
    def _removed(tier: str, by_group: dict[int, list[Any]]) -> list[KVCacheEvent]:
        descriptor = _descriptor(tier)
        return [
            BlockRemoved(
                block_hashes=hashes,
                medium=descriptor.event_medium,
                group_idx=group,
                locality=descriptor.locality,
                ownership=descriptor.ownership,
            )
            for group, hashes in by_group.items()
        ]

    def _placeholder(self, key: OffloadKey) -> ChunkInfo:
        """A chunk the engine never offered (found on disk, in a shared store, or forgotten): its hash alone."""
        block_hash, group = split_offload_key(key)
        return ChunkInfo(
            block_hashes=(block_hash,),
            parent_block_hash=None,
            token_ids=array("I"),
            block_size=0,
            group=group,
        )

    def _hashes(self, key: OffloadKey, info: ChunkInfo | None) -> tuple[list[Any], int]:
        if info is not None:
            return self._external(info.block_hashes), info.group
        block_hash, group = split_offload_key(key)
        return self._external((block_hash,)), group

    def _external(self, hashes: Iterable[bytes]) -> list[Any]:
        """`hashes` as vLLM's events carry them (`maybe_convert_block_hash`)."""
        if self._int_hashes:
            # the low 64 bits of the hash read big-endian: its last 8 bytes
            return [int.from_bytes(h[-8:], "big") for h in hashes]
        return list(hashes)

    def _stored(self, info: ChunkInfo, descriptor: TierDescriptor | _Media) -> BlockStored:
        medium = descriptor.event_medium
        locality = descriptor.locality
        ownership = descriptor.ownership
        if info.block_size == 0:
            # vLLM's placeholder: the hash alone
            return BlockStored(
                block_hashes=self._hashes(b"", info)[0],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium=medium,
                lora_name=None,
                group_idx=info.group,
                locality=locality,
                ownership=ownership,
            )
        kind, window = None, None
        if info.group < len(self.group_kinds):
            kind, window = self.group_kinds[info.group]
        parent = info.parent_block_hash
        if parent is not None:
            parent = self._external((parent,))[0]
        return BlockStored(
            block_hashes=self._external(info.block_hashes),
            parent_block_hash=parent,
            token_ids=info.token_ids.tolist(),
            block_size=info.block_size,
            lora_id=info.lora_id,
            medium=medium,
            lora_name=info.lora_name,
            extra_keys=info.extra_keys,
            group_idx=info.group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            locality=locality,
            ownership=ownership,
            session_id=info.session_id,
        )


def _descriptor(tier: str) -> TierDescriptor | _Media:
    """The registered tier's descriptor. A tier nobody registered cannot come from `build_manager`
    (it refuses one), only from a custom manager: its events then name it as a shared store
    (STORAGE, REMOTE) and say so once in the log; an event is never why an engine step fails."""
    try:
        return tier_descriptor(tier)
    except ConfigError:
        pass
    if tier not in _UNREGISTERED:
        logger.warning(
            "kvtier events: tier %r is not registered; its events say medium STORAGE, "
            "locality REMOTE (register its slice to name them)",
            tier,
        )
        _UNREGISTERED[tier] = _Media("STORAGE", "REMOTE", f"kvtier:{tier}")
    return _UNREGISTERED[tier]
