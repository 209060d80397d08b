"""Each tier's miss-ratio curve (`kvtier.mrc`), fed with what the tier is asked for and written.

What a tier is asked for: every chunk of a request's query when the engine admits it
(`count_query`), once, beside the chunks written into the tier (stores, cascades). Not the
lookups as they happen: the cost model's `locate` and the scan stop at the first miss, so the
chunks a larger tier might turn into hits were never counted (a simulated conversation replay:
the CPU tier's lookups hit 100 %); and an engine asks a waiting request again every step, by
when its own prefix cache may hold what the request asked kvtier for before (a synthetic replay:
predicted 0.25, got 0). The CPU tier counts every chunk of the query; a secondary tier the chunks
RAM did not hold, or promoted from a tier behind it for this request.

`TierCurves` is a part of `kvtier.tiers.tiered.TieredManager` (a mixin): it shares the manager's
tiers and CPU tier. Thread-safety: the manager's.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.base import ReqContext
from kvtier.keys import OffloadKey
from kvtier.mrc import MissRatioCurve, curve_gauges
from kvtier.tiers.cascade import SecondarySlot
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.secondary import HEADER_BYTES, TierStats

__all__ = ["TierCurves"]


class TierCurves:
    """The curves part of `TieredManager`; see the module docstring."""

    primary: CPUTierManager
    payload_bytes: int
    _tiers: list[SecondarySlot]
    _awaited: dict[str, set[OffloadKey]]

    @property
    def mrc(self) -> MissRatioCurve:
        """The CPU tier's curve."""
        return self.primary.mrc

    def count_query(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """One use of each key in the CPU tier's curve, and in every secondary tier's for the keys
        RAM does not hold or that were promoted for this request (not loaded yet: the scheduler
        counts before it loads)."""
        cpu = self.primary
        promoted = self._awaited.get(ctx.req_id, ())
        for key in keys:
            cpu.mrc.lookup(key)
            if key in promoted or cpu.place(key) is None:
                for slot in self._tiers:
                    slot.mrc.lookup(key)

    def _add_curve(self, slot: SecondarySlot, stats: TierStats) -> None:
        """The tier's predicted hit ratios into its stats' gauges; a tier whose server sets its size
        (Redis maxmemory) reports no capacity: 1x is then what it holds now. Chunks per byte of
        capacity ignore the disk tier's padding to 4 KiB: nothing beside MiB-sized chunks, a lot
        beside the tests' 4 KiB ones."""
        chunk_bytes = self.payload_bytes + HEADER_BYTES
        stats.gauges.update(
            curve_gauges(slot.mrc, (stats.capacity_bytes or stats.used_bytes) / chunk_bytes)
        )
