"""The `adaptive` policy: every expert holds the tier's keys, the leader chooses the victims,
and the miniatures hand the lead to the expert that hits most.

The OffloadingManager contract (test_manager_contract) runs here against `adaptive`: its tests
are imported, and this module's `manager` fixture, which they resolve here, builds the CPU tier
(alone and as a tiered manager's primary) with this policy.
"""

from __future__ import annotations

import inspect
import random

import pytest

import test_manager_contract
from helpers import access, key, keys, nums
from kvtier import CPUTierManager
from kvtier.policies import AdaptivePolicy, make_policy
from tier_helpers import make_tiered

EXPERTS = AdaptivePolicy.experts

# the contract's tests that take a `manager`: collected here, they get this module's fixture
globals().update(
    {
        name: test
        for name, test in vars(test_manager_contract).items()
        if name.startswith("test_") and "manager" in inspect.signature(test).parameters
    }
)


@pytest.fixture(params=["adaptive", "tiered-adaptive"])
def manager(request, tmp_path):
    """The contract's CPU tier, alone or as a TieredManager's primary, with `adaptive`."""
    if request.param == "adaptive":
        yield CPUTierManager(num_slots=4, policy="adaptive")
        return
    tiered, _ = make_tiered(tmp_path, num_slots=4, policy="adaptive")
    yield tiered
    tiered.close()


def check_same_keys(p: AdaptivePolicy, held: set[bytes]) -> None:
    """The policy and each of its experts hold exactly `held`."""
    assert len(p) == len(held) and all(k in p for k in held)
    for expert in p.policies.values():
        assert len(expert) == len(held) and all(k in expert for k in held)


@pytest.mark.parametrize("leader", EXPERTS)
def test_each_leader_evicts_a_tail_before_its_head(leader):
    p = AdaptivePolicy(8)
    p.selector.best = leader
    # two requests store [1,2,3] and [4,5]; then [1,2,3] is reused: ranked head first
    p.insert(keys(1, 2, 3))
    p.insert(keys(4, 5))
    p.touch(keys(1, 2, 3))
    p.order_chain(keys(1, 2, 3))
    # evicting everything: 3 before 2 before 1, whoever leads
    victims = nums(p.evict(5, set()))
    assert victims.index(3) < victims.index(2) < victims.index(1)
    check_same_keys(p, set())


def test_evict_is_atomic_and_followers_lose_the_victims_too():
    p = AdaptivePolicy(4)
    p.insert(keys(1, 2, 3))
    # 3 victims needed, 2 unprotected → nothing changes anywhere
    assert p.evict(3, {key(1)}) is None
    check_same_keys(p, set(keys(1, 2, 3)))
    # 2 victims: the leader's choice, gone from every expert
    victims = p.evict(2, {key(1)})
    assert sorted(nums(victims)) == [2, 3]
    check_same_keys(p, {key(1)})


def test_a_follower_remembers_the_leaders_victims_as_evictions():
    p = AdaptivePolicy(2)
    p.selector.best = "lru"
    p.insert(keys(1, 2))
    # LRU evicts 2 (the tail); ARC, following, keeps it as a ghost of T1 (B1)
    assert nums(p.evict(1, set())) == [2]
    assert list(p.policies["arc"].b1) == keys(2)
    # a discard is a lost key, not an eviction: no ghost
    p.discard(keys(1))
    assert list(p.policies["arc"].b1) == keys(2)
    check_same_keys(p, set())


def test_random_calls_keep_every_expert_on_the_tiers_keys():
    rng = random.Random(23)
    p = make_policy("adaptive", 16)
    held: set[bytes] = set()
    for _ in range(1500):
        op = rng.random()
        # store: the tier evicts for the new keys first, then inserts them
        if op < 0.35:
            batch = keys(*rng.sample(range(60), rng.randint(1, 6)))
            new = [k for k in batch if k not in held]
            p.prepare_insert(new)
            num_needed = len(held) + len(new) - p.capacity
            if num_needed > 0:
                victims = p.evict(num_needed, set(batch))
                if victims is None:
                    continue
                assert set(victims) <= held - set(batch) and len(set(victims)) == num_needed
                held -= set(victims)
            p.insert(new)
            held |= set(new)
        # a lookup touches the keys (unheld ones are ignored)
        elif op < 0.6:
            p.touch(keys(*rng.sample(range(60), rng.randint(1, 6))))
        # a request's chain, head first, all held
        elif op < 0.75 and held:
            p.order_chain(rng.sample(sorted(held), min(len(held), rng.randint(1, 5))))
        # evict n with some keys protected: all or nothing
        elif op < 0.9:
            n, protected = rng.randint(1, 8), set(keys(*rng.sample(range(60), 20)))
            victims = p.evict(n, protected)
            if victims is None:
                assert len(held - protected) < n
            else:
                assert len(set(victims)) == n and set(victims) <= held - protected
                held -= set(victims)
        # lost keys: the held ones come back once each, in the order given
        elif op < 0.99:
            lost = keys(*rng.choices(range(60), k=rng.randint(1, 4)))
            assert p.discard(lost) == [k for k in dict.fromkeys(lost) if k in held]
            held -= set(lost)
        else:
            p.clear()
            held.clear()
        check_same_keys(p, held)


def test_the_lead_goes_to_arc_where_a_scan_flushes_recency():
    # a hot set of 32 keys, each request one hot key and 8 keys never seen again: LRU (and
    # `turns`, whose bonus needs miniatures of its own that a 64-slot tier does not run) lets
    # the scan flush the hot set; ARC keeps it in T2
    p, lru = AdaptivePolicy(64), make_policy("lru", 64)
    rng, fresh = random.Random(1), iter(range(1000, 10**6))
    assert p.leader == "turns"
    # in the second half
    hits = lru_hits = 0
    for step in range(1200):
        ids = [rng.randrange(32), *(next(fresh) for _ in range(8))]
        hit, lru_hit = access(p, keys(*ids)), access(lru, keys(*ids))
        if step >= 600:
            hits, lru_hits = hits + hit, lru_hits + lru_hit
    assert p.leader == "arc"
    # ARC's hits on the hot set, well above LRU's
    assert hits > 2 * lru_hits


def test_the_lead_stays_when_the_experts_tie():
    # a working set that fits: every expert hits every reuse, nothing to switch for
    p = AdaptivePolicy(64)
    rng = random.Random(2)
    for _ in range(2000):
        access(p, keys(*rng.sample(range(48), 4)))
    assert p.leader == "turns"
