"""Lazy (evict-time) store mode, driven by the fake engine: the real scheduler, manager and worker.

The fake engine checks the content of every block a token attends to, so a chunk stored
from a block that was already rewritten, or loaded into the wrong place, fails a test as
`ContentMismatch`.
"""

from __future__ import annotations

import pytest

from kvtier.base import ReqContext
from kvtier.scheduler.lazy import EvictionLedger
from sched_helpers import make_engine, prompt

BLOCK = 4
# the contexts of the requests that computed the chunks a ledger test records
REQ_A = ReqContext("a")
REQ_B = ReqContext("b")
REQ_R = ReqContext("r")


def _cycle(engine, num_prompts: int, prompt_tokens: int, rounds: int) -> None:
    """Each of `num_prompts` distinct prompts, `rounds` times round-robin, one at a time."""
    for r in range(rounds):
        for p in range(num_prompts):
            engine.add_request(f"r{r}-p{p}", prompt(prompt_tokens, seed=p + 1), max_new_tokens=1)
            engine.run()


def _kvtier_hit_tokens(engine) -> int:
    return engine.scheduler.stats.hit_tokens


@pytest.mark.parametrize("num_slots,num_prompts", [(16, 5), (24, 6)])
def test_lazy_keeps_what_the_engine_lost_where_eager_keeps_copies(num_slots, num_prompts):
    """Working set (5 or 6 prompts x 5 blocks) larger than the engine (24 blocks) and than the
    host tier, but within both together (less the 8 blocks a lazy store looks ahead): eager
    stores copies of what the engine still holds, so round-robin reuse misses in both (LRU on a
    cycle larger than the cache); lazy keeps in the host what the engine evicted, so later
    rounds load prompts from it."""
    hits = {}
    for mode in ("eager", "lazy"):
        engine = make_engine(
            num_blocks=24, num_slots=num_slots, store_mode=mode, max_tokens_per_step=16
        )
        _cycle(engine, num_prompts=num_prompts, prompt_tokens=5 * BLOCK + 1, rounds=4)
        hits[mode] = _kvtier_hit_tokens(engine)
        assert engine.scheduler.stats.failed_store_chunks == 0
        if mode == "lazy":
            assert engine.scheduler.stats.lazy_offered_chunks > 0
    assert hits["eager"] == 0
    # rounds 2-4: at least a third of all reuse
    assert hits["lazy"] >= 3 * num_prompts * 5 * BLOCK // 3


def test_lazy_stores_nothing_while_the_engine_has_room():
    engine = make_engine(num_blocks=64, num_slots=16, store_mode="lazy", max_tokens_per_step=8)
    _cycle(engine, num_prompts=2, prompt_tokens=4 * BLOCK + 1, rounds=2)
    stats = engine.scheduler.stats
    assert stats.store_jobs == 0 and stats.lazy_offered_chunks == 0
    assert engine.scheduler.manager.stats().used_slots == 0
    # the engine's own cache served the second round
    assert stats.local_hit_tokens > 0


def test_lazy_store_fenced_before_its_blocks_are_rewritten():
    """A lazily stored block is handed to the next request in the very next step: its store
    must end first (a flush), and what was stored is what the first request computed."""
    engine = make_engine(num_blocks=6, num_slots=16, store_mode="lazy", max_tokens_per_step=64)
    engine.add_request("a", prompt(5 * BLOCK + 1, seed=1), max_new_tokens=1)
    engine.run()
    engine.add_request("b", prompt(5 * BLOCK + 1, seed=2), max_new_tokens=1)
    engine.run()
    engine.add_request("a2", prompt(5 * BLOCK + 1, seed=1), max_new_tokens=1)
    # content checked block by block: a stale or torn store fails here
    engine.run()
    stats = engine.scheduler.stats
    assert stats.flushed_jobs > 0
    # "a2" loaded what "a" computed and "b" evicted
    assert stats.hit_tokens > 0


def test_rewritten_blocks_are_never_stored_lazily():
    ledger = EvictionLedger()
    ledger.record(b"k1", 0, [1, 2], REQ_R, 0)
    ledger.record(b"k2", 0, [3, 4], REQ_R, 1)
    # block 2 handed to a new owner: chunk k1 is no longer whole
    ledger.forget([2])
    assert [e.key for e in ledger.take([1, 2, 3])] == [b"k2"]
    assert len(ledger) == 0


def test_ledger_takes_chunks_head_first_per_request():
    ledger = EvictionLedger()
    for chunk in range(3):
        ledger.record(bytes([chunk]), 0, [10 + chunk], REQ_A, chunk)
    ledger.record(b"x", 0, [20], REQ_B, 0)
    # an engine evicts tails first
    taken = ledger.take([12, 20, 11, 10])
    assert [(e.req_id, e.chunk) for e in taken] == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    ledger.restore(taken)
    assert len(ledger) == 4


def test_lazy_mode_reset_forgets_unstored_chunks():
    engine = make_engine(num_blocks=24, num_slots=16, store_mode="lazy", max_tokens_per_step=32)
    _cycle(engine, num_prompts=3, prompt_tokens=5 * BLOCK + 1, rounds=1)
    assert len(engine.scheduler._stores.ledger) > 0
    engine.scheduler.reset_cache()
    assert len(engine.scheduler._stores.ledger) == 0
    # still correct afterwards
    _cycle(engine, num_prompts=8, prompt_tokens=5 * BLOCK + 1, rounds=2)


def test_blocks_rewritten_before_they_were_reported_are_not_stored_under_their_old_chunk():
    """The engine hands blocks to a new request before they were ever reported evictable (a
    lookahead shorter than an admission): the chunk they held is gone, and what the new owner
    writes there (a request that stores nothing) must never be stored under the old chunk's key."""
    engine = make_engine(
        num_blocks=8, num_slots=16, store_mode="lazy", max_tokens_per_step=64, evict_lookahead=2
    )
    engine.add_request("a", prompt(5 * BLOCK + 1, seed=1), max_new_tokens=1)
    engine.run()
    engine.add_request(
        "b",
        prompt(6 * BLOCK + 1, seed=2),
        max_new_tokens=1,
        kv_transfer_params={"kvtier": {"store": False}},
    )
    engine.run()
    # small requests that store nothing push b's blocks to eviction: reported then
    for i in range(6):
        engine.add_request(
            f"c{i}",
            prompt(BLOCK + 1, seed=10 + i),
            max_new_tokens=1,
            kv_transfer_params={"kvtier": {"store": False}},
        )
        engine.run()
    engine.add_request("a2", prompt(5 * BLOCK + 1, seed=1), max_new_tokens=1)
    # a chunk of "a" loaded with "b"'s content fails the content check here
    engine.run()
    assert engine.scheduler.stats.lazy_offered_chunks > 0


def test_a_block_shared_by_two_chunks_drops_both_when_rewritten():
    ledger = EvictionLedger()
    # A's chunk 0
    ledger.record(b"a0", 0, [0, 1], REQ_A, 0)
    # B reused block 0 from the engine's cache: chunk 0 is [0, 3]
    ledger.record(b"b0", 0, [0, 3], REQ_B, 0)
    # block 0 goes to a new owner: neither chunk is whole any more
    ledger.forget([0])
    assert ledger.take([1, 3]) == []
    assert len(ledger) == 0


def test_a_shared_block_does_not_hide_the_other_chunk_that_holds_it():
    ledger = EvictionLedger()
    ledger.record(b"a0", 0, [0, 1], REQ_A, 0)
    ledger.record(b"b0", 0, [0, 3], REQ_B, 0)
    # B's own block rewritten: only B's chunk goes
    ledger.forget([3])
    # A's chunk is still found through block 0
    assert [e.key for e in ledger.take([0])] == [b"a0"]


def test_a_prefix_hit_ending_mid_chunk_never_stores_another_requests_kv():
    """Issue 20, defect 1. Two blocks per chunk: B reuses A's first block from the engine's cache, so
    A's chunk 0 is [A0, A1] and B's is [A0, B1] — two unstored chunks share block A0. The engine
    then hands A0 to an unrelated request: both chunks are gone. A's must not live on through A1
    and be stored later with the new owner's KV in its first half."""
    engine = make_engine(
        num_blocks=5,
        num_slots=16,
        blocks_per_chunk=2,
        store_mode="lazy",
        max_tokens_per_step=5,
        evict_lookahead=2,
    )
    a = [1, 2, 3, 4, 10, 11, 12, 13, 14]
    engine.add_request("a", a, max_new_tokens=1)
    # A computes its first block (A0) and one token of the next
    engine.step()
    engine.add_request("b", [1, 2, 3, 4, 20, 21, 22, 23, 24], max_new_tokens=1)
    # B's prefix hit is A0; both chunk 0s are recorded, unstored
    engine.run()
    # unrelated requests that store nothing take A0, then A1, from the engine's cache
    for i in range(2):
        engine.add_request(
            f"x{i}",
            prompt(5, seed=40 + i),
            max_new_tokens=1,
            kv_transfer_params={"kvtier": {"store": False}},
        )
        engine.run()
    engine.add_request("a2", a, max_new_tokens=1)
    # a chunk stored with the new owner's KV fails the content check here
    engine.run()
