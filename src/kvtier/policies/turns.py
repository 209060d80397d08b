"""Conversation-depth eviction: the more turns a prefix has lived through, the longer it stays.

In chat and agent traffic a prompt's prefix is reused when its conversation sends another
turn, and a conversation that already came back is likelier to come back again (Mooncake's
conversation trace: 25 % of first turns get a next turn, 39 % of second turns, 56 % of
fourth turns, 78 % of seventh and later). LRU and ARC treat a first turn and a tenth turn
alike. This policy gives each chunk a level — the depth of the deepest conversation that
used it — and scores it last use + capacity x `bonus` x (level - 1) (level capped at
`max_turns`), in key time (see `kvtier.policies.scored`); the lowest score is evicted
first, tails before heads.

How a request's depth is known, with nothing but the keys the tier sees: each chunk keeps
the depth of the request that wrote it. A request's chain (`order_chain`: the keys it reused
and stored, head first) is one deeper than the last chunk of it written before — found among
the chunks the tier holds or, for chunks it evicted and the request stores again, among the
last 2 x capacity evictions (their depth is remembered, as ARC remembers its ghosts). A
shared system prompt is used by every request and so is kept, but it keeps the depth it was
written with, so it does not deepen the conversations that merely start with it.

How much a level is worth depends on the traffic and the capacity (with room for most
reuse, plain LRU is best), so `bonus` is chosen online among `bonuses` by miniature
simulations of the policy over a sample of the keys (`kvtier.policies.minisim`).

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.keys import OffloadKey
from kvtier.policies.minisim import SettingSelector
from kvtier.policies.scored import ScoredPolicy

__all__ = ["TurnsPolicy"]

# a head's last use is at least this much after its tail's
_CHAIN_STEP = 1e-6


class TurnsPolicy(ScoredPolicy):
    """Score = last use + capacity x bonus x (level - 1); see the module docstring."""

    name = "turns"
    # candidates; the first until measured
    bonuses: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
    max_turns = 8
    # evicted keys whose depth is remembered, per slot
    ghosts_per_slot = 8
    # evicted keys whose depth is remembered, at most
    max_ghosts = 1 << 20
    # the miniatures' key sample (1 in n)
    sample = 4
    # how often the miniatures choose (x capacity)
    period = 1
    # a miniature's most slots: past 4 x this capacity the sample thins (`minisim.thinned`): at
    # 32,768 slots 1 key in 16 instead of 4 (bench_sched_side: a lookup's touch paid 6
    # miniature accesses for every 4th key of its whole prefix)
    max_mini_keys = 2048

    def __init__(self, capacity: int):
        super().__init__(capacity)
        # depth of the request that wrote the key
        self.depth: dict[OffloadKey, int] = {}
        # depth of the deepest request that used it
        self.level: dict[OffloadKey, int] = {}
        self.last_use: dict[OffloadKey, float] = {}
        # inserted, not yet ranked: key -> depth as a ghost
        self._fresh: dict[OffloadKey, int | None] = {}
        # evicted key -> its depth
        self._ghosts: OrderedDict[OffloadKey, int] = OrderedDict()
        self._max_ghosts = min(self.ghosts_per_slot * capacity, self.max_ghosts)
        self.selector = SettingSelector(
            capacity,
            self.bonuses,
            self._bonus_for,
            sample=self.sample,
            period=self.period,
            max_keys=self.max_mini_keys,
        )
        # the setting in use, and its bonus by level (0 to `max_turns`): `_follow_setting`
        self._setting = self.selector.best
        self._bonus_of_level = [
            self._bonus_for(self._setting, level) for level in range(self.max_turns + 1)
        ]

    @property
    def bonus(self) -> float:
        """The bonus per level in use (in capacities)."""
        return self.selector.best

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._follow_setting()
        scores = self.scores
        deepest = next((key for key in reversed(keys) if key in scores), None)
        depth = 1 if deepest is None else 1 + self.depth[deepest]
        level = self.level
        last_use = self.last_use
        is_watched = self.selector.is_watched
        bonus_of_level = self._bonus_of_level
        clock = self.clock
        for key in reversed(keys):
            clock += 1.0
            if key in self.scores:
                # `_use` and `_rescore`, inlined: once per key of every prefix looked up
                last_use[key] = clock
                if level[key] < depth:
                    level[key] = depth
                score = clock + bonus_of_level[min(level[key], self.max_turns)]
                if self.scores[key] != score:
                    self._set(key, score)
            if is_watched(key):
                self._sample(key, level.get(key, depth), clock)
                # (another setting: another table)
                bonus_of_level = self._bonus_of_level
        self.clock = clock

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        self._follow_setting()
        for key in reversed(keys):
            self.clock += 1.0
            if key in self.scores:
                self._use(key, 0)
                continue
            self._fresh[key] = self._ghosts.pop(key, None)
            self.depth[key] = 1
            self.level[key] = 1
            self.last_use[key] = self.clock
            self._set(key, self.clock)

    def order_chain(self, keys: Sequence[OffloadKey]) -> None:
        self._follow_setting()
        depth = 1
        for key in keys:
            known = self._fresh[key] if key in self._fresh else self.depth[key]
            if known is not None:
                depth = 1 + known
        latest = float("-inf")
        fresh = self._fresh
        level = self.level
        last_use = self.last_use
        # a head is as recent as its tail, and at least as deep
        for key in reversed(keys):
            if key in fresh:
                ghost = fresh.pop(key)
                self.depth[key] = depth if ghost is None else ghost
                if self.selector.is_watched(key):
                    self._sample(key, depth, last_use[key])
            if level[key] < depth:
                level[key] = depth
            if last_use[key] < latest + _CHAIN_STEP:
                last_use[key] = latest + _CHAIN_STEP
            latest = last_use[key]
            self._rescore(key)

    def rank_last(self, keys: Sequence[OffloadKey]) -> None:
        """`ScoredPolicy.rank_last` (a key's last use raised to `clock`), its calls inlined: a store
        ranks most of its chunks last (their tails are held)."""
        last_use = self.last_use
        for key in keys:
            if key in self.scores:
                self.clock += 1.0
                if last_use[key] < self.clock:
                    last_use[key] = self.clock
                self._rescore(key)

    def clear(self) -> None:
        super().clear()
        for d in (self.depth, self.level, self.last_use, self._fresh, self._ghosts):
            d.clear()
        self.selector.clear()

    def _use(self, key: OffloadKey, depth: int) -> None:
        # (as inlined in `touch`)
        self.last_use[key] = self.clock
        self.level[key] = max(self.level[key], depth)
        self._rescore(key)

    def _raise_to(self, key: OffloadKey, score: float) -> None:
        # as recent as `score` in key time (its level's bonus kept): a later rescore keeps it
        self.last_use[key] = max(self.last_use[key], score)
        self._rescore(key)

    def _lower_to(self, key: OffloadKey, score: float) -> None:
        self.last_use[key] = score - self._bonus(self.level[key])
        self._rescore(key)

    def _rescore(self, key: OffloadKey) -> None:
        score = self.last_use[key] + self._bonus_of_level[min(self.level[key], self.max_turns)]
        if self.scores[key] != score:
            self._set(key, score)

    def _sample(self, key: OffloadKey, level: int, now: float) -> None:
        """Show a use of a watched key to the miniatures; when they pick another bonus, rescore
        every key."""
        if self.selector.access(key, level, now):
            self._follow_setting()

    def _follow_setting(self) -> None:
        """Use the bonus the selector names (rescoring every key) if it is not the one in use: the
        selector changes it in `_sample`, a miniature's `_SameBonus` whenever its source's does."""
        if self.selector.best == self._setting:
            return
        self._setting = self.selector.best
        self._bonus_of_level = [
            self._bonus_for(self._setting, level) for level in range(self.max_turns + 1)
        ]
        self.rescore_all(
            {key: self.last_use[key] + self._bonus(self.level[key]) for key in self.scores}
        )

    def _bonus(self, level: int) -> float:
        return self._bonus_of_level[min(level, self.max_turns)]

    def _bonus_for(self, bonus: float, level: int) -> float:
        return self.capacity * bonus * (min(level, self.max_turns) - 1)

    def _forget(self, key: OffloadKey, evicted: bool) -> None:
        for d in (self.level, self.last_use, self._fresh):
            d.pop(key, None)
        depth = self.depth.pop(key, None)
        if evicted and depth is not None:
            self._ghosts[key] = depth
            if len(self._ghosts) > self._max_ghosts:
                self._ghosts.popitem(last=False)
