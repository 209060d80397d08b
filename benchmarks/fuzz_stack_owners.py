"""Whose each chunk is, as the stack fuzzer knows it — never as the tiers account it.

A chunk's key is the hash of its last block (and its KV-cache group); a block hash is salted
with its request's tenant (`cache_salt`), so every chunk has exactly one tenant, and the fuzzer
knows which requests computed or used it (`FakeEngine.requests`) and what each of them asked
(`Driver.kinds`): a keeper's hints (`fuzz_stack_build.keeper_hints`: retained an hour at a
priority), other hints, or none. The checks compare what the tiers hold against this: under
issue 32's defects 1 and 3 the tiers' own books agreed with themselves (every lazy store
charged to tenant "" and hinted as nothing), so only an outside account shows them.

`EvictionLog` records, for each store into the CPU tier, the chunks it evicted and those it
could have evicted instead (READY, unpinned, not its own), to check the eviction order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.base import ChunkState
from kvtier.keys import OffloadKey, split_offload_key
from kvtier.sim import FakeEngine
from kvtier.tiers.cpu.manager import CPUTierManager

__all__ = ["KEEPER", "PLAIN", "EvictionLog", "Owners"]

# what a request asked (`Driver.kinds`)
PLAIN = "plain"
HINTED = "hinted"
KEEPER = "keeper"


@dataclass
class _Block:
    tenant: str
    # what the requests that used it asked
    kinds: set[str] = field(default_factory=set)
    # its keepers' (one keeper prompt per block: their tokens are their own)
    priority: int | None = None


class Owners:
    """Every block hash of every request the engine was given: its tenant and what its users asked."""

    def __init__(self, engine: FakeEngine, kinds: dict[str, tuple[str, int | None]]):
        self._engine = engine
        # req_id -> (kind, keeper priority)
        self._kinds = kinds
        self._blocks: dict[bytes, _Block] = {}
        # requests whose hashes are all recorded (finished)
        self._done: set[str] = set()

    def update(self) -> None:
        """Record the blocks of the requests added or grown since the last call."""
        for req_id, req in self._engine.requests.items():
            if req_id in self._done:
                continue
            kind, priority = self._kinds.get(req_id, (PLAIN, None))
            for block_hash in req.block_hashes:
                block = self._blocks.setdefault(block_hash, _Block(req.cache_salt or ""))
                block.kinds.add(kind)
                if kind == KEEPER:
                    block.priority = priority
            if req.is_finished:
                self._done.add(req_id)

    def tenant(self, key: OffloadKey) -> str | None:
        block = self._blocks.get(split_offload_key(key)[0])
        return None if block is None else block.tenant

    def keeper_priority(self, key: OffloadKey) -> int | None:
        """The priority its keepers asked for, if only keepers used it (None otherwise)."""
        block = self._blocks.get(split_offload_key(key)[0])
        return block.priority if block is not None and block.kinds == {KEEPER} else None

    def is_plain(self, key: OffloadKey) -> bool:
        """Whether no request that used it gave a hint (its rank is ordinary)."""
        block = self._blocks.get(split_offload_key(key)[0])
        return block is not None and block.kinds == {PLAIN}


class EvictionLog:
    """The CPU tier's stores, watched (see the module docstring): wraps the tier object's
    `prepare_store`, which every store into it calls (the scheduler's and the tiered manager's).

    A store's victims are the READY chunks it removed (a store that fails may still have evicted
    some). The chunks it could have evicted instead are those READY and unpinned before it, not
    its own, and still there after it without a held continuation: a prefix's head waits for its
    tail (`kvtier.tiers.cpu.chains`, which calls such a head *parked*), but once the store took
    the tail, the head was the next in line. The tier's tables are private; they are read here
    only to know what was evictable, never to decide what each chunk is.
    """

    def __init__(self, primary: CPUTierManager):
        # (evicted, could have been)
        self.evictions: list[tuple[list[OffloadKey], set[OffloadKey]]] = []
        self._primary = primary
        self._real = primary.prepare_store
        primary.prepare_store = self._prepare_store  # type: ignore[method-assign]

    def _prepare_store(self, keys, ctx):
        chunks = self._primary._chunks
        own = set(keys)
        before = {
            k
            for k, c in chunks.items()
            if c.state is ChunkState.READY and c.pins == 0 and k not in own
        }
        out = self._real(keys, ctx)
        evicted = [k for k in before if k not in chunks]
        if evicted:
            chains = getattr(self._primary, "_chains", None)
            could_go = {
                k
                for k in before
                if k in chunks and not (chains is not None and chains.is_parked(k))
            }
            self.evictions.append((evicted, could_go))
        return out

    def take(self) -> list[tuple[list[OffloadKey], set[OffloadKey]]]:
        evictions, self.evictions = self.evictions, []
        return evictions
