"""How a chunk enters the CPU tier: admission, room made by eviction, a PENDING reservation, and
its completion (READY, or freed).

- `prepare_store` admits a key on its `store_threshold`-th offer (`kvtier.tiers.admission`);
  `prepare_promotion` (a chunk read back from a secondary tier) admits always and spares the
  request's own prefix chain. Eviction never takes the call's own keys or a pinned chunk.
- `complete_store` makes the written chunks READY (the policy holds them from then on, in the
  request's chain order) or frees them; `abandon` gives up on a PENDING write whose slot is
  freed only once the write reports.

`ChunkStores` is a part of `kvtier.tiers.cpu.manager.CPUTierManager` (a mixin): it shares the
manager's chunks, slots, policy, ledger and counters. Thread-safety: the manager's.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence

import numpy as np

from kvtier.base import ChunkState, PrepareStoreOutput, ReqContext, SlotSpec
from kvtier.errors import InvariantError
from kvtier.keys import OffloadKey, key_length_error
from kvtier.mrc import MissRatioCurve
from kvtier.policies import CachePolicy
from kvtier.policies.retention import RetentionBook
from kvtier.tiers.admission import ReuseGate
from kvtier.tiers.cpu.chains import ChainLinks
from kvtier.tiers.cpu.ledger import RequestLedger
from kvtier.tiers.cpu.slots import Chunk, SlotAllocator
from kvtier.tiers.quotas import TenantQuotas

__all__ = ["ChunkStores"]

_PENDING, _READY, _RETIRED = ChunkState.PENDING, ChunkState.READY, ChunkState.RETIRED


class _Protected:
    """Keys an eviction must spare: the call's own keys, those of `spared`, every pinned chunk and
    every parked one (a head whose tail is held); the parked ones a scan asked about are `passed`,
    the pinned ones `passed_pinned`."""

    __slots__ = ("chains", "chunks", "own", "passed", "passed_pinned", "spare_parked", "spared")

    def __init__(
        self,
        own: set[OffloadKey],
        spared: Sequence[Container[OffloadKey]],
        chunks: dict[OffloadKey, Chunk],
        chains: ChainLinks,
    ):
        self.own = own
        self.spared = spared
        self.chunks = chunks
        self.chains = chains
        self.passed: dict[OffloadKey, None] = {}
        self.passed_pinned: dict[OffloadKey, None] = {}
        self.spare_parked = True

    def __contains__(self, key: object) -> bool:
        if key in self.own:
            return True
        if self.chunks[key].pins > 0:  # type: ignore[index]
            self.passed_pinned[key] = None  # type: ignore[index]
            return True
        if self.spare_parked and self.chains.is_parked(key):  # type: ignore[arg-type]
            self.passed[key] = None  # type: ignore[index]
            return True
        return any(key in spared for spared in self.spared)


class ChunkStores:
    """The store side of `CPUTierManager`; see the module docstring."""

    # the manager's state this part reads and changes (set by CPUTierManager.__init__)
    medium: str
    key_bytes: int
    _policy: CachePolicy
    retention: RetentionBook
    _quotas: TenantQuotas
    _note: Callable[..., None]  # (and the manager's `_free` and `_emit`)
    _gate: ReuseGate
    mrc: MissRatioCurve
    _slots: SlotAllocator
    _chunks: dict[OffloadKey, Chunk]
    _ledger: RequestLedger
    _chains: ChainLinks
    is_readable: Callable[[OffloadKey], bool]
    _num_pending: int
    _num_evictable: int
    _num_retired: int
    _evictions: int
    _stores: int
    _failed_stores: int
    _rejected_stores: int  # (and the manager's `_free` and `_emit`)

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        for key in reversed(keys):
            self.mrc.store(key)
        return self._reserve(keys, ctx, admit=self._gate.admit, spared=())

    def prepare_promotion(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, spare: Iterable[OffloadKey] = ()
    ) -> PrepareStoreOutput | None:
        """`prepare_store` for keys read back from a secondary tier for the request `ctx`: no
        admission rule applies (a chunk asked for again has proven its reuse), and no chunk of
        the request's own chain is evicted for it (its prefix would thrash: promoting chunk
        n+1 must not evict chunk 0 that the same request is about to load), nor any of `spare`
        (chunks promoted for other requests that have not loaded them yet)."""
        return self._reserve(
            keys, ctx, admit=None, spared=(self._ledger.chain_keys(ctx.req_id), set(spare))
        )

    def _reserve(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext,
        admit: Callable[[OffloadKey, str], bool] | None,
        spared: Sequence[Container[OffloadKey]],
    ) -> PrepareStoreOutput | None:
        for key in keys:
            if len(key) != self.key_bytes:
                raise key_length_error(key, self.key_bytes)
        chunks = self._chunks
        self._ledger.extend_chain(ctx.req_id, keys)
        # an offer is the request's whose chunk it is (a lazy store's, retried at the next step under
        # another internal id, is still one offer of the request that computed it)
        offered_by = ctx.user_id or ctx.req_id
        new_keys = [
            k
            for k in dict.fromkeys(keys)
            if k not in chunks and (admit is None or admit(k, offered_by))
        ]
        tenant, quotas = ctx.tenant or "", self._quotas
        if (limit := quotas.limit(tenant)) is not None:
            new_keys = new_keys[:limit]  # a store beyond the whole quota keeps its head
        self._policy.prepare_insert(new_keys)  # before evicting: ARC's ghost hits
        protected = _Protected(set(keys), spared, chunks, self._chains)
        evicted: list[OffloadKey] = []
        if (
            excess := quotas.excess(tenant, len(new_keys))
        ) > 0:  # the tenant makes room among its own
            victims = self._evict(excess, quotas.all_but(tenant, protected), protected)
            if victims is None:
                self._rejected_stores += 1
                return None
            evicted = victims
        if (num_needed := len(new_keys) - self._slots.num_free - len(evicted)) > 0:
            victims = self._evict(num_needed, protected, protected)
            if victims is None and not evicted:
                self._rejected_stores += 1
                return None
            if victims is None:  # the room its own chunks made: for the head of the store
                new_keys = new_keys[: self._slots.num_free + len(evicted)]
            else:
                evicted += victims
        evicted_slots = tuple(chunks[key].slot for key in evicted)
        self._drop_evicted(evicted)
        quotas.charge(new_keys, tenant)
        slot_ids = self._slots.allocate(len(new_keys))
        if slot_ids is None:
            raise InvariantError("no free slot after a successful eviction")
        for key, slot in zip(new_keys, slot_ids, strict=False):
            chunks[key] = Chunk(slot)
        self._num_pending += len(new_keys)
        spec = SlotSpec(self.medium, np.array(slot_ids, dtype=np.int64))
        return PrepareStoreOutput(new_keys, spec, evicted, evicted_slots)

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
                continue  # unknown or already completed: a stale or repeated completion
            if chunk.state is _RETIRED:
                self._num_retired -= 1
                self._free(key, chunk)  # reset() dropped it while its write was in flight
                continue
            self._num_pending -= 1
            if success:
                chunk.state = _READY
                ready.append(key)
            else:
                self._failed_stores += 1
                self._free(key, chunk)
        if ready:
            self._note(ready, ctx, is_new=True)
            self.retention.note_tenant(ready, ctx.tenant)
            self._policy.insert(ready)
            # what the chunks continue ranks them too (turns: their depth); their heads leave the
            # eviction order while they are held (`kvtier.tiers.cpu.chains`): O(chunks), not O(prefix)
            parents = self._ledger.parents(ctx.req_id, ready)
            head = parents[0][0]
            self._policy.order_chain(
                ready if head is None or not self.is_readable(head) else [head, *ready]
            )
            self._chains.link(ready, parents, self.is_readable)
            self._num_evictable += len(ready)
            self._stores += len(ready)
            self._emit(ready, removed=False)
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

    def _evict(
        self, n: int, protected: Container[OffloadKey], spared: _Protected
    ) -> list[OffloadKey] | None:
        """`n` victims in the policy's order, none of them `protected` (`spared` is or is wrapped in
        it), or None when fewer can go.

        A parked head is spared until its last continuation goes (`kvtier.tiers.cpu.chains`), and
        then takes its place: the next victim. So while chains are held victims are asked for one
        at a time (a round of two could take a chain's tail and then, its head still spared, a
        chunk ranked above that head: a retained one, found by the stack fuzzer), and a head a
        victim frees goes at once while more are needed if the policy agrees it is next
        (`CachePolicy.evict_in_place`: a chain goes tail first at one cheap call a chunk). Should
        that fall short (heads kept by pinned tails: a write-through pins each chunk it writes),
        the rest are taken from the parked heads too, in the policy's order, rather than fail the
        store; only if even they fall short is None returned, and the victims taken are put back,
        first in line: a refused store evicts nothing (an `on_evict` tier would never get them).
        """
        if n > self._num_evictable:
            return None
        if not self._chains.num_parked:
            return self._victims(n, protected, spared)
        taken: list[OffloadKey] = []
        links: list[
            tuple[OffloadKey, OffloadKey | None]
        ] = []  # each victim and the head it stood on
        while len(taken) < n:
            victims = self._victims(1, protected, spared, is_one_of_many=n > 1)
            if victims is None:
                break
            self._take_freed_heads(victims, n, protected, taken, links)
        if len(taken) < n:
            spared.spare_parked = False
            victims = self._victims(n - len(taken), protected, spared)
            spared.spare_parked = True
            if victims is None:
                self._put_back(taken, links)
                return None
            self._take_freed_heads(victims, len(taken) + len(victims), protected, taken, links)
        return taken

    def _victims(
        self,
        n: int,
        protected: Container[OffloadKey],
        spared: _Protected,
        is_one_of_many: bool = False,
    ) -> list[OffloadKey] | None:
        """The policy's `evict`; then the parked chunks it passed are ranked out of its way again,
        and, when this is one of many calls of one eviction (`is_one_of_many`), the pinned ones
        too: a chunk in use (loaded, or written down) is as recent as a use, and each call would
        scan them all again (1,000 pinned chunks and a store of 256: 255,256 tests of `spared`)."""
        victims = self._policy.evict(n, protected)
        if spared.passed:
            self._chains.rank_last(list(spared.passed))
            spared.passed.clear()
        if spared.passed_pinned:
            if is_one_of_many:
                self._policy.rank_last(list(spared.passed_pinned))
            spared.passed_pinned.clear()
        return victims

    def _take_freed_heads(
        self,
        victims: list[OffloadKey],
        n: int,
        protected: Container[OffloadKey],
        taken: list[OffloadKey],
        links: list[tuple[OffloadKey, OffloadKey | None]],
    ) -> None:
        """Add `victims` to `taken` (and their links to `links`); each head they free takes its tail's
        place, and goes too while `taken` is short of `n` and the policy agrees it is next."""
        taken += victims
        places = self._chains.unlink(victims, links)
        while places:
            head, tail = places.pop()
            if len(taken) >= n:
                self._policy.take_places((head,), (tail,))
            elif self._policy.evict_in_place(head, tail, protected):
                taken.append(head)
                places += self._chains.unlink((head,), links)

    def _put_back(
        self, victims: list[OffloadKey], links: list[tuple[OffloadKey, OffloadKey | None]]
    ) -> None:
        """Victims of an eviction that fell short (none a parked head), back where they were: in the
        policy, first in line (as new keys: what a policy knew of them is lost), linked to their heads."""
        if not victims:
            return
        self._policy.insert(victims)
        self._policy.take_places(victims, victims)
        self._chains.relink(reversed(links))

    def _drop_evicted(self, victims: list[OffloadKey]) -> list[OffloadKey]:
        chunks = self._chunks
        self._slots.free(chunks.pop(key).slot for key in victims)
        self._quotas.release(victims)
        self._num_evictable -= len(victims)
        self._evictions += len(victims)
        self._emit(victims, removed=True)
        return victims
