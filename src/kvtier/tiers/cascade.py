"""How chunks flow down from the CPU tier to a secondary tier: the rules, backpressure, and
the staging rows that keep an evicted chunk's bytes while an `on_evict` tier writes them.

- **Rules** (`TierRules`): `write_through` cascades every chunk the moment it becomes READY in
  the CPU tier; `on_evict` only when the CPU tier evicts it (the tier then holds what RAM
  lost). Admission: only chunks offered by at least `min_offers` requests go down.
- **Backpressure**: while a tier's queued store bytes or its recent store latency is over its
  limit, cascades to it are dropped and counted, instead of pinning the slab full behind a
  slow disk or a remote server. The latency estimate is forgotten once its queue is empty.
- **Staging**: an evicted slot is handed to a new chunk in the same step, so the bytes an
  `on_evict` tier must write are copied out first into a bounded pool of rows (memcpy on the
  scheduler thread, a few hundred microseconds per MiB-sized chunk); when the pool is full the
  write is dropped and counted.

Thread-safety: not thread-safe; the `TieredManager` calls it from one thread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError
from kvtier.mrc import MissRatioCurve
from kvtier.tiers.admission import ReuseGate
from kvtier.tiers.secondary import SecondaryTier

__all__ = ["WRITE_MODES", "SecondarySlot", "StagingRows", "TierRules"]

WRITE_MODES = ("write_through", "on_evict")
# weight of the newest store in the latency estimate
_EWMA = 0.2


@dataclass(frozen=True, slots=True)
class TierRules:
    """How the tiered manager feeds one secondary tier.

    Args:
        write_mode: "write_through" or "on_evict" (see the module docstring).
        min_offers: admission: cascade only chunks at least this many requests offered.
        max_queue_bytes: backpressure: drop cascades that would queue more store bytes.
        max_store_seconds: backpressure: drop cascades while recent store jobs took longer.
    """

    write_mode: str = "write_through"
    min_offers: int = 1
    max_queue_bytes: int = 256 * 2**20
    max_store_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.write_mode not in WRITE_MODES:
            raise ConfigError(f"write_mode: expected one of {WRITE_MODES}, got {self.write_mode!r}")
        if self.min_offers < 1:
            raise ConfigError(
                f"min_offers must be >= 1 (1 admits every chunk), got {self.min_offers}"
            )
        if self.max_queue_bytes <= 0 or not self.max_store_seconds > 0:
            raise ConfigError("max_queue_bytes and max_store_seconds must be positive")


class SecondarySlot:
    """One secondary tier as the manager sees it: the tier, its rules, its admission gate,
    its backpressure state, the manager's counters for it and its miss-ratio curve."""

    __slots__ = ("counters", "gate", "mrc", "rules", "store_seconds", "tier")

    def __init__(self, tier: SecondaryTier, rules: TierRules, max_tracked: int):
        self.tier = tier
        self.rules = rules
        self.gate = ReuseGate(rules.min_offers, max_tracked) if rules.min_offers > 1 else None
        # moving average of store jobs' latency, submit to result
        self.store_seconds = 0.0
        self.counters: Counter[str] = Counter()
        # the tier's hit ratio at other sizes, from its lookups and writes
        self.mrc = MissRatioCurve()

    @property
    def is_write_through(self) -> bool:
        return self.rules.write_mode == "write_through"

    def admits(self, key: bytes) -> bool:
        return self.gate is None or self.gate.has_admitted(key)

    def is_backed_up(self, num_bytes: int) -> bool:
        """True when a store of `num_bytes` more must be dropped now. A tier with nothing queued
        forgets its latency estimate here."""
        queued = self.tier.queued_store_bytes
        if queued == 0:
            # caught up: a slow spell is over
            self.store_seconds = 0.0
        return (
            queued + num_bytes > self.rules.max_queue_bytes
            or self.store_seconds > self.rules.max_store_seconds
        )

    def record_store(self, seconds: float) -> None:
        self.store_seconds += _EWMA * (seconds - self.store_seconds)


class StagingRows:
    """A bounded pool of rows (one buffer per worker rank each) for evicted chunks' bytes.

    A row is shared by every `on_evict` tier that writes the chunk: `take` hands it out with
    one hold per tier, `release` drops one hold, and the row is free again at zero.
    """

    def __init__(self, num_rows: int, row_bytes: Sequence[int]):
        if num_rows < 1:
            raise ConfigError(f"the staging pool needs at least one row, got {num_rows}")
        # np.empty: pages are committed on first use only, so an idle pool costs no RAM
        self._rows = [np.empty((num_rows, n), dtype=np.uint8) for n in row_bytes]
        self._free = list(range(num_rows - 1, -1, -1))
        self._holds = [0] * num_rows

    def take(self, sources: Sequence[np.ndarray], holds: int) -> int | None:
        """Copy one chunk (one source row per rank) into a free row held `holds` times; None if full."""
        if not self._free:
            return None
        row = self._free.pop()
        for dst, src in zip(self._rows, sources, strict=True):
            np.copyto(dst[row], src)
        self._holds[row] = holds
        return row

    def buffers(self, row: int) -> tuple[memoryview, ...]:
        return tuple(memoryview(rows[row]) for rows in self._rows)

    def release(self, row: int) -> None:
        self._holds[row] -= 1
        if self._holds[row] == 0:
            self._free.append(row)
