"""`WriteDown`: which chunks a `TieredManager` writes down to its secondary tiers, and when.

- A chunk that becomes READY in the CPU tier is written to every write-through secondary that
  admits it, its slot pinned for reading until the write ends (a **cascade**).
- `on_evict` tiers get a chunk when the CPU tier evicts it: its bytes are copied to a staging
  row first, since its slot is handed to a new chunk in the same step.
- A request storing or reusing a chunk is one offer of it to each gated tier; a chunk already
  READY cascades once its offers reach the tier's threshold.
- A tier that is backed up gets nothing (dropped, counted); so does an `on_evict` write when
  the staging pool is full.

The rules, backpressure and staging rows themselves are `kvtier.tiers.cascade`'s; the jobs are
submitted through the manager (`submit`), which hands each one's result back (`ended`).

Thread-safety: not thread-safe; the manager calls it from one thread.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.base import PrepareStoreOutput, ReqContext
from kvtier.keys import OffloadKey
from kvtier.tiers.cascade import SecondarySlot, StagingRows
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.flights import Flight, FlightKind
from kvtier.tiers.secondary import TierResult

__all__ = ["CASCADE_CTX", "Submit", "WriteDown"]

# holds the pins of slots being written down
CASCADE_CTX = ReqContext("\x00kvtier:cascade")

# (kind, tier index, keys, ctx, one buffer per rank for each key, staging rows the job holds)
# -> the job's flight
Submit = Callable[
    [
        FlightKind,
        int,
        tuple[OffloadKey, ...],
        ReqContext,
        tuple[tuple[memoryview, ...], ...],
        tuple[int, ...],
    ],
    Flight,
]


class WriteDown:
    """Args:
    primary: the CPU tier's bookkeeping.
    slots: the secondary tiers, as the manager sees them, in its order.
    slabs: the host slab of every worker rank (rows = the CPU tier's slots).
    staging_bytes: room for evicted chunks waiting for an `on_evict` tier.
    submit: starts a tier job (the manager's).
    """

    def __init__(
        self,
        primary: CPUTierManager,
        slots: Sequence[SecondarySlot],
        slabs: Sequence[np.ndarray],
        staging_bytes: int,
        submit: Submit,
    ):
        self.primary = primary
        self._tiers = slots
        self._slabs = list(slabs)
        self._submit = submit
        self.payload_bytes = sum(s.shape[1] for s in slabs)
        num_staging = max(1, staging_bytes // self.payload_bytes)
        has_on_evict = any(not t.is_write_through for t in slots)
        self._staging = (
            StagingRows(num_staging, [s.shape[1] for s in slabs]) if has_on_evict else None
        )
        # per tier: the keys whose write to it is in flight (a hand-off rides on them instead of
        # writing them twice: `kvtier.tiers.handoff`)
        self._writing: list[Counter[OffloadKey]] = [Counter() for _ in slots]

    def is_writing(self, index: int, key: OffloadKey) -> bool:
        """Whether a write of `key` to the tier `index` is in flight."""
        return self._writing[index][key] > 0

    def count_offers(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """A request storing or reusing `keys`: one offer of each to every gated tier."""
        for index, slot in enumerate(self._tiers):
            if slot.gate is None:
                continue
            # as the CPU tier's gate counts it
            offered_by = ctx.user_id or ctx.req_id
            ready = []
            for key in keys:
                if slot.gate.has_admitted(key):
                    continue
                is_admitted = slot.gate.admit(key, offered_by)
                if is_admitted and self.primary.is_readable(key):
                    ready.append(key)
            if ready and slot.is_write_through:
                self._cascade_to(index, ready)

    def cascade(self, ready: list[OffloadKey]) -> None:
        """`ready` just became READY in the CPU tier: write them to the write-through tiers."""
        for index, slot in enumerate(self._tiers):
            if not slot.is_write_through:
                continue
            keys = [k for k in ready if slot.admits(k)]
            slot.counters["admission_skips"] += len(ready) - len(keys)
            if keys:
                self._cascade_to(index, keys)

    def write_evicted(self, out: PrepareStoreOutput) -> None:
        """Copy victims bound for `on_evict` tiers out of their slots before new chunks land there."""
        targets = [i for i, slot in enumerate(self._tiers) if not slot.is_write_through]
        if not targets or not out.evicted_keys or self._staging is None:
            return
        for key, row in zip(out.evicted_keys, out.evicted_slot_ids, strict=True):
            wanted = []
            for i in targets:
                slot = self._tiers[i]
                if slot.admits(key) and not slot.is_backed_up(self.payload_bytes):
                    wanted.append(i)
                else:
                    slot.counters["backpressure_drops"] += 1
            if not wanted:
                continue
            staged = self._staging.take([s[row] for s in self._slabs], len(wanted))
            if staged is None:
                for i in wanted:
                    self._tiers[i].counters["staging_drops"] += 1
                continue
            for i in wanted:
                self._submit(
                    FlightKind.EVICTED,
                    i,
                    (key,),
                    CASCADE_CTX,
                    (self._staging.buffers(staged),),
                    (staged,),
                )
                self._writing[i][key] += 1

    def ended(self, slot: SecondarySlot, flight: Flight, result: TierResult) -> None:
        """A write down ended (or failed): release what it held, count it."""
        slot.record_store(time.monotonic() - flight.submitted_at)
        if flight.kind is FlightKind.CASCADE:
            # unpin (a retired slot is freed)
            self.primary.complete_load(flight.keys, CASCADE_CTX)
        elif self._staging is not None:
            for row in flight.staging_rows:
                self._staging.release(row)
        slot.counters["cascade_failures"] += len(result.failed_keys)
        slot.counters["cascaded_chunks"] += len(flight.keys) - len(result.failed_keys)
        writing = self._writing[flight.tier]
        for key in flight.keys:
            writing[key] -= 1
            if writing[key] <= 0:
                del writing[key]

    def _cascade_to(self, index: int, keys: list[OffloadKey]) -> None:
        slot = self._tiers[index]
        if slot.is_backed_up(len(keys) * self.payload_bytes):
            slot.counters["backpressure_drops"] += len(keys)
            return
        self.write_pinned(FlightKind.CASCADE, index, keys, CASCADE_CTX)
        self._writing[index].update(keys)

    def write_pinned(
        self, kind: FlightKind, index: int, keys: list[OffloadKey], ctx: ReqContext
    ) -> None:
        """Write READY `keys` to the tier `index` from their slots, pinned under `ctx` while the
        tier reads them (its `kind` of flight unpins them when it ends); no rule or backpressure
        is checked here."""
        spec = self.primary.prepare_load(keys, ctx)
        buffers = tuple(
            tuple(memoryview(slab[int(s)]) for slab in self._slabs) for s in spec.slot_ids
        )
        self._submit(kind, index, tuple(keys), ctx, buffers, ())
