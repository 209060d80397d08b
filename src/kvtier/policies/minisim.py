"""Miniature simulations: pick a policy's setting, or a whole policy, by replaying a sample of
its own traffic.

A `SettingSelector` runs one small cache per candidate setting over the keys whose hash
falls in a 1/`sample` slice, each with 1/`sample` of the real capacity (Waldspurger et al.,
"Cache Modeling and Optimization using Miniature Simulations", USENIX ATC 2017: a spatially
sampled cache of capacity C/k behaves like the full one of capacity C). Their hits are
counted with a decay (halved every `period` x `capacity` accesses), and `best` names the setting whose
miniature got the most: the policy then uses it. The miniatures count block hits, not prefix
hits — a proxy that ranks settings, not a hit rate.

Each miniature evicts the lowest score, score = last access + `bonus(setting, level)`, the
rule of the policy that owns the selector (`kvtier.policies.turns`).

A `PolicySelector` runs the same experiment with whole policies (`CachePolicy` instances of
1/`sample` of the capacity) as the miniatures, for a policy that follows the best of several
(`kvtier.policies.adaptive`).

Thread-safety: not thread-safe; the owning policy serializes calls.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Callable, Sequence

from kvtier.errors import InvariantError
from kvtier.keys import OffloadKey
from kvtier.policies.base import CachePolicy

__all__ = ["PolicySelector", "SettingSelector", "is_sampled", "thinned"]

# (setting, level) -> bonus in key time
Bonus = Callable[[float, int], float]
# (name, capacity) -> a fresh policy
MakePolicy = Callable[[str, int], CachePolicy]


def is_sampled(key: OffloadKey, sample: int) -> bool:
    """Whether `key` falls in the 1/`sample` slice of the key space the miniatures see."""
    return zlib.crc32(key) % sample == 0


def thinned(sample: int, capacity: int, max_keys: int | None) -> int:
    """`sample`, or a sparser one if the miniatures of a cache of `capacity` keys would have more
    than `max_keys` slots: SHARDS's fixed-size variant (Waldspurger et al., FAST 2015), the cost
    per key then falling as 1/capacity. What the miniatures rank is their hits per period, and a
    period holds as many sampled keys at any capacity past that (`period` x `max_keys`).

    The sample doubles, so that a thinner slice is a subset of the thicker one (a crc32 that is
    0 mod 2n is 0 mod n): on bench_manager's replay (adaptive, 9,697 slots) the slices 1 in 2, 3,
    4, 5, 6 and 8 hit 11,228, 11,275, 11,225, 10,892, 11,070 and 11,225 keys; a subset of the
    slice a policy was tuned on keeps its answers closest."""
    if max_keys is None:
        return sample
    while capacity > sample * max_keys:
        sample *= 2
    return sample


class _Miniature:
    """A scored cache of `capacity` keys for one setting."""

    __slots__ = ("bonus_of_level", "capacity", "heap", "hits", "scores", "setting")

    def __init__(self, capacity: int, setting: float):
        self.capacity = capacity
        self.setting = setting
        # level -> the bonus rule's answer for this setting (computed once per level)
        self.bonus_of_level: dict[int, float] = {}
        self.scores: dict[OffloadKey, float] = {}
        self.heap: list[tuple[float, OffloadKey]] = []
        self.hits = 0.0

    def access(self, key: OffloadKey, score: float) -> None:
        scores = self.scores
        heap = self.heap
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
        max_keys: a miniature's most slots (None: no bound): past `max_keys` x `sample` the
            sample thins instead, so their cost per key falls as the capacity grows (`thinned`).
    """

    def __init__(
        self,
        capacity: int,
        settings: Sequence[float],
        bonus: Bonus,
        sample: int = 8,
        min_keys: int = 64,
        period: int = 4,
        max_keys: int | None = None,
    ):
        self.sample = thinned(sample, capacity, max_keys)
        self.bonus = bonus
        self.best = settings[0]
        size = capacity // self.sample
        self._minis = [_Miniature(size, s) for s in settings] if size >= min_keys else []
        self._is_running = bool(self._minis)
        self._period = period * capacity
        self._accesses = 0

    def is_watched(self, key: OffloadKey) -> bool:
        """Whether `access` shows `key` to the miniatures (its caller may skip the others)."""
        # `is_sampled`, inlined: asked once per key a policy sees
        return self._is_running and zlib.crc32(key) % self.sample == 0

    def access(self, key: OffloadKey, level: int, now: float) -> bool:
        """The policy saw `key` used (a hit) or stored (a miss) at key time `now`, at `level`.

        Returns:
            True when `best` changed.
        """
        if not self.is_watched(key):
            return False
        for mini in self._minis:
            bonus = mini.bonus_of_level.get(level)
            if bonus is None:
                bonus = self.bonus(mini.setting, level)
                mini.bonus_of_level[level] = bonus
            mini.access(key, now + bonus)
        self._accesses += self.sample
        if self._accesses < self._period:
            return False
        self._accesses = 0
        previous = self.best
        self.best = max(self._minis, key=lambda m: m.hits).setting
        for mini in self._minis:
            mini.hits *= 0.5
        return previous != self.best

    def clear(self) -> None:
        for mini in self._minis:
            mini.scores.clear()
            mini.heap.clear()
            mini.hits = 0.0


class PolicySelector:
    """Miniatures of whole policies, one per candidate (see the module docstring).

    Unlike `SettingSelector`, every capacity runs miniatures: the sample shrinks (down to every
    key) until each miniature has `min_keys` slots, or the whole capacity when it is smaller.

    Args:
        capacity: the real cache's capacity (keys).
        names: the candidate policies; the first is the answer until the miniatures know better.
        make: builds a candidate by name at a capacity.
        max_sample: at most one key in `max_sample` is simulated.
        period: `best` is chosen again every `period` x capacity accesses.
        memory: hits are counted with a decay: x (1 - 1/`memory`) at every choice.
        margin: another candidate replaces `best` when the keys only it held outnumber those only
            `best` held by `margin` x the square root of their sum (McNemar's test: the keys both
            held or both missed, most of them, say nothing about which is better).
        max_keys: a miniature's most slots (None: no bound): past `max_keys` x `max_sample` the
            sample thins instead (`thinned`).
    """

    def __init__(
        self,
        capacity: int,
        names: Sequence[str],
        make: MakePolicy,
        max_sample: int = 8,
        min_keys: int = 64,
        period: int = 4,
        memory: float = 2.0,
        margin: float = 0.0,
        max_keys: int | None = None,
    ):
        self.sample = thinned(max(1, min(max_sample, capacity // min_keys)), capacity, max_keys)
        self.best = names[0]
        self.minis = {name: make(name, max(1, capacity // self.sample)) for name in names}
        self.hits = dict.fromkeys(names, 0.0)
        # keys a held and b did not
        self.wins = {(a, b): 0.0 for a in names for b in names if a != b}
        self._period = period * capacity
        self._keep = 1.0 - 1.0 / memory
        self._margin = margin
        self._accesses = 0

    def access(self, keys: Sequence[OffloadKey]) -> bool:
        """The policy saw `keys` used (`touch`: hits) or stored (`insert`: misses), head first.

        Each miniature counts the sampled keys it holds as hits and stores the others.

        Returns:
            True when `best` changed.
        """
        crc32 = zlib.crc32
        sample = self.sample
        # `is_sampled`, inlined: asked for every key
        sampled = list(dict.fromkeys([k for k in keys if crc32(k) % sample == 0]))
        if not sampled:
            return False
        held = {name: _replay(mini, sampled) for name, mini in self.minis.items()}
        for name, keys_held in held.items():
            self.hits[name] += len(keys_held)
        for a, b in self.wins:
            self.wins[a, b] += len(held[a] - held[b])
        self._accesses += len(sampled) * self.sample
        if self._accesses < self._period:
            return False
        self._accesses = 0
        best = self.best
        self._choose()
        for counts in (self.hits, self.wins):
            for name in counts:
                counts[name] *= self._keep
        return best != self.best

    def _choose(self) -> None:
        # a tie keeps best
        top = max(self.hits, key=lambda name: (self.hits[name], name == self.best))
        if top == self.best:
            return
        won, lost = self.wins[top, self.best], self.wins[self.best, top]
        if won - lost > self._margin * (won + lost) ** 0.5:
            self.best = top

    def order_chain(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` are one prefix chain, head first: each miniature ranks the sampled ones it holds."""
        crc32 = zlib.crc32
        sample = self.sample
        # `is_sampled`, inlined: asked for every key
        sampled = [k for k in keys if crc32(k) % sample == 0]
        for mini in self.minis.values():
            mini.order_chain([k for k in sampled if k in mini])

    def clear(self) -> None:
        for mini in self.minis.values():
            mini.clear()
        self.hits = dict.fromkeys(self.hits, 0.0)
        self.wins = dict.fromkeys(self.wins, 0.0)
        self._accesses = 0


def _replay(mini: CachePolicy, keys: list[OffloadKey]) -> set[OffloadKey]:
    """One access of `keys` (distinct, head first) in a miniature, as its tier would do it:
    touch the held ones, store as many of the rest as there is room for (heads first).

    Returns:
        The hits: the keys it held.
    """
    held = [k for k in keys if k in mini]
    hits = set(held)
    mini.touch(held)
    # the held ones stay
    missing = [k for k in keys if k not in mini][: mini.capacity - len(held)]
    if not missing:
        return hits
    mini.prepare_insert(missing)
    num_needed = len(mini) + len(missing) - mini.capacity
    if num_needed > 0 and mini.evict(num_needed, set(held)) is None:
        raise InvariantError(
            f"miniature {mini.name!r} could not evict {num_needed} of {len(mini)} keys"
        )
    mini.insert(missing)
    return hits
