"""Promotions: a secondary tier's chunk read up into a CPU slot for a request that found it
there, and how such a read ends (in time, failed, or given up on).

A secondary HIT reserves a CPU slot (PENDING: other requests see HIT_PENDING, nothing is read
twice) and the tier reads the chunk into it in the background; the chunk becomes READY when
the read is checked. A full CPU tier answers MISS (recompute rather than wait); past
`max_promotion_bytes` in flight a lookup answers RETRY. A promoted chunk is not evicted for
another promotion before the request it was read for has loaded it (`_awaited`).

`Promotions` is a part of `kvtier.tiers.tiered.TieredManager` (a mixin): it shares the
manager's tiers, flights and CPU tier. Thread-safety: the manager's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtier.base import LookupResult, ReqContext
from kvtier.keys import OffloadKey
from kvtier.tiers.cascade import SecondarySlot
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.flights import Flight, FlightKind, Flights
from kvtier.tiers.rates import TierRates
from kvtier.tiers.secondary import TierResult
from kvtier.tiers.writedown import WriteDown

__all__ = ["Promotions"]

logger = logging.getLogger(
    "kvtier.tiers.tiered"
)  # the manager's logger, as before this part moved here

_MISS, _RETRY = LookupResult.MISS, LookupResult.RETRY


class Promotions:
    """The promotion side of `TieredManager`; see the module docstring."""

    # the manager's state this part reads and changes (set by TieredManager.__init__)
    primary: CPUTierManager
    payload_bytes: int
    max_promotion_bytes: int
    _tiers: list[SecondarySlot]
    _write_down: WriteDown
    _flights: Flights
    _rates: TierRates
    _awaited: dict[str, set[OffloadKey]]
    _promoting_bytes: int
    _submit: Callable[..., None]  # (kind, tier index, keys, ctx, buffers, staging rows)
    _rows: Callable[[int], tuple[memoryview, ...]]  # a CPU slot's buffers, one per worker rank

    def _promote(self, key: OffloadKey, index: int, ctx: ReqContext) -> LookupResult:
        slot = self._tiers[index]
        if (
            self._promoting_bytes
            and self._promoting_bytes + self.payload_bytes > self.max_promotion_bytes
        ):
            slot.counters["promotions_capped"] += 1
            return _RETRY  # the promotions in flight end soon and free the budget
        others = [k for req_id, keys in self._awaited.items() if req_id != ctx.req_id for k in keys]
        out = self.primary.prepare_promotion([key], ctx, spare=others)
        if out is None or not out.keys_to_store:
            slot.counters["promotions_no_room"] += 1
            return _MISS  # a full CPU tier: recompute rather than wait
        self._write_down.write_evicted(out)
        row = int(out.store_spec.slot_ids[0])
        self._submit(FlightKind.PROMOTION, index, (key,), ctx, (self._rows(row),), ())
        self._awaited.setdefault(ctx.req_id, set()).add(key)
        slot.counters["promotions"] += 1
        return LookupResult.HIT_PENDING

    def _end_promotion(self, slot: SecondarySlot, flight: Flight, result: TierResult) -> None:
        if flight.is_expired:  # given up on: its chunk is RETIRED, this frees its slot
            self.primary.complete_store(flight.keys, flight.ctx, success=False)
            return
        self._promoting_bytes -= flight.num_bytes
        ok = [k for k in flight.keys if k not in result.failed_keys]
        failed = [k for k in flight.keys if k in result.failed_keys]
        self.primary.complete_store(ok, flight.ctx, success=True)
        if failed:
            self.primary.complete_store(failed, flight.ctx, success=False)  # frees the slot
            slot.counters["promotion_failures"] += len(failed)
            logger.info(
                "kvtier: %d promotion(s) from %s failed: %s",
                len(failed),
                slot.tier.medium,
                result.error,
            )

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
            self._promoting_bytes -= flight.num_bytes
            self.primary.abandon(flight.keys)  # a miss from now on; the slot is freed at the report
            awaited = self._awaited.get(flight.ctx.req_id)
            if awaited is not None:
                awaited.difference_update(flight.keys)
