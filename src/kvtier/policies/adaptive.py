"""Follow the best of the built-in policies, chosen online by miniature simulations.

No one policy wins on every trace: `turns` wins on the Mooncake conversation trace, but on
another Mooncake-format trace ARC beat it at 5 % (total hit rate 0.186 against 0.171; issue
23). This policy runs each expert (`turns`, `arc`, `lru`) in full over the keys the tier holds,
so that any of them can take over with its own state, and lets one of them, the leader, choose
the victims; the others forget those victims as evicted (`evict_keys`: ARC's ghosts and turns'
remembered depths see them), so every expert holds exactly the tier's keys and the history it
needs to lead.

The leader is chosen by `kvtier.policies.minisim.PolicySelector`: one miniature per expert (the
same policy at 1/`sample` of the capacity, fed the keys of a hash-sampled 1/`sample` slice of
the traffic, at least `min_keys` slots), hits counted with a decay, and the lead changing hands
only on a clear margin (McNemar's test over the keys one miniature held and the other did not).
A `turns` miniature uses the bonus its full-size expert chose (`_SameBonus`).

Costs: each call goes to every expert (three policies' work and memory, each bounded by the
capacity), plus the miniatures' share; choosing is O(number of experts) every `period` x
capacity accesses. A switch costs nothing: the new leader's order is already kept.

Why followers need `evict_keys` rather than `discard`: a follower whose keys were discarded
kept no ghosts, and on taking over it lost them where they counted (on the conversation trace at
5 %, 0.082 against 0.094 with them); and evicting given keys through `evict(n, all but them)`
is O(n) in LRU and ARC (a scan past every protected key).

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvtier.keys import OffloadKey
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import CachePolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.minisim import PolicySelector, SettingSelector
from kvtier.policies.turns import TurnsPolicy

__all__ = ["AdaptivePolicy"]

# a built-in: it has `evict_keys`
_Expert = LRUPolicy | ARCPolicy | TurnsPolicy
_EXPERTS: dict[str, type[_Expert]] = {"turns": TurnsPolicy, "arc": ARCPolicy, "lru": LRUPolicy}


class AdaptivePolicy(CachePolicy):
    """Victims of the expert whose miniature hits most; see the module docstring."""

    name = "adaptive"
    # the first leads until measured
    experts: tuple[str, ...] = ("turns", "arc", "lru")
    # the miniatures' key sample: at most 1 key in this many
    max_sample = 8
    # the miniatures' least size (keys)
    min_keys = 512
    # their most size: past 8 x this capacity the sample thins (`minisim.thinned`)
    max_keys = 2048
    # choose every capacity's worth of accesses, remembering ~64 of them, switching on a 2-sigma
    # lead: on the conversation trace at 20 %, where the three are within 0.01 of each other,
    # halving every 4 capacities and no margin switched on noise and lost 0.005
    period = 1
    memory = 64.0
    margin = 2.0

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.policies = {name: _EXPERTS[name](capacity) for name in self.experts}
        # `_followers`' answer, and the leader it was for
        self._follower_list: list[_Expert] = []
        self._followers_of = ""
        self.selector = PolicySelector(
            capacity,
            self.experts,
            self._miniature,
            max_sample=self.max_sample,
            min_keys=self.min_keys,
            period=self.period,
            memory=self.memory,
            margin=self.margin,
            max_keys=self.max_keys,
        )

    @property
    def leader(self) -> str:
        """The expert that chooses the victims now."""
        return self.selector.best

    def prepare_insert(self, keys: Sequence[OffloadKey]) -> None:
        for policy in self.policies.values():
            policy.prepare_insert(keys)

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        for policy in self.policies.values():
            policy.insert(keys)
        self.selector.access(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for policy in self.policies.values():
            policy.touch(keys)
        self.selector.access(keys)

    def order_chain(self, keys: Sequence[OffloadKey]) -> None:
        for policy in self.policies.values():
            policy.order_chain(keys)
        self.selector.order_chain(keys)

    def rank_last(self, keys: Sequence[OffloadKey]) -> None:
        for policy in self.policies.values():
            policy.rank_last(keys)

    def take_places(self, keys: Sequence[OffloadKey], victims: Sequence[OffloadKey]) -> None:
        for policy in self.policies.values():
            policy.take_places(keys, victims)

    def evict_in_place(
        self, key: OffloadKey, victim: OffloadKey, protected: Container[OffloadKey]
    ) -> bool:
        """The leader decides; the others follow (evicted as the leader's victim, or in place)."""
        evicted = self.policies[self.leader].evict_in_place(key, victim, protected)
        for policy in self._followers():
            policy.take_places((key,), (victim,))
            if evicted:
                policy.evict_keys((key,))
        return evicted

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        victims = self.policies[self.leader].evict(n, protected)
        if victims is not None:
            for policy in self._followers():
                policy.evict_keys(victims)
        return victims

    def discard(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        held = self.policies[self.leader].discard(keys)
        for policy in self._followers():
            policy.discard(held)
        return held

    def clear(self) -> None:
        """Forget every key and history, but not which expert leads (as turns keeps its bonus)."""
        for policy in self.policies.values():
            policy.clear()
        self.selector.clear()

    def __len__(self) -> int:
        return len(self.policies[self.leader])

    def __contains__(self, key: object) -> bool:
        return key in self.policies[self.leader]

    def _followers(self) -> list[_Expert]:
        """The experts but the leader (kept while it leads: asked at every eviction)."""
        leader = self.leader
        if leader != self._followers_of:
            self._followers_of = leader
            self._follower_list = [p for name, p in self.policies.items() if name != leader]
        return self._follower_list

    def _miniature(self, name: str, capacity: int) -> _Expert:
        mini = _EXPERTS[name](capacity)
        if isinstance(mini, TurnsPolicy):
            mini.selector = _SameBonus(self.policies[name].selector)  # type: ignore[union-attr,assignment]
        return mini


class _SameBonus:
    """A `turns` miniature's stand-in for its own `SettingSelector`: the bonus its full-size
    expert chose. A miniature's own choice, on a sample of a sample (and none at all under 256
    slots: plain recency), ranked it under ARC on the conversation trace where the full `turns`
    beats ARC by 10 %."""

    def __init__(self, source: SettingSelector):
        self.source = source

    @property
    def best(self) -> float:
        """The full-size expert's choice now (the miniature follows it at its next call)."""
        return self.source.best

    def is_watched(self, key: OffloadKey) -> bool:
        """No key is shown to a miniature's own miniatures: it runs none."""
        return False

    def access(self, key: OffloadKey, level: int, now: float) -> bool:
        """Nothing to learn: `best` is the source's."""
        return False

    def clear(self) -> None:
        """Nothing kept."""
