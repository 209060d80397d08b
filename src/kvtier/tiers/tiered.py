"""`TieredManager`: the CPU tier as primary, an ordered list of secondary tiers behind it.

It is the one owner of all chunk metadata (see docs/architecture.md, "Who owns the bytes").
Workers only copy engine KV <-> host slab; this manager moves chunks host slab <-> secondary
tiers, by handing `TierJob`s over rows of the shared slab to the tiers, whose I/O runs on
threads of their own — never on the scheduler's thread, never inside the forward pass.

- **lookup**: the CPU tier's HIT / HIT_PENDING as before; on its MISS the secondaries are
  asked in order. RETRY (a probe runs) is a wait. A secondary HIT starts a **promotion**: a
  CPU slot is reserved (PENDING: other requests see HIT_PENDING, nothing is read twice),
  the tier reads the chunk into it in the background, and the chunk becomes READY when the
  read is checked. A full CPU tier answers MISS, not a wait. A promoted chunk is not evicted
  for another promotion before the request it was read for has loaded it (or ended):
  concurrent promotions evicting each other read ~12x the bytes they served in a replay
  with a small CPU tier. Promotions in flight are capped in bytes (`max_promotion_bytes`):
  past the cap a lookup answers RETRY until some end. The scheduler bounds each request's
  wait; a promotion it stopped waiting for still completes, for the next request. See
  `kvtier.tiers.promotions`.
- **explore**: a tier the load-or-recompute decision wrote off is measured again by reading one
  chunk into a scratch buffer (issue 32): no RAM slot is taken (a PENDING one made the request's
  own prefix read as "not known yet" to every request sharing it, and a RETIRED one kept its key
  out of RAM), nothing is evicted, no request waits, the bytes are dropped. One per tier at a
  time, until the tier reports it.
- **write down**: chunks are written to the secondaries as they become READY (write-through)
  or as the CPU tier evicts them (`on_evict`); see `kvtier.tiers.writedown`.
- A failed promotion frees its slot; the tier forgets a key it could not serve. Events and
  stats are per tier (`medium` "cpu", "disk", …).
- **miss-ratio curves** (`kvtier.mrc`): each tier's is fed with what the tier is asked for and
  written. What a tier is asked for: every chunk of a request's query when the engine admits it
  (`count_query`), once, beside the chunks written into the tier (stores, cascades). Not the
  lookups as they happen: the cost model's `locate` and the scan stop at the first miss, so the
  chunks a larger tier might turn into hits were never counted (a simulated conversation replay:
  the CPU tier's lookups hit 100 %); and an engine asks a waiting request again every step, by
  when its own prefix cache may hold what the request asked kvtier for before (a synthetic
  replay: predicted 0.25, got 0). The CPU tier counts every chunk of the query; a secondary tier
  the chunks RAM did not hold, or promoted from a tier behind it for this request.

Thread-safety: not thread-safe; the scheduler calls it from one thread. Tiers report
finished jobs through `get_finished`, which this manager polls at each call.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.base import (
    NOT_KNOWN_YET,
    LoadSpec,
    LookupResult,
    ManagerStats,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvtier.costmodel.estimates import ReadEstimate
from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey
from kvtier.mrc import MissRatioCurve, curve_gauges
from kvtier.tiers.cascade import SecondarySlot, TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.flights import READS, Flight, FlightKind, Flights
from kvtier.tiers.handoff import HandOffs
from kvtier.tiers.promotions import Promotions
from kvtier.tiers.rates import TierRates
from kvtier.tiers.registry import tier_descriptor
from kvtier.tiers.secondary import HEADER_BYTES, SecondaryTier, TierJob, TierStats
from kvtier.tiers.writedown import WriteDown

__all__ = ["TieredManager"]

logger = logging.getLogger(__name__)

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY
_CLOSE_DRAIN_S = 10.0


class TieredManager(OffloadingManager):
    """Metadata of a CPU tier and its secondary tiers, and the jobs between them.

    Args:
        primary: the CPU tier's bookkeeping.
        slabs: the host slab of every worker rank, rank order: uint8 arrays of shape
            (primary.num_slots, slot_bytes) (numpy views of the shared segments).
        secondaries: (tier, rules) pairs, searched in this order on a CPU miss.
        max_promotion_bytes: bytes of promotions in flight at most.
        staging_bytes: room for evicted chunks waiting for an `on_evict` tier.
        job_timeout_s: how long a tier job may take before the manager gives up on it (see
            `kvtier.tiers.flights`).
        handoff_tier: the `medium` of the secondary tier hand-offs go to (`kvtier.tiers.handoff`);
            "" picks the first shared one (a `REMOTE` tier), else none: a disk tier is shared only
            if its directory is, which this engine cannot know (named, it is used); None: none.
        handoff_store_s: how long a handed-off chunk may take to be stored into RAM first.
    """

    medium = "cpu"

    def __init__(
        self,
        primary: CPUTierManager,
        slabs: Sequence[np.ndarray],
        secondaries: Sequence[tuple[SecondaryTier, TierRules]],
        *,
        max_promotion_bytes: int = 256 * 2**20,
        staging_bytes: int = 64 * 2**20,
        job_timeout_s: float = 10.0,
        handoff_tier: str | None = "",
        handoff_store_s: float = 20.0,
    ):
        if not slabs or any(
            s.ndim != 2 or s.shape[0] != primary.num_slots or s.dtype != np.uint8 for s in slabs
        ):
            raise ConfigError(
                f"slabs must be uint8 arrays of {primary.num_slots} rows, one per worker rank"
            )
        if max_promotion_bytes <= 0:
            raise ConfigError(f"max_promotion_bytes must be positive, got {max_promotion_bytes}")
        self.primary = primary
        self.num_slots = primary.num_slots
        self.key_bytes = primary.key_bytes
        self.max_promotion_bytes = max_promotion_bytes
        self.payload_bytes = sum(s.shape[1] for s in slabs)
        self._slabs = list(slabs)
        self._tiers = [
            SecondarySlot(t, r, max_tracked=max(4 * primary.num_slots, 1024))
            for t, r in secondaries
        ]
        for tier, _ in secondaries:
            # one book of hints for every tier
            tier.use_retention(primary.retention)
        self._write_down = WriteDown(primary, self._tiers, slabs, staging_bytes, self._submit)
        self._promotions = Promotions(
            primary,
            self._tiers,
            self._write_down,
            self._rows,
            self._submit,
            self.payload_bytes,
            max_promotion_bytes,
        )
        self._handoffs = self._hand_offs(handoff_tier, handoff_store_s)
        self._flights = Flights(job_timeout_s)
        self._rates = TierRates(self.tiers)
        self._job_ids = itertools.count(1)
        # tiers with an exploration read not reported yet
        self._exploring: set[int] = set()

    def _hand_offs(self, name: str | None, store_s: float) -> HandOffs | None:
        """The hand-off writer of the tier `name` (see `__init__`), or None."""
        if name is None or not self._tiers:
            return None
        if name:
            index = next((i for i, s in enumerate(self._tiers) if s.tier.medium == name), None)
            if index is None:
                raise ConfigError(
                    f"handoff_tier {name!r} is not one of this engine's tiers "
                    f"{[s.tier.medium for s in self._tiers]}"
                )
        else:
            shared = [i for i, s in enumerate(self._tiers) if _is_shared(s.tier.medium)]
            if not shared:
                return None
            index = shared[0]
        return HandOffs(self.primary, self._tiers[index], index, self._write_down, store_s)

    @property
    def tiers(self) -> list[SecondaryTier]:
        return [t.tier for t in self._tiers]

    @property
    def mrc(self) -> MissRatioCurve:
        """The CPU tier's curve."""
        return self.primary.mrc

    # -- lookups and loads -------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._poll()
        result = self.primary.lookup(key, ctx)
        if result is not _MISS:
            # the scan goes on to the request's next chunks: promoting those must not evict this one
            self.primary.join_chain([key], ctx)
            return result
        for index, slot in enumerate(self._tiers):
            found = slot.tier.lookup(key)
            if found is _RETRY:
                return _RETRY
            if found is _HIT:
                return self._promotions.start(key, index, ctx)
        return _MISS

    def locate(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[str | None]:
        """(A secondary tier counts the question as one of its lookups: a chunk located, then looked
        up, counts twice in its hits. Remembering the answer for that lookup instead let a later
        scan promote a key a reset had deleted since: the stack fuzzer, run 777, saw such a load.)"""
        self._poll()
        found: list[str | None] = [None] * len(keys)
        for i, key in enumerate(keys):
            found[i] = self.primary.place(key)
            if found[i] is not None:
                continue
            for slot in self._tiers:
                result = slot.tier.lookup(key)
                if result is not _MISS:
                    found[i] = slot.tier.medium if result is _HIT else NOT_KNOWN_YET
                    break
            if found[i] is None:
                break
        return found

    def count_query(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """One use of each key in the CPU tier's curve, and in every secondary tier's for the keys
        RAM does not hold or that were promoted for this request (not loaded yet: the scheduler
        counts before it loads); see the module docstring."""
        cpu = self.primary
        cpu.mrc.lookup_many(keys)
        if not self._tiers:
            return
        promoted = self._promotions.awaited_by(ctx.req_id)
        missed = [key for key in keys if key in promoted or cpu.place(key) is None]
        for slot in self._tiers:
            slot.mrc.lookup_many(missed)

    def read_estimates(self) -> dict[str, ReadEstimate]:
        self._poll()
        return self._rates.estimates()

    def explore(self, medium: str, keys: Sequence[OffloadKey], ctx: ReqContext) -> bool:
        """Read the first of `keys` that the tier `medium` holds (and RAM does not) into a scratch
        buffer, to measure the tier, when its estimate is stale (`kvtier.tiers.rates`); see the
        module docstring. Tried at most once per exploration interval, started or not."""
        self._poll()
        index = next((i for i, slot in enumerate(self._tiers) if slot.tier.medium == medium), None)
        if index is None or index in self._exploring or not self._rates.may_explore(index):
            return False
        self._rates.explored(index)
        tier = self._tiers[index].tier
        key = None
        for candidate in keys:
            if self.primary.place(candidate) is not None:
                continue
            # (the tier counts the question as one of its lookups)
            if tier.lookup(candidate) is _HIT:
                key = candidate
                break
        if key is None:
            return False
        # the tier's job holds the buffers until it reports, however late: nothing else uses them
        scratch = tuple(memoryview(np.empty(slab.shape[1], dtype=np.uint8)) for slab in self._slabs)
        self._exploring.add(index)
        self._submit(FlightKind.EXPLORATION, index, (key,), ctx, (scratch,), ())
        return True

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadSpec:
        spec = self.primary.prepare_load(keys, ctx)
        self._promotions.loaded(ctx.req_id, keys)
        return spec

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.primary.touch(keys, ctx)
        for slot in self._tiers:
            slot.tier.touch(keys)
        self._write_down.count_offers(keys, ctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.primary.complete_load(keys, ctx)

    # -- stores ------------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        self._poll()
        self._write_down.count_offers(keys, ctx)
        out = self.primary.prepare_store(keys, ctx)
        if out is not None:
            self._write_down.write_evicted(out)
        return out

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        self._poll()
        ready = self.primary.complete_store(keys, ctx, success)
        if ready:
            self._write_down.cascade(ready)
            if self._handoffs is not None:
                self._handoffs.ready(ready)

    # -- hand-offs (`kvtier.tiers.handoff`) ----------------------------------------------

    def hand_off(self, keys: Sequence[OffloadKey], ctx: ReqContext, coming: bool = False) -> int:
        self._poll()
        if self._handoffs is None:
            return 0
        return self._handoffs.start(keys, coming)

    def recheck(self, keys: Sequence[OffloadKey]) -> None:
        for slot in self._tiers:
            slot.tier.recheck(keys)

    def is_reachable(self, medium: str) -> bool:
        return any(s.tier.medium == medium and s.tier.is_reachable for s in self._tiers)

    @property
    def handoff_medium(self) -> str | None:
        """The hand-off tier's `medium` (None: none)."""
        return None if self._handoffs is None else self._handoffs.medium

    # -- lifecycle ---------------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        self._poll()
        events = self.primary.take_events()
        for slot in self._tiers:
            events.extend(slot.tier.take_events())
        return events

    def use_clock(self, clock: Callable[[], float]) -> None:
        # its retention book is the tiers'
        self.primary.use_clock(clock)
        self._rates.use_clock(clock)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._promotions.forget(ctx.req_id)
        self.primary.on_request_finished(ctx)

    def reset(self) -> None:
        """Forget every chunk in every tier; jobs in flight free what they hold when they end."""
        self.primary.reset()
        self._promotions.clear()
        if self._handoffs is not None:
            self._handoffs.clear()
        for slot in self._tiers:
            slot.tier.reset()
            if slot.gate is not None:
                slot.gate.clear()

    def stats(self) -> ManagerStats:
        self._poll()
        stats = self.primary.stats()
        stats.extra["promoting_bytes"] = self._promotions.num_bytes
        stats.extra["tier_jobs_in_flight"] = len(self._flights)
        return stats

    def tier_stats(self) -> list[TierStats]:
        """Each secondary tier's stats, with the manager's counters for it added."""
        self._poll()
        out = []
        for slot in self._tiers:
            stats = slot.tier.stats()
            stats.counters.update(slot.counters)
            self._add_curve(slot, stats)
            out.append(stats)
        return out

    def drain(self, timeout_s: float) -> bool:
        """Wait until each tier's jobs ended, up to `timeout_s` per tier; True if none is left.
        Their results are applied at the next call."""
        is_drained = True
        for slot in self._tiers:
            # every tier drains, also after one that did not
            if not slot.tier.drain(timeout_s):
                is_drained = False
        return is_drained

    def close(self) -> None:
        """Wait (bounded) for the tiers' jobs, release what they held, stop the tiers."""
        deadline = time.monotonic() + _CLOSE_DRAIN_S
        for slot in self._tiers:
            if not slot.tier.drain(max(0.0, deadline - time.monotonic())):
                logger.warning(
                    "kvtier: %s tier still had jobs in flight at shutdown", slot.tier.medium
                )
        self._poll()
        for slot in self._tiers:
            slot.tier.close()

    # -- jobs --------------------------------------------------------------------------

    def _submit(
        self,
        kind: FlightKind,
        index: int,
        keys: tuple[OffloadKey, ...],
        ctx: ReqContext,
        buffers: tuple[tuple[memoryview, ...], ...],
        staging_rows: tuple[int, ...],
    ) -> Flight:
        """Start a tier job: record its flight (returned) and hand it to the tier `index`."""
        now = time.monotonic()
        job = TierJob(
            job_id=next(self._job_ids),
            is_store=kind not in READS,
            keys=keys,
            buffers=buffers,
            deadline=self._flights.deadline_for(now),
        )
        flight = Flight(kind, index, keys, ctx, job.num_bytes, now, job.deadline, staging_rows)
        self._flights.add(job.job_id, flight)
        self._rates.submitted(flight)
        if kind in READS:
            self._tiers[index].tier.submit_load(job)
        else:
            self._tiers[index].mrc.store_many(keys)
            self._tiers[index].tier.submit_store(job)
        return flight

    def _poll(self) -> None:
        """Apply the results of every tier job that ended since the last call; give up on those past
        their deadline."""
        if self._handoffs is not None:
            self._handoffs.poll()
        if not self._flights:
            return
        for slot in self._tiers:
            for result in slot.tier.get_finished():
                flight = self._flights.pop(result.job_id)
                if flight is None:
                    # not ours (a tier reports each job once; defensive)
                    continue
                self._rates.ended(flight, result)
                if flight.kind is FlightKind.EXPLORATION:
                    # measured: its bytes are dropped
                    self._exploring.discard(flight.tier)
                elif flight.kind is FlightKind.PROMOTION:
                    self._promotions.ended(slot, flight, result)
                elif flight.kind is FlightKind.HANDOFF and self._handoffs is not None:
                    self._handoffs.ended(flight, result)
                else:
                    self._write_down.ended(slot, flight, result)
                    if self._handoffs is not None and flight.tier == self._handoffs.index:
                        self._handoffs.cascaded(flight.keys, result.failed_keys)
        for flight in self._flights.expire(time.monotonic()):
            self._give_up(flight)

    def _give_up(self, flight: Flight) -> None:
        """`flight` is past its deadline: nobody waits for it any more; what it holds stays held
        until its tier reports it (a late read may still write its slot)."""
        slot = self._tiers[flight.tier]
        slot.counters["expired_jobs"] += 1
        self._rates.expired(flight, self._flights.timeout_s)
        logger.warning(
            "kvtier: a %s job of the %s tier took more than %.0f s; given up on (%d chunks)",
            flight.kind.value,
            slot.tier.medium,
            self._flights.timeout_s,
            len(flight.keys),
        )
        if flight.kind is FlightKind.PROMOTION:
            self._promotions.expired(flight)

    def _rows(self, slot_id: int) -> tuple[memoryview, ...]:
        return tuple(memoryview(slab[slot_id]) for slab in self._slabs)

    def _add_curve(self, slot: SecondarySlot, stats: TierStats) -> None:
        """The tier's predicted hit ratios into its stats' gauges; a tier whose server sets its size
        (Redis maxmemory) reports no capacity: 1x is then what it holds now. Chunks per byte of
        capacity ignore the disk tier's padding to 4 KiB: nothing beside MiB-sized chunks, a lot
        beside the tests' 4 KiB ones."""
        chunk_bytes = self.payload_bytes + HEADER_BYTES
        num_chunks = (stats.capacity_bytes or stats.used_bytes) / chunk_bytes
        stats.gauges.update(curve_gauges(slot.mrc, num_chunks))

    def check(self) -> None:
        """The CPU tier's invariants (for tests)."""
        self.primary.check()


def _is_shared(medium: str) -> bool:
    """Whether the tier named `medium` is shared with other engines (a tier built outside the
    registry, as tests do, is not)."""
    try:
        return tier_descriptor(medium).locality == "REMOTE"
    except ConfigError:
        return False
