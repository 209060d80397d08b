"""The offloading-manager contract and the small types that cross it: one concept, its
primitives in call order with their optional hooks, kept in one place.

An `OffloadingManager` holds metadata only: for every offloaded chunk (named by an
`OffloadKey`) where it lives, whether it can be read, and who pins it. It never
touches tensors. The primitives, in call order:

1. `lookup(key, ctx)` -> `LookupResult`: HIT readable now; HIT_PENDING stored but
   its write is in flight; RETRY not known yet (an asynchronous probe runs); MISS.
2. `prepare_load(keys, ctx)` -> `LoadSpec`: every key was a HIT; pins them.
3. `touch(keys, ctx)`: recency, also for chunks the engine's own cache served.
4. `complete_load(keys, ctx)`: unpins.
5. `prepare_store(keys, ctx)` -> `PrepareStoreOutput | None`: drops keys present or
   in flight, evicts unpinned chunks never belonging to this call, reserves slots
   in state PENDING. None means "no room now", never an exception.
6. `complete_store(keys, ctx, success)`: PENDING -> READY, or rollback on failure.
7. `take_events()`: stored / removed events, each with its tier (`medium`).
8. `on_request_finished(ctx)`, `reset()`, `stats()`, `tier_stats()`, `drain(timeout_s)`,
   `close()`.

For the load-or-recompute decision (`kvtier.costmodel`), before the lookups of a request:
`locate(keys, ctx)` says which tier holds each key without moving a byte, and
`read_estimates()` what reading from each tier behind this one costs now; `explore(medium, keys,
ctx)` reads a chunk of a tier the decision wrote off, to measure it again.

Every call carries a `ReqContext`: its required `req_id` is what lets the layers
below track a request (bounded waiting, pins released on finish).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.costmodel.estimates import ReadEstimate
from kvtier.errors import ConfigError
from kvtier.hints import NO_HINTS, Hints
from kvtier.keys import OffloadKey

__all__ = [
    "NOT_KNOWN_YET",
    "ChunkState",
    "LoadSpec",
    "LookupResult",
    "ManagerStats",
    "TierStats",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "SlotSpec",
    "StoreSpec",
]


@dataclass(frozen=True, slots=True)
class ReqContext:
    """Per-request context passed to every manager call.

    Args:
        req_id: the engine's request id; required, it is how state is tracked per request.
        kv_transfer_params: the request's `kv_transfer_params`, if any (untrusted input).
        hints: what the request says about its future, validated (`kvtier.hints`); the
            scheduler reads them from `kv_transfer_params`.
        tenant: the request's `cache_salt` (None: none), for tenant quotas (`kvtier.tiers.quotas`).
        on_behalf_of: set on kvtier's own context (an internal `req_id`) when it stores chunks that
            this engine request computed (lazy store mode stores them after the request may have
            ended): the tiers count the store as that request's use (its tenant's quota, its hints,
            its session) while `req_id` keeps the store's own pins and chain. None on an engine
            request's context and on kvtier's contexts that act for nobody (a write-down's pins).
        hands_off: the request's prefix is handed to another engine (`OffloadingManager.hand_off`).
    """

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    hints: Hints = NO_HINTS
    tenant: str | None = None
    on_behalf_of: str | None = None
    # the request's prefix goes to another engine (disaggregated prefill): the CPU tier's
    # admission rule does not keep its chunks out
    hands_off: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.req_id, str):
            raise ConfigError(
                f"ReqContext.req_id must be the request id as a str, got {type(self.req_id).__name__}"
            )
        if self.on_behalf_of is not None and not (
            self.is_internal and isinstance(self.on_behalf_of, str)
        ):
            raise ConfigError(
                "ReqContext.on_behalf_of names an engine request (a str) for kvtier's own context "
                f"(a req_id starting with NUL), got req_id={self.req_id!r}, "
                f"on_behalf_of={self.on_behalf_of!r}"
            )

    @property
    def is_internal(self) -> bool:
        """kvtier's own context (a write-down, lazy mode's stores): no engine request id starts with NUL."""
        return self.req_id.startswith("\x00")

    @property
    def user_id(self) -> str | None:
        """The engine request whose use of chunks a call is, for hints and quotas: this request, the
        one kvtier stores for (`on_behalf_of`), or None for kvtier's own use (a write-down's pins)."""
        if self.on_behalf_of is not None:
            return self.on_behalf_of
        return None if self.is_internal else self.req_id


class LookupResult(enum.Enum):
    """What a tier knows about one key right now."""

    # not stored (or not readable): recompute
    MISS = "miss"
    # readable now
    HIT = "hit"
    # stored, but its write is still in flight: ask again
    HIT_PENDING = "hit_pending"
    # not known yet (an asynchronous probe runs): ask again
    RETRY = "retry"


class ChunkState(enum.Enum):
    """Lifecycle of one chunk in a tier; the pin count is kept beside it."""

    # slot reserved, write in flight; invisible to loads
    PENDING = "pending"
    # readable; evictable when unpinned
    READY = "ready"
    # dropped by reset() while in use; freed when its transfer ends
    RETIRED = "retired"


@dataclass(frozen=True, slots=True)
class SlotSpec:
    """Where a transfer reads or writes in a tier: one slot id per key, in key order."""

    medium: str
    # int64, shape (num_keys,)
    slot_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.slot_ids)


# slots to read, in the order of the keys passed to prepare_load
LoadSpec = SlotSpec
# slots to write, in the order of PrepareStoreOutput.keys_to_store
StoreSpec = SlotSpec


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """Result of a successful `prepare_store`.

    keys_to_store: the keys the caller must write (absent and not in flight before).
    store_spec: one reserved slot per key of `keys_to_store`.
    evicted_keys: keys removed to make room (none of them belonged to the call).
    evicted_slot_ids: the slot each evicted key had, in the same order; its bytes stay there
        until the new keys are written (a tier that writes victims elsewhere copies them now).
    """

    keys_to_store: list[OffloadKey]
    store_spec: StoreSpec
    evicted_keys: list[OffloadKey]
    evicted_slot_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class OffloadingEvent:
    """Keys that became readable (`removed=False`) or were dropped from `medium`."""

    keys: list[OffloadKey]
    medium: str
    removed: bool


@dataclass(slots=True)
class ManagerStats:
    """A snapshot of one tier's occupancy and lifetime counters."""

    medium: str
    num_slots: int
    used_slots: int = 0
    pinned_slots: int = 0
    pending_slots: int = 0
    evictable_slots: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    stores: int = 0
    failed_stores: int = 0
    # prepare_store returned None
    rejected_stores: int = 0
    extra: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class TierStats:
    """A snapshot of one secondary tier: occupancy and lifetime counters.

    `counters` names: load_chunks, load_bytes, load_seconds_us, load_failures,
    store_chunks, store_bytes, store_seconds_us, store_failures, evictions, corrupt,
    hits, misses (tiers may add their own). `gauges`: states a tier reports as they are now.
    """

    medium: str
    capacity_bytes: int
    used_bytes: int = 0
    queued_store_bytes: int = 0
    counters: Counter[str] = field(default_factory=Counter)
    # tier-specific states (e.g. breaker_open)
    gauges: dict[str, float] = field(default_factory=dict)


# `locate`: a tier is still checking whether it holds the key
NOT_KNOWN_YET = "?"


class OffloadingManager(ABC):
    """Metadata for offloaded chunks of one tier (or a cascade of tiers).

    Subclasses state their own thread-safety; the scheduler calls a manager from one
    thread only.
    """

    medium: str = "unknown"

    @abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """Say whether `key` can be loaded now.

        Args:
            key: the chunk's offload key.
            ctx: the asking request.
        Returns:
            HIT, HIT_PENDING, RETRY or MISS.
        """

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadSpec:
        """Pin `keys` (all HIT) for reading and say where they are.

        Raises:
            NotReadyError: a key is not readable now (the caller broke the contract).
        """

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Mark `keys` recently used; the first key ends up the most recent."""

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Unpin `keys` after their load ended (successfully or not)."""

    @abstractmethod
    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not present nor in flight.

        Returns:
            The keys to write and their slots, or None when there is no room now.
        """

    @abstractmethod
    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Make PENDING `keys` READY, or roll them back and free their slots."""

    def take_events(self) -> list[OffloadingEvent]:
        """Return and forget the events since the last call (oldest first)."""
        return []

    def on_request_finished(self, ctx: ReqContext) -> None:  # noqa: B027 (an optional hook)
        """The request will make no more calls; release what it still holds."""

    def count_query(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027 (an optional hook)
        """The engine admitted the request that asked for `keys` (its chunks after the engine's own
        hits, in prefix order): once per request, for the tiers' miss-ratio curves (`kvtier.mrc`)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every chunk; chunks still in transfer are freed when it ends."""

    def close(self) -> None:  # noqa: B027 (an optional hook)
        """The engine shuts down: finish or abandon background work (bounded) and stop threads."""

    @abstractmethod
    def stats(self) -> ManagerStats:
        """Occupancy and counters (O(1))."""

    def tier_stats(self) -> list[TierStats]:
        """A snapshot of each tier behind this one (disk, Redis, S3), in search order.

        Returns:
            One `TierStats` per secondary tier; none for a manager without any.
        """
        return []

    def locate(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[str | None]:
        """Which tier holds each key, moving no bytes and pinning nothing.

        Args:
            keys: a request's chunks in prefix order.
            ctx: the asking request.
        Returns:
            Per key: the `medium` of the tier that would serve it (this manager's own for a chunk
            it holds, readable or being written), `NOT_KNOWN_YET` while a tier checks, None where
            no tier holds it. After the first None the rest may be None without being looked up.
        """
        found: list[str | None] = []
        for key in keys:
            result = self.lookup(key, ctx)
            if result is LookupResult.MISS:
                return found + [None] * (len(keys) - len(found))
            found.append(NOT_KNOWN_YET if result is LookupResult.RETRY else self.medium)
        return found

    def use_clock(self, clock: Callable[[], float]) -> None:  # noqa: B027 (an optional hook)
        """The clock the scheduler reads (monotonic seconds): hint durations count on it. Called
        once by the scheduler that drives this manager."""

    def read_estimates(self) -> dict[str, ReadEstimate]:
        """What reading a chunk from each tier behind this one costs now, by `medium` (measured
        from the tier's recent jobs; a tier not listed is read at its prior)."""
        return {}

    def explore(self, medium: str, keys: Sequence[OffloadKey], ctx: ReqContext) -> bool:
        """The load-or-recompute decision wrote off the tier `medium` behind this one (`ctx`'s
        request recomputes chunks found there): read one of `keys` from it in the background, to
        measure it (the bytes are not kept, no request waits for them), if its read estimate is stale
        (`kvtier.costmodel.exploration`).

        Returns:
            True if a read started.
        """
        return False

    def hand_off(self, keys: Sequence[OffloadKey], ctx: ReqContext, coming: bool = False) -> int:
        """Send a request's prefix to the tier another engine reads hand-offs from (disaggregated
        prefill, `kvtier.scheduler.handoff`), past its admission rule and its backpressure.

        Args:
            keys: the chunks a decode engine will need, in prefix order.
            ctx: the request that computed them.
            coming: the keys not here yet will be stored soon (their request's load is in flight):
                they count as on their way, and are written once readable.
        Returns:
            How many leading keys are on their way: readable here or being stored here (each is
            written to the hand-off tier once readable), or known to that tier already. 0 for a
            manager without a shared tier behind it.
        """
        return 0

    def recheck(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 (an optional hook)
        """A request was promised `keys` by another engine: the tiers behind this one look for them
        afresh at their next lookup (past a remembered absence, or a directory's rescan period)."""

    @property
    def handoff_medium(self) -> str | None:
        """The `medium` of the tier `hand_off` writes to (None: none)."""
        return None

    def is_reachable(self, medium: str) -> bool:
        """Whether the tier `medium` behind this one answers now (False also for a tier this
        manager lacks: nothing will appear in it that a request should wait for)."""
        return False

    def drain(self, timeout_s: float) -> bool:
        """Wait for the background jobs of the tiers behind this one (simulations, tests).

        Args:
            timeout_s: how long to wait at most (per tier).
        Returns:
            True if none is left running.
        """
        return True
