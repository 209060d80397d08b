"""Miniature simulations: pick a policy's setting by replaying a sample of its own traffic.

A `SettingSelector` runs one small cache per candidate setting over the keys whose hash
falls in a 1/`sample` slice, each with 1/`sample` of the real capacity (Waldspurger et al.,
"Cache Modeling and Optimization using Miniature Simulations", USENIX ATC 2017: a spatially
sampled cache of capacity C/k behaves like the full one of capacity C). Their hits are
counted with a decay (halved every `period` x `capacity` accesses), and `best` names the setting whose
miniature got the most: the policy then uses it. The miniatures count block hits, not prefix
hits — a proxy that ranks settings, not a hit rate.

Each miniature evicts the lowest score, score = last access + `bonus(setting, level)`, the
rule of the policy that owns the selector (`kvtier.policies.turns`).

Thread-safety: not thread-safe; the owning policy serializes calls.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Callable, Sequence

from kvtier.keys import OffloadKey

__all__ = ["SettingSelector"]

Bonus = Callable[[float, int], float]  # (setting, level) -> bonus in key time


class _Miniature:
    """A scored cache of `capacity` keys for one setting."""

    __slots__ = ("capacity", "heap", "hits", "scores", "setting")

    def __init__(self, capacity: int, setting: float):
        self.capacity, self.setting = capacity, setting
        self.scores: dict[OffloadKey, float] = {}
        self.heap: list[tuple[float, OffloadKey]] = []
        self.hits = 0.0

    def access(self, key: OffloadKey, score: float) -> None:
        scores, heap = self.scores, self.heap
        if key in scores:
            self.hits += 1.0
        scores[key] = score
        heapq.heappush(heap, (score, key))
        while len(scores) > self.capacity:
            old, victim = heapq.heappop(heap)
            if scores.get(victim) == old:
                del scores[victim]
        if len(heap) > 4 * self.capacity + 64:
            self.heap = [(s, k) for k, s in scores.items()]
            heapq.heapify(self.heap)


class SettingSelector:
    """Miniatures of a policy, one per candidate setting (see the module docstring).

    Args:
        capacity: the real cache's capacity (keys).
        settings: the candidate settings; the first is the answer until the miniatures know better.
        bonus: the policy's bonus rule.
        sample: one key in `sample` is simulated. Capacities under `min_keys` x `sample`
            run no miniature (too few keys to rank anything): `best` stays the first setting.
        period: `best` is chosen again, and the hits halved, every `period` x capacity accesses.
    """

    def __init__(self, capacity: int, settings: Sequence[float], bonus: Bonus, sample: int = 8,
                 min_keys: int = 64, period: int = 4):
        self.sample = sample
        self.bonus = bonus
        self.best = settings[0]
        size = capacity // sample
        self._minis = [_Miniature(size, s) for s in settings] if size >= min_keys else []
        self._period = period * capacity
        self._accesses = 0

    def access(self, key: OffloadKey, level: int, now: float) -> bool:
        """The policy saw `key` used (a hit) or stored (a miss) at key time `now`, at `level`.

        Returns:
            True when `best` changed.
        """
        if not self._minis or zlib.crc32(key) % self.sample:
            return False
        for mini in self._minis:
            mini.access(key, now + self.bonus(mini.setting, level))
        self._accesses += self.sample
        if self._accesses < self._period:
            return False
        self._accesses = 0
        best, self.best = self.best, max(self._minis, key=lambda m: m.hits).setting
        for mini in self._minis:
            mini.hits *= 0.5
        return best != self.best

    def clear(self) -> None:
        for mini in self._minis:
            mini.scores.clear()
            mini.heap.clear()
            mini.hits = 0.0
