"""The OffloadingManager contract, run against CPUTierManager with every policy, and against
a TieredManager (that CPU tier as primary, a real disk tier behind it, write-through).
Where a scenario is about the CPU tier's eviction order, it asks the CPU tier itself
(`cpu(m)`): a chunk it evicted is still on disk, so the tiered manager promotes it.

Capacity 4 throughout; keys are numbered (see helpers.key) and every step says
what must happen next.
"""

from __future__ import annotations

import pytest

from helpers import HANG_S, key, keys, make_req_context, nums
from kvtier import CPUTierManager, LookupResult, NotReadyError, ReqContext
from kvtier.errors import ConfigError
from kvtier.tiers.tiered import TieredManager
from tier_helpers import make_tiered, settle

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
CTX = make_req_context()


@pytest.fixture(params=["lru", "arc", "turns", "tiered-lru", "tiered-arc", "tiered-turns"])
def manager(request, tmp_path):
    """The CPU tier alone, or as the primary of a TieredManager with a real disk tier."""
    policy = request.param.removeprefix("tiered-")
    if policy == request.param:
        yield CPUTierManager(num_slots=4, policy=policy)
        return
    tiered, _ = make_tiered(tmp_path, num_slots=4, policy=policy)
    yield tiered
    tiered.close()


def settled(m) -> None:
    """With secondary tiers: wait until their cascades ended (the slots they pinned are free)."""
    if isinstance(m, TieredManager):
        settle(m)


def cpu(m) -> CPUTierManager:
    """The CPU tier itself: after an eviction a TieredManager still finds the chunk on disk."""
    return m.primary if isinstance(m, TieredManager) else m


def lookups(m, *ids: int) -> list[LookupResult]:
    """What `lookup` answers for each key, in order."""
    return [m.lookup(k, CTX) for k in keys(*ids)]


def store(m, *ids: int, ctx: ReqContext = CTX) -> list[int]:
    """prepare + complete a store (and, with secondary tiers, their cascades); returns the slots used."""
    out = m.prepare_store(keys(*ids), ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    settled(m)
    m.check()
    return out.store_spec.slot_ids.tolist()


def test_lookup_states(manager):
    # nothing stored → MISS
    assert manager.lookup(key(1), CTX) is MISS
    # prepared but not completed → HIT_PENDING (invisible to loads)
    out = manager.prepare_store(keys(1), CTX)
    assert manager.lookup(key(1), CTX) is PENDING
    with pytest.raises(NotReadyError):
        manager.prepare_load(keys(1), CTX)
    # completed → HIT
    manager.complete_store(out.keys_to_store, CTX)
    assert manager.lookup(key(1), CTX) is HIT
    assert lookups(manager, 1, 2) == [HIT, MISS]
    manager.check()


def test_slot_ids_fresh_first_then_reused(manager):
    # store [1,2,3] → fresh slots 0,1,2
    assert store(manager, 1, 2, 3) == [0, 1, 2]
    # store [4,5] → fresh slot 3 first, then evicts one chunk and reuses its slot
    out = manager.prepare_store(keys(4, 5), CTX)
    assert out.store_spec.slot_ids.tolist()[0] == 3
    assert len(out.evicted_keys) == 1
    reused = out.store_spec.slot_ids.tolist()[1]
    assert reused in (0, 1, 2)
    manager.complete_store(out.keys_to_store, CTX)
    manager.check()


def test_prepare_store_drops_present_and_in_flight_keys(manager):
    # store [1] completes; [2] is prepared but still in flight
    store(manager, 1)
    manager.prepare_store(keys(2), CTX)
    # a second request offers [1,2,3] → only [3] is new (cross-step dedup)
    out = manager.prepare_store(keys(1, 2, 3), make_req_context("other"))
    assert nums(out.keys_to_store) == [3]
    # duplicates inside one call are stored once
    out = manager.prepare_store(keys(4, 4), CTX)
    assert nums(out.keys_to_store) == [4]
    manager.check()


def test_store_never_evicts_its_own_keys(manager):
    # full: [1,2,3,4]
    store(manager, 1, 2, 3, 4)
    # offer [1,2,5]: 1 and 2 are present and belong to the call → evict from {3,4} only
    out = manager.prepare_store(keys(1, 2, 5), CTX)
    assert nums(out.keys_to_store) == [5]
    assert set(nums(out.evicted_keys)) <= {3, 4}
    manager.complete_store(out.keys_to_store, CTX)
    assert manager.lookup(key(1), CTX) is HIT and manager.lookup(key(2), CTX) is HIT
    # offer 5 new keys at capacity 4 → impossible → None, nothing changed
    assert manager.prepare_store(keys(10, 11, 12, 13, 14), CTX) is None
    assert manager.stats().used_slots == 4
    manager.check()


def test_none_while_loads_pin_every_slot(manager):
    # full: [1,2,3,4], all pinned by a load
    store(manager, 1, 2, 3, 4)
    manager.prepare_load(keys(1, 2, 3, 4), CTX)
    # a store needs one victim and finds none → None ("no room now"), counted
    assert manager.prepare_store(keys(5), CTX) is None
    assert manager.stats().rejected_stores == 1
    # the load completes → the store succeeds and evicts one of them
    manager.complete_load(keys(1, 2, 3, 4), CTX)
    out = manager.prepare_store(keys(5), CTX)
    assert out is not None and len(out.evicted_keys) == 1
    manager.check()


def test_pending_chunks_are_never_evicted(manager):
    # [1,2,3,4] all in flight
    manager.prepare_store(keys(1, 2, 3, 4), CTX)
    # another store finds no victim: PENDING chunks are not evictable
    assert manager.prepare_store(keys(5), make_req_context("b")) is None
    manager.check()


def test_rollback_after_failed_store(manager):
    # prepare [1,2] → slots 0,1 reserved
    out = manager.prepare_store(keys(1, 2), CTX)
    # the write failed → both rolled back, slots freed, no stored event
    manager.complete_store(out.keys_to_store, CTX, success=False)
    assert manager.lookup(key(1), CTX) is MISS
    s = manager.stats()
    assert (s.used_slots, s.pending_slots, s.failed_stores) == (0, 0, 2)
    assert manager.take_events() == []
    # the freed slots are reused once the fresh ones are gone: all 4 slots usable again
    slot_ids = store(manager, 3, 4, 5, 6)
    assert slot_ids[:2] == [2, 3] and sorted(slot_ids[2:]) == [0, 1]
    manager.check()


def test_repeated_or_unknown_completion_is_ignored(manager):
    store(manager, 1)
    # 1 is READY, 9 unknown
    manager.complete_store(keys(1, 9), CTX, success=False)
    assert manager.lookup(key(1), CTX) is HIT
    # never pinned: ignored
    manager.complete_load(keys(1), CTX)
    manager.check()


def test_events_removed_before_the_stored_event_that_caused_it(manager):
    store(manager, 1, 2, 3, 4)
    manager.take_events()
    # store [5] → evicts one key: its removed event comes first, then 5's stored event
    out = manager.prepare_store(keys(5), CTX)
    manager.complete_store(out.keys_to_store, CTX)
    events = manager.take_events()
    assert [(e.removed, e.medium) for e in events] == [(True, "cpu"), (False, "cpu")]
    assert events[0].keys == out.evicted_keys and nums(events[1].keys) == [5]
    assert manager.take_events() == []


def test_events_can_be_disabled():
    m = CPUTierManager(num_slots=4, enable_events=False)
    store(m, 1, 2)
    assert m.take_events() == []


def test_pinned_chunk_survives_until_complete_load(manager):
    store(manager, 1, 2, 3, 4)
    # pin [1] for a load, then store [5,6,7] → evicts 3 of {2,3,4}, never 1
    manager.prepare_load(keys(1), CTX)
    out = manager.prepare_store(keys(5, 6, 7), make_req_context("b"))
    assert set(nums(out.evicted_keys)) == {2, 3, 4}
    manager.complete_store(out.keys_to_store, make_req_context("b"))
    settled(manager)
    # the load completes → 1 is evictable again
    manager.complete_load(keys(1), CTX)
    out = manager.prepare_store(keys(8, 9, 10, 11), make_req_context("c"))
    assert 1 in nums(out.evicted_keys)
    manager.check()


def test_on_request_finished_releases_leftover_pins(manager):
    store(manager, 1, 2)
    ctx = make_req_context("aborted")
    manager.prepare_load(keys(1, 2), ctx)
    assert manager.stats().pinned_slots == 2
    # the request finishes without complete_load → its pins are released, counted
    manager.on_request_finished(ctx)
    s = manager.stats()
    assert (s.pinned_slots, s.evictable_slots, s.extra["released_pins"]) == (0, 2, 2)
    manager.check()


def test_reset_forgets_ready_chunks_and_retires_busy_ones(manager):
    store(manager, 1, 2)
    # 1 is being loaded
    manager.prepare_load(keys(1), CTX)
    # 3 is being written
    manager.prepare_store(keys(3), CTX)
    manager.take_events()
    manager.reset()
    # everything is a MISS now, even the chunks still in transfer
    assert [manager.lookup(k, CTX) for k in keys(1, 2, 3)] == [MISS, MISS, MISS]
    # readable chunks that vanished are reported removed
    assert [(nums(e.keys), e.removed) for e in manager.take_events()] == [([1, 2], True)]
    # 2 was freed at once; 1 and 3 keep their slots until their transfers end
    assert manager.stats().used_slots == 2
    manager.complete_load(keys(1), CTX)
    # a stale completion: frees, does not resurrect
    manager.complete_store(keys(3), CTX)
    assert manager.lookup(key(3), CTX) is MISS
    assert manager.stats().used_slots == 0
    manager.check()


def test_a_second_reset_keeps_the_slots_of_transfers_still_running(manager):
    """A chunk an earlier reset retired is still being written or read: a second reset must not
    hand its slot to a new chunk (the transfer in flight would overwrite the new chunk's bytes)."""
    store(manager, 1)
    # 1 is being loaded
    manager.prepare_load(keys(1), CTX)
    # 2 is being written
    manager.prepare_store(keys(2), CTX)
    manager.reset()
    manager.reset()
    assert manager.stats().used_slots == 2
    manager.complete_load(keys(1), CTX)
    manager.complete_store(keys(2), CTX)
    assert manager.stats().used_slots == 0
    manager.check()


def store_as(m: CPUTierManager, req_id: str, *ids: int) -> None:
    ctx = make_req_context(req_id)
    out = m.prepare_store(keys(*ids), ctx)
    m.complete_store(out.keys_to_store, ctx)
    settled(m)


def test_a_prefix_stored_over_several_calls_loses_its_tail_first():
    # issue #8 defect 8, with every policy: capacity 2
    for policy in ("lru", "arc", "turns"):
        m = CPUTierManager(num_slots=2, policy=policy)
        # A stores its chain head first, one chunk per call (chunked prefill, decode)
        store_as(m, "A", 1)
        store_as(m, "A", 2)
        # B needs a slot: A's tail [2] goes, its head [1] stays usable
        store_as(m, "B", 3)
        assert lookups(m, 1, 2) == [HIT, MISS], policy
        m.check()


def test_a_prefix_reused_from_the_tier_keeps_its_head_when_the_request_stores_its_tail(manager):
    # A's head [1, 2] came from another request; A touches it (a reuse), then stores [3, 4]
    store_as(manager, "X", 1, 2)
    manager.touch(keys(1, 2), make_req_context("A"))
    store_as(manager, "A", 3, 4)
    # B needs two slots: A's tail [4, 3] goes first, never the head the tail stands on
    store_as(manager, "B", 5, 6)
    assert lookups(cpu(manager), 1, 2, 3) == [HIT, HIT, MISS]


def test_tails_before_heads_across_kv_cache_groups(manager):
    # one request, two groups (g0, g1) of 2 chunks each, stored over two calls, chunk by chunk
    a = make_req_context("A")
    first, second = [key(1, 0), key(1, 1)], [key(2, 0), key(2, 1)]
    for ks in (first, second):
        manager.complete_store(manager.prepare_store(ks, a).keys_to_store, a)
        settled(manager)
    # B needs two slots: both groups' chunk 2 go; chunk 1 stays readable in both groups
    store_as(manager, "B", 7, 8)
    assert [cpu(manager).lookup(k, CTX) for k in first + second] == [HIT, HIT, MISS, MISS]


def test_stats_add_up(manager):
    store(manager, 1, 2)
    manager.prepare_store(keys(3), CTX)
    manager.prepare_load(keys(1), CTX)
    s = manager.stats()
    assert (s.used_slots, s.pinned_slots, s.pending_slots, s.evictable_slots) == (3, 1, 1, 1)
    assert manager.lookup(key(2), CTX) is HIT and manager.lookup(key(9), CTX) is MISS
    s = manager.stats()
    assert (s.hits, s.misses, s.stores) == (1, 1, 2)


# -- bad input -------------------------------------------------------------------------


def test_unknown_policy_names_the_choices():
    with pytest.raises(
        ConfigError, match=r"unknown policy 'fifo'.*\['adaptive', 'arc', 'lru', 'turns'\]"
    ):
        CPUTierManager(num_slots=4, policy="fifo")


@pytest.mark.parametrize("num_slots", [0, -3])
def test_non_positive_capacity(num_slots):
    with pytest.raises(ValueError, match="num_slots must be a positive int"):
        CPUTierManager(num_slots=num_slots)


def test_wrong_key_length_is_a_clear_error(manager):
    with pytest.raises(
        ValueError, match="offload key of 32 bytes where this tier expects 36.*make_offload_key"
    ):
        manager.prepare_store([b"x" * 32], CTX)
    with pytest.raises(ValueError, match="make_offload_key"):
        manager.lookup(b"short", CTX)
    manager.check()


def test_req_id_is_required():
    with pytest.raises(TypeError):
        ReqContext()  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="req_id must be the request id as a str"):
        ReqContext(req_id=7)  # type: ignore[arg-type]


def test_tier_stats_list_the_tiers_behind_the_cpu_tier(manager):
    # the CPU tier alone has none; the tiered manager has its disk tier
    expected = ["disk"] if isinstance(manager, TieredManager) else []
    assert [t.medium for t in manager.tier_stats()] == expected
    # store [1] → its cascade (if any) ends within drain's bound
    store(manager, 1)
    assert manager.drain(HANG_S)
