"""The disk tier's index: which keys are READY, being written, read or renamed; the room left.

- The READY keys (complete files under their final names) ARE the `CachePolicy`: nothing
  else is kept per key (LRU: 160 bytes a chunk at 1 M chunks, key included;
  benchmarks/bench_disk.py). Three small side tables: `pending` (key -> ticket of the store
  writing it), `pinned` (key -> number of loads reading it) and `busy` (keys whose final
  name a thread is renaming or unlinking right now). Capacity, in files, counts READY +
  pending keys.
- A final name changes (rename or unlink) only while its key is claimed in `busy`, and a
  file is unlinked only if its key is neither READY nor pending at that moment: so the
  late unlink of an evicted key never deletes the newer file of the same key.

No I/O, no threads: `kvtier.tiers.disk.tier.DiskTier` does those and tells the index what
happened. Thread-safety: call every method with `cond`'s lock held, except `claim` and
`release`, which take it themselves (`claim` waits on it), and `new_policy`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Container, Sequence

from kvtier.keys import OffloadKey
from kvtier.policies import CachePolicy, make_policy
from kvtier.policies.retaining import RetainingPolicy
from kvtier.policies.retention import RetentionBook
from kvtier.tiers.quotas import TenantQuotas

__all__ = ["DiskIndex", "Spared"]


class Spared:
    """Keys an eviction must spare: the call's own keys and every key being read."""

    __slots__ = ("own", "pinned")

    def __init__(self, own: Container[OffloadKey], pinned: Container[OffloadKey]):
        self.own = own
        self.pinned = pinned

    def __contains__(self, key: object) -> bool:
        return key in self.own or key in self.pinned


class DiskIndex:
    """READY, pending, pinned and busy keys of one disk tier of `capacity_files` files.

    Args:
        policy_spec: eviction policy name ("lru", "arc") or "module:Class".
        capacity_files: how many files the tier may hold (READY + pending).
        cond: the tier's condition; its lock guards the index.
        tenant_quotas: files each tenant may hold ({cache_salt or "*": files}; `kvtier.tiers.quotas`).
            A chunk's tenant is the one the manager's retention book remembers storing it; files
            the start-up scan found, or whose tenant is forgotten, count for no tenant.
    """

    def __init__(
        self,
        policy_spec: str,
        capacity_files: int,
        cond: threading.Condition,
        tenant_quotas: dict[str, int] | None = None,
    ):
        self.capacity_files = capacity_files
        self.policy = make_policy(policy_spec, capacity_files)
        self.pending: dict[OffloadKey, int] = {}
        self.pinned: dict[OffloadKey, int] = {}
        self.busy: set[OffloadKey] = set()
        # keys whose old file this tier decided to delete (evicted, corrupt, reset) but left to the
        # store writing them again (its rename replaces it; if it fails, the file is this tier's to delete)
        self.left_for_store: set[OffloadKey] = set()
        # keys a request waits for (`DiskTier.recheck`): the next `adopt` takes them past free room
        self.wanted: set[OffloadKey] = set()
        self._policy_spec = policy_spec
        self._cond = cond
        self._retention: RetentionBook | None = None
        self.quotas = TenantQuotas(tenant_quotas)
        self._tickets = itertools.count(1)

    def use_retention(self, book: RetentionBook) -> None:
        """Evict by the requests' hints from now on (`kvtier.policies.retention`); under the lock."""
        self._retention = book
        self.policy = RetainingPolicy(self.policy, book, self._cond)
        book.track_tenants |= self.quotas.is_enabled

    def new_policy(self) -> CachePolicy:
        """An empty policy of the index's kind (for the start-up scan to fill without the lock)."""
        return make_policy(self._policy_spec, self.capacity_files)

    def is_ready(self, key: OffloadKey) -> bool:
        return key in self.policy

    def holds(self, key: OffloadKey) -> bool:
        """Whether `key` is READY or being written."""
        return key in self.policy or key in self.pending

    # -- loads ------------------------------------------------------------------------------

    def pin(self, key: OffloadKey) -> None:
        self.pinned[key] = self.pinned.get(key, 0) + 1

    def unpin(self, key: OffloadKey) -> None:
        count = self.pinned.get(key, 0)
        if count <= 1:
            self.pinned.pop(key, None)
        else:
            self.pinned[key] = count - 1

    def forget(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Drop READY `keys` (their files are lost or bad); returns those that were READY."""
        dropped = self.policy.discard(keys)
        self.quotas.release(dropped)
        return dropped

    # -- stores -----------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey]) -> None:
        """Tell the policy which of `keys` a store may add, before it evicts (ARC's ghost hits)."""
        self.policy.prepare_insert([key for key in keys if not self.holds(key)])

    def reserve(self, key: OffloadKey, spared: Spared, victims: list[OffloadKey]) -> int | None:
        """Make room for `key`, appending what that evicts to `victims`, and mark it pending.

        Returns:
            The store's ticket, or None when there is no room now (every key is being read).
        """
        tenant = self._tenant(key)
        # at its quota: one of its own goes
        if tenant is not None and self.quotas.excess(tenant, 1) > 0:
            evicted = self.policy.evict(1, self.quotas.all_but(tenant, spared))
        elif len(self.policy) + len(self.pending) >= self.capacity_files:
            evicted = self.policy.evict(1, spared)
        else:
            evicted = []
        if evicted is None:
            return None
        victims.extend(evicted)
        self.quotas.release(evicted)
        if tenant is not None:
            self.quotas.charge([key], tenant)
        ticket = next(self._tickets)
        self.pending[key] = ticket
        return ticket

    def _tenant(self, key: OffloadKey) -> str | None:
        """The tenant a new file of `key` counts for (None: none, or no quotas)."""
        if not self.quotas.is_enabled or self._retention is None:
            return None
        return self._retention.tenant_of(key)

    def give_back(self, key: OffloadKey, ticket: int) -> None:
        """The store holding `ticket` failed: its reservation is free again."""
        if self.pending.get(key) == ticket:
            del self.pending[key]
            self.quotas.release([key])

    def commit(self, key: OffloadKey, ticket: int) -> bool:
        """The store holding `ticket` gave `key`'s file its final name: READY (its claim is
        released by the caller).

        Returns:
            False when the store no longer owns the key (a reset forgot it); nothing changes.
        """
        if self.pending.get(key) != ticket:
            return False
        del self.pending[key]
        self.policy.insert([key])
        # the rename replaced the old file
        self.left_for_store.discard(key)
        return True

    # -- final names --------------------------------------------------------------------------

    def claim(self, key: OffloadKey, may_change: Callable[[], bool]) -> bool:
        """Wait until no other thread renames or unlinks `key`'s file, then claim it if `may_change()`."""
        with self._cond:
            self._cond.wait_for(lambda: key not in self.busy)
            if not may_change():
                return False
            self.busy.add(key)
            return True

    def release(self, key: OffloadKey) -> None:
        with self._cond:
            self.busy.discard(key)
            self._cond.notify_all()

    # -- the directory -------------------------------------------------------------------------

    def install(self, scanned: CachePolicy, fresh: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Make `scanned` (built by the start-up scan) the policy, plus the `fresh` keys
        published during the scan (oldest first).

        Returns:
            The keys evicted to fit, whose files are still to be deleted.
        """
        fresh = [key for key in reversed(fresh) if key in self.policy]
        # stored during the scan: more recent than any scanned file
        scanned.insert(fresh)
        excess = len(scanned) + len(self.pending) - self.capacity_files
        victims: list[OffloadKey] = []
        if excess > 0:
            victims = scanned.evict(excess, Spared(set(fresh), self.pinned)) or []
        # a store still owns those
        self.quotas.release([key for key in victims if key not in self.pending])
        if isinstance(self.policy, RetainingPolicy):
            # the wrapper's aside chunks are among `fresh`, still held
            self.policy.inner = scanned
            self.policy.refile(fresh)
        else:
            self.policy = scanned
        return victims
        return victims

    def want(self, keys: Sequence[OffloadKey]) -> bool:
        """A request waits for `keys`: the next `adopt` takes those not READY; True if any."""
        missing = [key for key in keys if not self.is_ready(key)]
        self.wanted.update(missing)
        return bool(missing)

    def adopt(self, keys: Sequence[OffloadKey]) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """Add files other engines wrote, into free room only (never evicting ours for them) —
        except `wanted` keys, which a request waits for (`DiskTier.recheck`): room is made for
        those by forgetting the keys the policy would evict, whose files are left alone (another
        engine's, maybe deleted by it already: a decode engine that stores nothing fills its index
        with hand-offs the prefill engine evicts since, and without this never saw a new one).

        Returns:
            The keys adopted, and the keys forgotten for them.
        """
        wanted = self.wanted
        self.wanted = set()
        new = [key for key in keys if not self.holds(key) and key not in self.busy]
        room = max(self.capacity_files - len(self.policy) - len(self.pending), 0)
        needed = [key for key in new if key in wanted]
        forgotten: list[OffloadKey] = []
        if len(needed) > room:
            forgotten = self.policy.evict(len(needed) - room, Spared((), self.pinned)) or []
            self.quotas.release(forgotten)
            room += len(forgotten)
        others = [key for key in new if key not in wanted]
        adopted = (needed + others)[:room]
        self.policy.insert(adopted)
        return adopted, forgotten

    def clear(self) -> None:
        """Forget every key (`reset()`); claims in `busy` stay with their threads."""
        self.policy.clear()
        self.quotas.clear()
        self.pending.clear()
        self.pinned.clear()
        self.left_for_store.clear()
        self.wanted.clear()
