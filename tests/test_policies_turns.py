"""The `turns` policy (conversation depth) and its miniature simulations: the scenarios where
its order differs from LRU's. The contract suite (test_manager_contract) runs it too.

Keys are numbered (helpers.key); S is a shared system prompt, aN / bN / cN chunks of
conversations A, B and C.
"""

from __future__ import annotations

import itertools

from helpers import key, keys, make_req_context, nums
from kvtier import CPUTierManager
from kvtier.policies import TurnsPolicy
from kvtier.policies.minisim import SettingSelector

S, A1, A2, B1, C1, C2 = 1, 11, 12, 21, 31, 32


class Bonus1(TurnsPolicy):
    """A fixed bonus of one capacity per level (no miniatures), so the scenarios read exactly."""

    bonuses = (1.0,)


_requests = itertools.count()


def turn(m: CPUTierManager, reused: tuple[int, ...], new: tuple[int, ...]) -> list[int] | None:
    """One request as the scheduler drives it: touch the prefix it reuses, store the rest."""
    ctx = make_req_context(f"r{next(_requests)}")
    m.touch(keys(*reused), ctx)
    out = m.prepare_store(keys(*new), ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    m.check()
    return nums(out.evicted_keys)


def conversations(policy: str) -> CPUTierManager:
    m = CPUTierManager(5, policy=policy)
    # the system prompt, depth 1
    turn(m, (), (S,))
    # A's first turn: depth 2
    turn(m, (S,), (A1,))
    # A comes back: depth 3, and S, A1 rise to it
    turn(m, (S, A1), (A2,))
    # B's first turn, more recent than all of A: depth 2
    turn(m, (S,), (B1,))
    return m


def test_a_conversation_that_came_back_outlives_a_newer_first_turn():
    m = conversations("test_policies_turns:Bonus1")
    assert [m._policy.inner.depth[key(k)] for k in (S, A1, A2, B1)] == [1, 2, 3, 2]
    # C's first turn needs 2 slots, 1 is free: B's first turn goes, A (two turns deep) stays
    assert turn(m, (S,), (C1, C2)) == [B1]


def test_lru_would_drop_the_older_conversation_instead():
    m = conversations("lru")
    # same traffic under LRU: A's tail is the oldest
    assert turn(m, (S,), (C1, C2)) == [A2]


def test_a_tail_goes_before_its_head_within_a_level():
    m = CPUTierManager(4, policy="test_policies_turns:Bonus1")
    turn(m, (), (S,))
    # one chain at depth 2: A2 is its tail
    turn(m, (S,), (A1, A2))
    # depth 2, newest
    turn(m, (S,), (B1,))
    # C needs 2 slots, 0 free: A's tail, then its head (the oldest chain)
    assert turn(m, (S,), (C1, C2)) == [A2, A1]


def test_a_chunk_stored_again_after_its_eviction_keeps_its_depth():
    p = Bonus1(3)
    p.insert(keys(S))
    # depth 1
    p.order_chain(keys(S))
    p.insert(keys(A1))
    # depth 2
    p.order_chain(keys(S, A1))
    assert nums(p.evict(1, {key(S)})) == [A1]
    # A's next turn misses A1 (gone) and stores it again with a new chunk A2
    p.insert(keys(A1, A2))
    p.order_chain(keys(S, A1, A2))
    # A1 is remembered at depth 2, so A2 is a third turn's chunk
    assert (p.depth[key(A1)], p.depth[key(A2)]) == (2, 3)


def test_evict_is_atomic_and_discard_leaves_no_ghost():
    p = Bonus1(4)
    p.insert(keys(1, 2))
    # 2 victims wanted, 1 unprotected: nothing changes
    assert p.evict(2, {key(1)}) is None and len(p) == 2
    # a lost chunk (a corrupt file) is forgotten, not remembered as a ghost
    assert p.discard(keys(2, 9)) == keys(2)
    assert key(2) not in p and key(2) not in p._ghosts
    p.clear()
    assert len(p) == 0 and not p.depth


# -- miniature simulations ------------------------------------------------------------------


def test_the_miniatures_pick_the_setting_whose_sample_hit_most():
    # one miniature of 3 keys per setting (every key sampled); a level-2 key D comes back every
    # 5 accesses, between 4 one-off level-1 keys: only a bonus keeps D that long
    selector = SettingSelector(
        3, [0.0, 10.0], bonus=lambda s, level: s * (level - 1), sample=1, min_keys=1, period=10
    )
    now = itertools.count()
    for i in range(40):
        selector.access(key(1000), 2, next(now))
        for j in range(4):
            selector.access(key(i * 4 + j), 1, next(now))
    assert selector.best == 10.0


def test_the_miniatures_keep_plain_recency_when_deep_keys_do_not_come_back():
    # 4 keys per miniature; deep keys are one-offs, 2 shallow keys come back every 4 accesses:
    # recency keeps them, a bonus for the deep ones pushes them out
    selector = SettingSelector(
        4, [10.0, 0.0], bonus=lambda s, level: s * (level - 1), sample=1, min_keys=1, period=10
    )
    now = itertools.count()
    for i in range(60):
        selector.access(key(2000), 1, next(now))
        selector.access(key(2001), 1, next(now))
        selector.access(key(i * 2), 2, next(now))
        selector.access(key(i * 2 + 1), 2, next(now))
    assert selector.best == 0.0


def test_a_small_tier_runs_no_miniature_and_keeps_the_first_setting():
    # 100 / 4 sampled keys: too few to rank settings
    p = TurnsPolicy(100)
    assert p.bonus == TurnsPolicy.bonuses[0] == 0.0
