"""Scenarios where the eviction order of a policy matters (capacity 4)."""

from __future__ import annotations

import itertools

import pytest

from helpers import key, keys, make_req_context, nums
from kvtier import CPUTierManager
from kvtier.errors import ConfigError
from kvtier.policies import ARCPolicy, CachePolicy, LRUPolicy, make_policy

CTX = make_req_context()
_requests = itertools.count()


def fill(m: CPUTierManager, *ids: int) -> list[int] | None:
    """Store ids as one request of their own; return the keys it evicted."""
    ctx = make_req_context(f"fill-{next(_requests)}")
    out = m.prepare_store(keys(*ids), ctx)
    if out is None:
        return None
    m.complete_store(out.keys_to_store, ctx)
    m.check()
    return nums(out.evicted_keys)


# -- LRU -------------------------------------------------------------------------------


def test_lru_touch_walks_keys_in_reverse():
    m = CPUTierManager(4, policy="lru")
    # two stores: [1,2] then [3,4]; inside a call the prefix is the more recent
    fill(m, 1, 2)
    fill(m, 3, 4)
    # touch [1,2,3] → order (oldest first) 4, 3, 2, 1: tails before their prefixes
    m.touch(keys(1, 2, 3), CTX)
    assert fill(m, 5) == [4]
    assert fill(m, 6) == [3]
    assert fill(m, 7, 8) == [2, 1]


def test_lru_store_order_evicts_tail_first():
    m = CPUTierManager(4, policy="lru")
    # one request stores its chain [1,2,3,4]
    fill(m, 1, 2, 3, 4)
    # the next store evicts the chain's tail (4), keeping the prefix usable
    assert fill(m, 5) == [4]


def test_lru_order_after_complete_load():
    m = CPUTierManager(4, policy="lru")
    fill(m, 1)
    fill(m, 2)
    fill(m, 3)
    # oldest first: 1, 2, 3, 4
    fill(m, 4)
    # load [1] (pinned), then store [5] → 1 is pinned, so 2 goes
    m.prepare_load(keys(1), CTX)
    assert fill(m, 5) == [2]
    # the load completes: 1 keeps its old recency and is the next victim
    m.complete_load(keys(1), CTX)
    assert fill(m, 6) == [1]


# -- ARC -------------------------------------------------------------------------------


def test_arc_touch_promotes_t1_to_t2():
    p = ARCPolicy(4)
    p.insert(keys(1, 2))
    assert list(p.t1) == keys(2, 1) and not p.t2
    # a touch is the second use → T2
    p.touch(keys(1))
    assert list(p.t1) == keys(2) and list(p.t2) == keys(1)


def test_arc_evicts_from_t1_while_above_target_and_keeps_frequent_keys():
    m = CPUTierManager(4, policy="arc")
    fill(m, 1, 2, 3, 4)
    # 1 and 2 used twice → T2
    m.touch(keys(1, 2), CTX)
    # a scan of one-use keys [5,6,7] only ever displaces one-use keys
    assert fill(m, 5) == [4]
    assert fill(m, 6) == [3]
    assert fill(m, 7) == [5]
    # both still present
    assert nums(m.prepare_store(keys(1, 2), CTX).keys_to_store) == []


def test_arc_ghost_hit_in_b1_grows_target():
    p = ARCPolicy(4)
    p.insert(keys(1, 2, 3, 4))
    # evict one T1 key → it becomes a B1 ghost
    assert p.evict(1, set()) == [key(4)]
    assert list(p.b1) == keys(4)
    # storing it again: B1 hit (seen before the store's evictions) → target grows by
    # max(1, |B2|/|B1|) = 1; the key goes to T2 when its store completes
    p.prepare_insert(keys(4))
    assert p.target_t1 == 1.0 and not p.b1
    p.insert(keys(4))
    assert p.target_t1 == 1.0 and key(4) in p.t2 and not p.b1


def test_arc_ghost_hit_in_b2_shrinks_target():
    p = ARCPolicy(4)
    p.target_t1 = 3.0
    p.insert(keys(1))
    # 1 in T2
    p.touch(keys(1))
    # T1 = [2], |T1| = 1 <= target → evict from T2
    p.insert(keys(2))
    assert p.evict(1, set()) == [key(1)]
    assert list(p.b2) == keys(1)
    # B2 hit → target shrinks by 1
    p.prepare_insert(keys(1))
    p.insert(keys(1))
    assert p.target_t1 == 2.0 and key(1) in p.t2


def test_arc_ghost_hits_survive_the_evictions_their_own_store_causes():
    # issue #8 defect 7: one request stores 1-4, then 5-8 (1-4 → B1), then 1-4 again
    m = CPUTierManager(num_slots=4, policy="arc")
    a = make_req_context("A")
    for ids in ((1, 2, 3, 4), (5, 6, 7, 8), (1, 2, 3, 4)):
        out = m.prepare_store(keys(*ids), a)
        m.complete_store(out.keys_to_store, a)
    # storing 1-4 again evicted 5-8 into B1, which trimmed the oldest ghosts — 1-4 — but
    # the ghost hits were taken first: 1-4 are in T2 and T1's target grew
    # the ARC policy under the hints' ranks
    policy = m._policy.inner
    assert sorted(nums(list(policy.t2))) == [1, 2, 3, 4] and not policy.t1
    assert policy.target_t1 == 4.0
    m.check()


def test_arc_keeps_a_head_at_least_as_frequent_as_its_tail():
    p = ARCPolicy(4)
    p.insert(keys(1, 2))
    # the tail is in T2 (a ghost hit, say), its head in T1
    p.touch(keys(2))
    p.order_chain(keys(1, 2))
    # head promoted, and the more recent
    assert list(p.t2) == keys(2, 1) and not p.t1


def test_arc_ghost_lists_are_bounded():
    p = ARCPolicy(4)
    for i in range(20):
        p.insert(keys(i))
        if len(p) > 4:
            p.evict(1, set())
    assert len(p.b1) <= 4 and len(p.b2) <= 4 and len(p) == 4


def test_arc_evict_is_atomic():
    p = ARCPolicy(4)
    p.insert(keys(1, 2))
    # 2 victims needed, only 1 unprotected → nothing changes
    assert p.evict(2, {key(1)}) is None
    assert len(p) == 2 and not p.b1


# -- discard: keys lost outside the policy's choice (a corrupt file) ---------------------


class BaseDiscardLRU(LRUPolicy):
    """An out-of-tree policy that keeps the base class's discard (one pass through evict)."""

    name = "base-discard-test"
    discard = CachePolicy.discard


@pytest.mark.parametrize("policy_cls", [LRUPolicy, ARCPolicy, BaseDiscardLRU])
def test_discard_forgets_held_keys_and_keeps_the_order_of_the_rest(policy_cls):
    p = policy_cls(4)
    # eviction order: 4, 3, 2, 1
    p.insert(keys(1, 2, 3, 4))
    # discard [3, 9, 1]: 3 and 1 are held and returned, 9 never was and is ignored
    assert p.discard(keys(3, 9, 1)) == keys(3, 1)
    assert len(p) == 2 and key(3) not in p and key(1) not in p
    # discarding them again finds nothing
    assert p.discard(keys(1, 3)) == []
    # the survivors keep their order: 4 goes before 2, and no discarded key comes back
    assert nums(p.evict(2, set())) == [4, 2]
    assert len(p) == 0


def test_arc_discard_leaves_no_ghost_and_keeps_the_target():
    p = ARCPolicy(4)
    p.insert(keys(1, 2))
    # 1 in T1, 2 in T2
    p.touch(keys(2))
    # both files are lost: they leave T1 and T2 without entering B1 or B2
    assert p.discard(keys(1, 2)) == keys(1, 2)
    assert not (p.t1 or p.t2 or p.b1 or p.b2)
    # stored again: no ghost hit, so the target does not move and 2 starts over in T1
    p.prepare_insert(keys(2))
    p.insert(keys(2))
    assert p.target_t1 == 0.0 and list(p.t1) == keys(2) and not p.t2


# -- the reuse gate ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_store_threshold_gate(policy):
    m = CPUTierManager(4, policy=policy, store_threshold=2)
    a, b = make_req_context("A"), make_req_context("B")
    # A offers [1,2] → counted, nothing stored
    out = m.prepare_store(keys(1, 2), a)
    assert out is not None and out.keys_to_store == []
    # A offering 1 again is still one offer
    assert m.prepare_store(keys(1), a).keys_to_store == []
    # B offers [1,3]: 1 now has two requests' offers → only 1 is stored
    out = m.prepare_store(keys(1, 3), b)
    assert nums(out.keys_to_store) == [1]
    m.check()


def test_a_retried_store_is_one_offer():
    # issue #8 defect 4: with store_threshold=2, a request retrying its store (no room the
    # first time) must not count twice
    m = CPUTierManager(2, store_threshold=2)
    # two requests offer [5, 6]: stored on the second offer
    for req in ("Z1", "Z2"):
        ctx = make_req_context(req)
        m.complete_store(m.prepare_store(keys(5, 6), ctx).keys_to_store, ctx)
    loader = make_req_context("L")
    # both slots pinned
    m.prepare_load(keys(5, 6), loader)
    # X offers 1 once
    m.prepare_store(keys(1), make_req_context("X"))
    a = make_req_context("A")
    # 1 admitted (X, A), no room: A retries
    assert m.prepare_store(keys(1, 2), a) is None
    m.complete_load(keys(5, 6), loader)
    # A's retry: 1 has two requests' offers, 2 only A's → only 1 is stored
    assert nums(m.prepare_store(keys(1, 2), a).keys_to_store) == [1]
    m.check()


def test_reuse_tracker_is_bounded():
    m = CPUTierManager(4, store_threshold=3)
    for i in range(5000):
        m.prepare_store(keys(i), CTX)
    assert len(m._gate) <= 1024


# -- the registry ----------------------------------------------------------------------


class MRUPolicy(LRUPolicy):
    """An out-of-tree policy used through the module-path hook."""

    name = "mru-test"

    def evict(self, n, protected):
        victims = [k for k in reversed(self._order) if k not in protected][:n]
        if len(victims) < n:
            return None
        for victim in victims:
            del self._order[victim]
        return victims


def test_out_of_tree_policy_by_module_path():
    m = CPUTierManager(4, policy="test_policies:MRUPolicy")
    fill(m, 1)
    fill(m, 2)
    fill(m, 3)
    fill(m, 4)
    assert fill(m, 5) == [4]


@pytest.mark.parametrize("spec", ["nope.module:X", "test_policies:missing", "test_policies:fill"])
def test_bad_policy_paths_are_clear_errors(spec):
    with pytest.raises(ConfigError, match="policy"):
        make_policy(spec, 4)


def test_policies_share_the_interface():
    assert isinstance(make_policy("lru", 2), CachePolicy) and isinstance(
        make_policy("arc", 2), CachePolicy
    )
