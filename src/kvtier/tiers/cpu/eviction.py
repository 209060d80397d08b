"""Choosing the CPU tier's victims: room for a store, first among its tenant's own chunks when
the tenant is over its quota (`kvtier.tiers.quotas`), in the policy's order, sparing the pinned
chunks, the store's own and the heads whose tail is held (`kvtier.tiers.cpu.chains`).

`Eviction` takes the victims out of the policy and unlinks them from their chains; when too few
can go it puts back what it took and says so: a refused store evicts nothing. What the victims
held (their slots, the counters, the events) is the tier's to release
(`kvtier.tiers.cpu.manager.CPUTierManager`); this class never sees a slot.

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvtier.keys import OffloadKey
from kvtier.policies import CachePolicy
from kvtier.tiers.cpu.chains import ChainLinks
from kvtier.tiers.cpu.slots import Chunk
from kvtier.tiers.quotas import TenantQuotas

__all__ = ["Eviction", "Protected"]

# each victim and the head it stood on (None: it continued no chunk)
_Links = list[tuple[OffloadKey, OffloadKey | None]]


class Protected:
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
        # most often nothing is spared: no generator then (asked once per key an eviction scans)
        return bool(self.spared) and any(key in spared for spared in self.spared)


class Eviction:
    """Victims of one tier, from its `policy` (which holds exactly its READY chunks), `chains` and
    tenant `quotas`."""

    def __init__(self, policy: CachePolicy, chains: ChainLinks, quotas: TenantQuotas):
        self._policy = policy
        self._chains = chains
        self._quotas = quotas

    def make_room(
        self,
        num_new: int,
        tenant: str,
        protected: Protected,
        num_free: int,
        num_evictable: int,
    ) -> tuple[list[OffloadKey], int] | None:
        """Victims that make room for `num_new` chunks of `tenant`, with `num_free` slots free and
        `num_evictable` chunks READY and unpinned: first the tenant's excess over its quota, among
        its own chunks, then the slots still missing.

        Returns:
            The victims and how many of the new chunks have room: all of them, or, when only the
            tenant's own victims could go, as many as they and the free slots make room for (the
            head of the store); None when not even that (nothing is evicted).
        """
        evicted: list[OffloadKey] = []
        excess = self._quotas.excess(tenant, num_new)
        if excess > 0:
            # the tenant makes room among its own
            others = self._quotas.all_but(tenant, protected)
            victims = self._take(excess, num_evictable, others, protected)
            if victims is None:
                return None
            evicted = victims
        num_needed = num_new - num_free - len(evicted)
        if num_needed <= 0:
            return evicted, num_new
        victims = self._take(num_needed, num_evictable, protected, protected)
        if victims is None and not evicted:
            return None
        if victims is None:
            # the room its own chunks made: for the head of the store
            return evicted, num_free + len(evicted)
        return evicted + victims, num_new

    def _take(
        self,
        n: int,
        num_evictable: int,
        protected: Container[OffloadKey],
        spared: Protected,
    ) -> list[OffloadKey] | None:
        """`n` victims in the policy's order, none of them `protected` (`spared` is or is wrapped in
        it), or None when fewer can go (of `num_evictable` chunks, at most).

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
        if n > num_evictable:
            return None
        if not self._chains.num_parked:
            return self._victims(n, protected, spared)
        taken: list[OffloadKey] = []
        links: _Links = []
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
        spared: Protected,
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
        links: _Links,
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

    def _put_back(self, victims: list[OffloadKey], links: _Links) -> None:
        """Victims of an eviction that fell short (none a parked head), back where they were: in the
        policy, first in line (as new keys: what a policy knew of them is lost), linked to their heads."""
        if not victims:
            return
        self._policy.insert(victims)
        self._policy.take_places(victims, victims)
        self._chains.relink(reversed(links))
