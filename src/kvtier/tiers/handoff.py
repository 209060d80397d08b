"""`HandOffs`: a request's prefix written to the tier another engine reads it from.

In disaggregated serving (`kvtier.scheduler.handoff`) a prefill engine promises a decode engine
the chunks of a prompt; the decode engine waits for them in one shared tier, the hand-off tier.
The usual write-down (`kvtier.tiers.writedown`) may leave a chunk out of that tier — its
admission rule, its backpressure, an `on_evict` tier that gets chunks only when RAM evicts them,
a chunk that was in RAM before this request came — so a hand-off writes its chunks itself:

- a chunk READY in the CPU tier is written now, its slot pinned until the write ends;
- a chunk being stored into the CPU tier is written when it becomes READY (`ready`); one that
  never does (its store failed, or a reset dropped it) is given up on at its deadline
  (`poll`) and counted as a failure;
- a chunk the CPU tier does not hold counts as on its way only if the hand-off tier says it
  holds it (its `lookup` is HIT): the promise ends before the first chunk that is neither;
- nothing is on its way while the hand-off tier is unreachable (`SecondaryTier.is_reachable`).

A write the tier refuses or fails is counted (`handoff_failures` of that tier); the decode
engine, promised it, waits for it until its own deadline and then recomputes it.

Thread-safety: not thread-safe; the manager calls it from one thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.base import NOT_KNOWN_YET, LookupResult, ReqContext
from kvtier.keys import OffloadKey
from kvtier.tiers.cascade import SecondarySlot
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.flights import Flight, FlightKind
from kvtier.tiers.secondary import TierResult
from kvtier.tiers.writedown import WriteDown

__all__ = ["HANDOFF_CTX", "HandOffs"]

# holds the pins of slots being handed off
HANDOFF_CTX = ReqContext("\x00kvtier:handoff")


class HandOffs:
    """Args:
    primary: the CPU tier's bookkeeping.
    slot: the hand-off tier, as the manager sees it.
    index: its index among the manager's secondary tiers.
    write_down: the manager's write-down: writes a hand-off's chunks from their pinned slots, and
        says which it is writing to the tier already (those are not written twice).
    wait_s: how long a chunk being stored may take to become READY before it is given up on.
    clock: monotonic seconds.
    """

    def __init__(
        self,
        primary: CPUTierManager,
        slot: SecondarySlot,
        index: int,
        write_down: WriteDown,
        wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.primary = primary
        self.slot = slot
        self.index = index
        self._write_down = write_down
        self._wait_s = wait_s
        self._clock = clock
        # chunks being stored into RAM, to write once READY -> when to give up on them
        self._awaited: OrderedDict[OffloadKey, float] = OrderedDict()
        # chunks whose write-down to the tier was in flight: delivered by it (`cascaded`), or
        # written here if it fails -> when to give up on them
        self._riding: dict[OffloadKey, float] = {}

    @property
    def medium(self) -> str:
        return self.slot.tier.medium

    def start(self, keys: Sequence[OffloadKey], coming: bool = False) -> int:
        """Hand `keys` (a prefix, in order) off; returns how many leading keys are on their way.
        `coming`: keys not in RAM will be stored there soon (awaited like those being stored)."""
        self.poll()
        if not self.slot.tier.is_reachable:
            # its writes would be refused at once (an open breaker): promising them would cost a
            # decode engine that still reaches the tier its whole wait
            return 0
        now_ready: list[OffloadKey] = []
        num_promised = 0
        for key in keys:
            place = self.primary.place(key)
            if place == self.primary.medium:
                now_ready.append(key)
            elif place is NOT_KNOWN_YET or coming:
                self._awaited[key] = self._clock() + self._wait_s
                self._awaited.move_to_end(key)
            elif self.slot.tier.lookup(key) is not LookupResult.HIT:
                break
            num_promised += 1
        self._write(now_ready)
        return num_promised

    def ready(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` just became READY in the CPU tier: write those a hand-off awaits."""
        if not self._awaited:
            return
        wanted = [key for key in keys if self._awaited.pop(key, None) is not None]
        self._write(wanted)

    def cascaded(self, keys: Sequence[OffloadKey], failed: frozenset[OffloadKey]) -> None:
        """A write-down of `keys` to the hand-off tier ended: the chunks a hand-off rode on are
        delivered, or, where it failed, written now (if still readable)."""
        if not self._riding:
            return
        again = []
        for key in keys:
            if self._riding.pop(key, None) is None:
                continue
            if key not in failed:
                self.slot.counters["handoff_chunks"] += 1
            elif self.primary.is_readable(key):
                again.append(key)
            else:
                self.slot.counters["handoff_failures"] += 1
        self._write(again)

    def poll(self) -> None:
        """Write the awaited chunks that became READY another way (read back from a tier behind
        RAM); give up on those past their deadline (their store failed or was dropped)."""
        now = self._clock()
        for key, deadline in list(self._riding.items()):
            if deadline <= now:
                del self._riding[key]
                self.slot.counters["handoff_failures"] += 1
        if not self._awaited:
            return
        now_ready = []
        for key, deadline in list(self._awaited.items()):
            if self.primary.is_readable(key):
                now_ready.append(key)
                del self._awaited[key]
            elif deadline <= now:
                del self._awaited[key]
                self.slot.counters["handoff_failures"] += 1
        self._write(now_ready)

    def ended(self, flight: Flight, result: TierResult) -> None:
        """A hand-off write ended (or failed): unpin its slots, count it."""
        self.slot.record_store(self._clock() - flight.submitted_at)
        self.primary.complete_load(flight.keys, HANDOFF_CTX)
        self.slot.counters["handoff_failures"] += len(result.failed_keys)
        self.slot.counters["handoff_chunks"] += len(flight.keys) - len(result.failed_keys)

    def clear(self) -> None:
        """A reset: nothing awaited is written any more."""
        self._awaited.clear()
        self._riding.clear()

    def _write(self, keys: list[OffloadKey]) -> None:
        """Write `keys` (READY) to the tier, but those its write-down is writing already: a hand-off
        rides on that write (one value written once, not twice: a shared store moved each chunk's
        bytes twice, the second write refused as a duplicate)."""
        riding = {key for key in keys if self._write_down.is_writing(self.index, key)}
        for key in riding:
            self._riding[key] = self._clock() + self._wait_s
        keys = [key for key in keys if key not in riding]
        if not keys:
            return
        # past the tier's admission rule and backpressure on purpose
        self._write_down.write_pinned(FlightKind.HANDOFF, self.index, keys, HANDOFF_CTX)
