"""The CPU tier: metadata of the host slab that sits next to the engine: one class and the
invariants its `check()` verifies, kept beside the code that keeps them.

`CPUTierManager` is the primary tier of the `OffloadingManager` contract (see
`kvtier.base`). It owns the bookkeeping — one `Chunk` (slot, state, pin count) per
key, slot allocation, what each request holds (`RequestLedger`: pins, prefix chain),
counters, events — and delegates only the eviction order to a `CachePolicy` (the victims of
one eviction are chosen by `kvtier.tiers.cpu.eviction`). The bytes live in the host slab; this
class never sees them.

How a chunk enters: `prepare_store` admits a key on its `store_threshold`-th offer
(`kvtier.tiers.admission`), `prepare_promotion` (read back from a secondary tier) always; both
make room by eviction and reserve PENDING slots, which `complete_store` makes READY or frees.

Invariants (verified by `check()`):
- every chunk has exactly one slot; used + free slots = num_slots;
- the policy holds exactly the READY chunks (PENDING and RETIRED are invisible to it),
  so a PENDING chunk is never evicted; pinned READY chunks, and heads whose tail is held
  (`kvtier.tiers.cpu.chains`), are protected at eviction;
- a chunk's pin count equals the pins its requests hold;
- the pending, retired, pinned and evictable counters equal what the chunks say;
- the tenant quotas charge exactly the chunks the tier holds.

Thread-safety: not thread-safe. The scheduler calls it from one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence

import numpy as np

from kvtier.base import (
    NOT_KNOWN_YET,
    ChunkState,
    LoadSpec,
    LookupResult,
    ManagerStats,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    SlotSpec,
)
from kvtier.errors import ConfigError, InvariantError, NotReadyError
from kvtier.keys import OFFLOAD_KEY_BYTES, OffloadKey, key_length_error
from kvtier.mrc import MissRatioCurve
from kvtier.policies import make_policy
from kvtier.policies.retaining import RetainingPolicy
from kvtier.policies.retention import RetentionBook
from kvtier.tiers.admission import ReuseGate
from kvtier.tiers.cpu.chains import ChainLinks
from kvtier.tiers.cpu.eviction import Eviction, Protected
from kvtier.tiers.cpu.ledger import RequestLedger
from kvtier.tiers.cpu.slots import Chunk, SlotAllocator
from kvtier.tiers.quotas import TenantQuotas

__all__ = ["CPUTierManager"]

_PENDING = ChunkState.PENDING
_READY = ChunkState.READY
_RETIRED = ChunkState.RETIRED
_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_HIT_PENDING = LookupResult.HIT_PENDING


class CPUTierManager(OffloadingManager):
    """Offloaded-chunk metadata for a host slab of `num_slots` slots.

    Args:
        num_slots: slab capacity in chunks.
        policy: eviction policy name ("lru", "arc") or "module:Class".
        store_threshold: store a key only on its N-th offer (1 = always).
        enable_events: record stored/removed events for `take_events`.
        key_bytes: length of every offload key (block-hash bytes + 4).
        retention: the requests' hints, shared with the tiers behind this one (a new book if None).
        tenant_quotas: slots each tenant may hold ({cache_salt or "*": slots}; `kvtier.tiers.quotas`).
    """

    medium = "cpu"

    def __init__(
        self,
        num_slots: int,
        policy: str = "lru",
        store_threshold: int = 1,
        enable_events: bool = True,
        key_bytes: int = OFFLOAD_KEY_BYTES,
        retention: RetentionBook | None = None,
        tenant_quotas: dict[str, int] | None = None,
    ):
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ConfigError(
                f"num_slots must be a positive int, got {num_slots!r}; raise cpu_bytes or shrink chunks"
            )
        if key_bytes <= 4:
            raise ConfigError(f"key_bytes must exceed the 4-byte group index, got {key_bytes}")
        self.num_slots = num_slots
        self.key_bytes = key_bytes
        self.enable_events = enable_events
        if retention is None:
            retention = RetentionBook(max_entries=max(8 * num_slots, 1 << 16))
        self.retention = retention
        self._policy = RetainingPolicy(make_policy(policy, num_slots), self.retention)
        self._quotas = TenantQuotas(tenant_quotas)
        self._gate = ReuseGate(store_threshold, max_tracked=max(4 * num_slots, 1024))
        self._slots = SlotAllocator(num_slots)
        self._chunks: dict[OffloadKey, Chunk] = {}
        # this tier's hit ratio at other sizes, from its lookups and stores
        self.mrc = MissRatioCurve(capacity_chunks=num_slots)
        self._ledger = RequestLedger()
        self._chains = ChainLinks(self._policy)
        self._eviction = Eviction(self._policy, self._chains, self._quotas)
        self._events: list[OffloadingEvent] = []
        # chunks by state (`check()` recounts them)
        self._num_pending = 0
        self._num_pinned = 0
        self._num_evictable = 0
        self._num_retired = 0
        # what `stats()` reports
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._stores = 0
        self._failed_stores = 0
        self._rejected_stores = 0
        self._released_pins = 0

    # -- lookups and loads -------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        if len(key) != self.key_bytes:
            raise key_length_error(key, self.key_bytes)
        chunk = self._chunks.get(key)
        if chunk is None or chunk.state is _RETIRED:
            self._misses += 1
            return _MISS
        if chunk.state is _READY:
            self._hits += 1
            return _HIT
        return _HIT_PENDING

    def place(self, key: OffloadKey) -> str | None:
        """`locate`'s answer for one key: this tier's medium when readable, `NOT_KNOWN_YET` while it
        is being written (stored, or read up from a tier behind: how long it still takes is not
        known here, and it is readable soon), None when not here (counts no hit or miss)."""
        chunk = self._chunks.get(key)
        if chunk is None or chunk.state is _RETIRED:
            return None
        return self.medium if chunk.state is _READY else NOT_KNOWN_YET

    def locate(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[str | None]:
        found: list[str | None] = [None] * len(keys)
        for i, key in enumerate(keys):
            found[i] = self.place(key)
            if found[i] is None:
                break
        return found

    def count_query(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.mrc.lookup_many(reversed(keys))

    def is_readable(self, key: OffloadKey) -> bool:
        """Whether `key` is READY (counts no hit or miss)."""
        chunk = self._chunks.get(key)
        return chunk is not None and chunk.state is _READY

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadSpec:
        chunks = self._chunks
        for key in keys:
            chunk = chunks.get(key)
            if chunk is None or chunk.state is not _READY:
                raise NotReadyError(
                    f"prepare_load: key {key.hex()[:16]}… is not a HIT; look it up first"
                )
        slots = []
        for key in keys:
            chunk = chunks[key]
            if chunk.pins == 0:
                self._num_pinned += 1
                self._num_evictable -= 1
            chunk.pins += 1
            slots.append(chunk.slot)
        self._ledger.pin_all(ctx.req_id, keys)
        self._note(keys, ctx)
        return SlotSpec(self.medium, np.array(slots, dtype=np.int64))

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._policy.touch(keys)
        self._chains.used(keys)
        self._ledger.extend_chain(ctx.req_id, keys)
        self._note(keys, ctx)

    def join_chain(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """`keys` belong to the request's prefix (a lookup found them): its promotions spare them
        (see `prepare_promotion`) until it ends. No recency changes (that is `touch`)."""
        self._ledger.extend_chain(ctx.req_id, keys)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        for key in self._ledger.unpin_all(ctx.req_id, keys):
            self._unpin(key)

    # -- stores ------------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        self.mrc.store_many(reversed(keys))
        # a hand-off's chunks are wanted by another engine whatever their offers; at a threshold
        # of 1 every offer is admitted (no call per key)
        admit = None if ctx.hands_off or self._gate.threshold == 1 else self._gate.admit
        return self._reserve(keys, ctx, admit=admit, spared=())

    def prepare_promotion(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, spare: Iterable[OffloadKey] = ()
    ) -> PrepareStoreOutput | None:
        """`prepare_store` for keys read back from a secondary tier for the request `ctx`: no
        admission rule applies (a chunk asked for again has proven its reuse), and no chunk of
        the request's own chain is evicted for it (its prefix would thrash: promoting chunk
        n+1 must not evict chunk 0 that the same request is about to load), nor any of `spare`
        (chunks promoted for other requests that have not loaded them yet)."""
        spared = (self._ledger.chain_keys(ctx.req_id), set(spare))
        return self._reserve(keys, ctx, admit=None, spared=spared)

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> list[OffloadKey]:
        """See `OffloadingManager.complete_store`.

        Returns:
            The keys that became READY (a tiered manager cascades them).
        """
        chunks = self._chunks
        ready: list[OffloadKey] = []
        for key in keys:
            chunk = chunks.get(key)
            if chunk is None or chunk.state is _READY:
                # unknown or already completed: a stale or repeated completion
                continue
            if chunk.state is _RETIRED:
                # reset() dropped it while its write was in flight
                self._num_retired -= 1
                self._free(key, chunk)
                continue
            self._num_pending -= 1
            if success:
                chunk.state = _READY
                ready.append(key)
            else:
                self._failed_stores += 1
                self._free(key, chunk)
        if ready:
            self._make_ready(ready, ctx)
        return ready

    def abandon(self, keys: Sequence[OffloadKey]) -> None:
        """Writes into these PENDING chunks were given up on (a promotion past its deadline): they
        read as MISS from now on, and their slots are freed when the write reports (`complete_store`),
        never before — a late write may still fill them."""
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is not None and chunk.state is _PENDING:
                chunk.state = _RETIRED
                self._num_pending -= 1
                self._num_retired += 1

    # -- lifecycle ---------------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def use_clock(self, clock: Callable[[], float]) -> None:
        self.retention.set_clock(clock)

    def on_request_finished(self, ctx: ReqContext) -> None:
        # Hints are kept from the request's end. A lazy store's context (`on_behalf_of`) ends once
        # its chunks are stored, usually after the request that computed them ended: its end is
        # theirs, and the request's `end_session` drops them as the request's own end would have
        # (also while it still runs, preempted or past a sliding window: its session is ending).
        user_id = ctx.user_id
        if not ctx.hints.is_empty and user_id is not None:
            chain = self._ledger.chain(ctx.req_id)
            self.retention.note(chain, ctx.hints, ctx.tenant, req_id=user_id)
            if ctx.hints.end_session:
                # its session's end drops them
                self.retention.end_session(ctx.hints, chain, ctx.tenant)
        for key, count in self._ledger.release(ctx.req_id).items():
            for _ in range(count):
                self._released_pins += 1
                self._unpin(key)

    def reset(self) -> None:
        removed: list[OffloadKey] = []
        for key, chunk in list(self._chunks.items()):
            if chunk.state is _READY:
                removed.append(key)
            if chunk.state is _RETIRED:
                # an earlier reset's: still in use, freed when its transfer ends
                continue
            if chunk.pins > 0 or chunk.state is _PENDING:
                self._num_retired += 1
                # in use by a transfer: freed when it ends
                chunk.state = _RETIRED
            else:
                self._free(key, chunk)
        self._num_pending = 0
        self._num_evictable = 0
        self._policy.clear()
        self._chains.clear()
        self._gate.clear()
        self.retention.clear()
        self._emit(removed, removed=True)

    def stats(self) -> ManagerStats:
        return ManagerStats(
            medium=self.medium,
            num_slots=self.num_slots,
            used_slots=self.num_slots - self._slots.num_free,
            pinned_slots=self._num_pinned,
            pending_slots=self._num_pending,
            evictable_slots=self._num_evictable,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            stores=self._stores,
            failed_stores=self._failed_stores,
            rejected_stores=self._rejected_stores,
            extra={"released_pins": self._released_pins, "retired_slots": self._num_retired},
        )

    def check(self) -> None:
        """Cross-check every invariant of the module docstring (O(n); for tests).

        Raises:
            InvariantError: naming the first inconsistency found.
        """
        chunks = self._chunks
        slots = [c.slot for c in chunks.values()]
        _require(len(set(slots)) == len(slots), "two chunks share a slot")
        free = self._slots.free_ids()
        _require(not free & set(slots), "a chunk's slot is also free")
        _require(len(free) + len(slots) == self.num_slots, "used + free slots != num_slots")
        ready = {k for k, c in chunks.items() if c.state is _READY}
        _require(
            len(self._policy) == len(ready) and all(k in self._policy for k in ready),
            "the policy does not hold exactly the READY chunks",
        )
        self._chains.check(ready)
        held = self._ledger.all_pins()
        _require(
            all(held[k] == c.pins for k, c in chunks.items()),
            "pin counts differ from the pins requests hold",
        )
        _require(all(k in chunks for k in held), "a request pins an unknown chunk")
        _require(
            all(c.state is not _PENDING or c.pins == 0 for c in chunks.values()),
            "a PENDING chunk is pinned",
        )
        _require(self._num_pending == self._count(_PENDING), "pending counter drifted")
        _require(self._num_retired == self._count(_RETIRED), "retired counter drifted")
        _require(
            self._num_pinned == sum(c.pins > 0 for c in chunks.values()), "pinned counter drifted"
        )
        _require(
            self._quotas.check(list(chunks)),
            "tenant quotas charge other chunks than the tier holds",
        )
        _require(
            self._num_evictable == sum(c.pins == 0 for c in chunks.values() if c.state is _READY),
            "evictable counter drifted",
        )

    def __len__(self) -> int:
        """Number of readable (READY) chunks."""
        return len(self._policy)

    def ready_keys(self) -> list[OffloadKey]:
        """The readable (READY) chunks' keys: what this tier's events say it holds (O(n); tests, inspection)."""
        return [k for k, c in self._chunks.items() if c.state is _READY]

    # -- helpers -----------------------------------------------------------------------

    def _note(self, keys: Sequence[OffloadKey], ctx: ReqContext, is_new: bool = False) -> None:
        """A request used `keys` (stored them: `is_new`), itself or through a lazy store made on its
        behalf: tell the retention book, unless kvtier itself is the user (a write-down's pins)."""
        user_id = ctx.user_id
        if user_id is not None:
            self.retention.note(keys, ctx.hints, ctx.tenant, is_new, user_id)

    def _reserve(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext,
        admit: Callable[[OffloadKey, str], bool] | None,
        spared: Sequence[Container[OffloadKey]],
    ) -> PrepareStoreOutput | None:
        """Admit `keys`, make room for them and reserve their slots PENDING (see the module
        docstring); None when there is no room now (the store is refused, nothing evicted)."""
        for key in keys:
            if len(key) != self.key_bytes:
                raise key_length_error(key, self.key_bytes)
        chunks = self._chunks
        self._ledger.extend_chain(ctx.req_id, keys)
        # an offer is the request's whose chunk it is (a lazy store's, retried at the next step
        # under another internal id, is still one offer of the request that computed it)
        offered_by = ctx.user_id or ctx.req_id
        new_keys = []
        for key in dict.fromkeys(keys):
            if key in chunks:
                continue
            if admit is None or admit(key, offered_by):
                new_keys.append(key)
        tenant = ctx.tenant or ""
        limit = self._quotas.limit(tenant)
        if limit is not None:
            # a store beyond the whole quota keeps its head
            new_keys = new_keys[:limit]
        # before evicting: ARC's ghost hits
        self._policy.prepare_insert(new_keys)
        protected = Protected(set(keys), spared, chunks, self._chains)
        num_free = self._slots.num_free
        room = self._eviction.make_room(
            len(new_keys), tenant, protected, num_free, self._num_evictable
        )
        if room is None:
            self._rejected_stores += 1
            return None
        evicted, num_fit = room
        new_keys = new_keys[:num_fit]
        evicted_slots = tuple(chunks[key].slot for key in evicted)
        self._drop_evicted(evicted)
        self._quotas.charge(new_keys, tenant)
        slot_ids = self._slots.allocate(len(new_keys))
        if slot_ids is None:
            raise InvariantError("no free slot after a successful eviction")
        for key, slot in zip(new_keys, slot_ids, strict=False):
            chunks[key] = Chunk(slot)
        self._num_pending += len(new_keys)
        spec = SlotSpec(self.medium, np.array(slot_ids, dtype=np.int64))
        return PrepareStoreOutput(new_keys, spec, evicted, evicted_slots)

    def _drop_evicted(self, victims: list[OffloadKey]) -> None:
        for key in victims:
            self._slots.free((self._chunks.pop(key).slot,))
        self._quotas.release(victims)
        self._num_evictable -= len(victims)
        self._evictions += len(victims)
        self._emit(victims, removed=True)

    def _make_ready(self, ready: list[OffloadKey], ctx: ReqContext) -> None:
        """`ready` just became READY: the retention book, the policy and the chains learn of them."""
        self._note(ready, ctx, is_new=True)
        self.retention.note_tenant(ready, ctx.tenant)
        self._policy.insert(ready)
        # what the chunks continue ranks them too (turns: their depth); their heads leave the
        # eviction order while they are held (`kvtier.tiers.cpu.chains`): O(chunks), not O(prefix)
        parents = self._ledger.parents(ctx.req_id, ready)
        head = parents[0][0]
        if head is None or not self.is_readable(head):
            self._policy.order_chain(ready)
        else:
            self._policy.order_chain([head, *ready])
        self._chains.link(ready, parents, self.is_readable)
        self._num_evictable += len(ready)
        self._stores += len(ready)
        self._emit(ready, removed=False)

    def _unpin(self, key: OffloadKey) -> None:
        chunk = self._chunks[key]
        chunk.pins -= 1
        if chunk.pins:
            return
        self._num_pinned -= 1
        if chunk.state is _RETIRED:
            self._num_retired -= 1
            self._free(key, chunk)
        else:
            self._num_evictable += 1

    def _free(self, key: OffloadKey, chunk: Chunk) -> None:
        del self._chunks[key]
        self._quotas.release((key,))
        self._slots.free((chunk.slot,))

    def _emit(self, keys: list[OffloadKey], removed: bool) -> None:
        if self.enable_events and keys:
            self._events.append(OffloadingEvent(list(keys), self.medium, removed))

    def _count(self, state: ChunkState) -> int:
        return sum(c.state is state for c in self._chunks.values())


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)
