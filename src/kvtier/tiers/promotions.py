"""Promotions: a secondary tier's chunk read up into a CPU slot for a request that found it
there, and how such a read ends (in time, failed, or given up on).

A secondary HIT reserves a CPU slot (PENDING: other requests see HIT_PENDING, nothing is read
twice) and the tier reads the chunk into it in the background; the chunk becomes READY when
the read is checked. A full CPU tier answers MISS (recompute rather than wait); past
`max_promotion_bytes` in flight a lookup answers RETRY. A promoted chunk is not evicted for
another promotion before the request it was read for has loaded it (`awaited_by`).

`Promotions` works for a `kvtier.tiers.tiered.TieredManager`, as `kvtier.tiers.writedown.WriteDown`
does: it owns the bytes of promotions in flight and the chunks each request awaits; the manager
submits its jobs (`submit`) and hands each one's end back (`ended`, `expired`).

Thread-safety: not thread-safe; the manager calls it from one thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable

from kvtier.base import LookupResult, ReqContext
from kvtier.keys import OffloadKey
from kvtier.tiers.cascade import SecondarySlot
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.flights import Flight, FlightKind
from kvtier.tiers.secondary import TierResult
from kvtier.tiers.writedown import Submit, WriteDown

__all__ = ["Promotions"]

logger = logging.getLogger(__name__)

_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY


class Promotions:
    """Args:
    primary: the CPU tier's bookkeeping.
    slots: the secondary tiers, as the manager sees them, in its order.
    write_down: gets the chunks a promotion evicts (for the `on_evict` tiers).
    rows: a CPU slot's buffers, one per worker rank.
    submit: starts a tier job (the manager's).
    payload_bytes: bytes of one chunk, every rank's shard together.
    max_promotion_bytes: bytes of promotions in flight at most.
    """

    def __init__(
        self,
        primary: CPUTierManager,
        slots: list[SecondarySlot],
        write_down: WriteDown,
        rows: Callable[[int], tuple[memoryview, ...]],
        submit: Submit,
        payload_bytes: int,
        max_promotion_bytes: int,
    ):
        self.primary = primary
        self._tiers = slots
        self._write_down = write_down
        self._rows = rows
        self._submit = submit
        self.payload_bytes = payload_bytes
        self.max_promotion_bytes = max_promotion_bytes
        # bytes of the promotions in flight that are not given up on
        self.num_bytes = 0
        # req_id -> chunks promoted for it, not loaded yet
        self._awaited: dict[str, set[OffloadKey]] = {}

    def start(self, key: OffloadKey, index: int, ctx: ReqContext) -> LookupResult:
        """Read `key` up from the tier `index` (which holds it) for the request `ctx`: HIT_PENDING
        when the read started, RETRY past the byte budget, MISS when the CPU tier has no room."""
        slot = self._tiers[index]
        if self.num_bytes and self.num_bytes + self.payload_bytes > self.max_promotion_bytes:
            slot.counters["promotions_capped"] += 1
            # the promotions in flight end soon and free the budget
            return _RETRY
        others = [k for req_id, keys in self._awaited.items() if req_id != ctx.req_id for k in keys]
        out = self.primary.prepare_promotion([key], ctx, spare=others)
        if out is None or not out.keys_to_store:
            slot.counters["promotions_no_room"] += 1
            # a full CPU tier: recompute rather than wait
            return _MISS
        self._write_down.write_evicted(out)
        row = int(out.store_spec.slot_ids[0])
        buffers = (self._rows(row),)
        # in the budget before the tier has the job (the flight's `num_bytes`, which `ended` or
        # `expired` take back): a tier whose submit raises leaves the budget balanced
        self.num_bytes += sum(buf.nbytes for buf in buffers[0])
        self._submit(FlightKind.PROMOTION, index, (key,), ctx, buffers, ())
        self._awaited.setdefault(ctx.req_id, set()).add(key)
        slot.counters["promotions"] += 1
        return LookupResult.HIT_PENDING

    def ended(self, slot: SecondarySlot, flight: Flight, result: TierResult) -> None:
        """A promotion's read ended: its chunks become READY, or their slots are freed."""
        if flight.is_expired:
            # given up on: its chunk is RETIRED, this frees its slot
            self.primary.complete_store(flight.keys, flight.ctx, success=False)
            return
        self.num_bytes -= flight.num_bytes
        ok = [k for k in flight.keys if k not in result.failed_keys]
        failed = [k for k in flight.keys if k in result.failed_keys]
        self.primary.complete_store(ok, flight.ctx, success=True)
        if failed:
            # frees the slot
            self.primary.complete_store(failed, flight.ctx, success=False)
            slot.counters["promotion_failures"] += len(failed)
            logger.info(
                "kvtier: %d promotion(s) from %s failed: %s",
                len(failed),
                slot.tier.medium,
                result.error,
            )

    def expired(self, flight: Flight) -> None:
        """A promotion is past its deadline: its bytes leave the budget and its chunk reads as a
        miss from now on; the slot is freed when its tier reports it (`ended`)."""
        self.num_bytes -= flight.num_bytes
        self.primary.abandon(flight.keys)
        awaited = self._awaited.get(flight.ctx.req_id)
        if awaited is not None:
            awaited.difference_update(flight.keys)

    def awaited_by(self, req_id: str) -> Collection[OffloadKey]:
        """The chunks promoted for the request `req_id` that it has not loaded yet."""
        return self._awaited.get(req_id, ())

    def loaded(self, req_id: str, keys: Iterable[OffloadKey]) -> None:
        """The request `req_id` loads `keys`: other promotions may evict them again."""
        awaited = self._awaited.get(req_id)
        if awaited is not None:
            awaited.difference_update(keys)
            if not awaited:
                del self._awaited[req_id]

    def forget(self, req_id: str) -> None:
        """The request `req_id` ended: what was promoted for it is spared no longer."""
        self._awaited.pop(req_id, None)

    def clear(self) -> None:
        """A reset: no request awaits anything (the reads in flight still end)."""
        self._awaited.clear()
