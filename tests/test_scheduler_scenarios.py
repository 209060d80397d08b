"""OffloadScheduler driven step by step by the fake engine (vLLM's protocol).

The fake engine checks, before computing any token, that every block the token
attends to holds the KV of exactly the right prefix: a wrong load, a missing fence
or a resurrected stale chunk raises ContentMismatch. Block size 4 tokens throughout.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from kvtier.base import LookupResult, ReqContext
from kvtier.jobs import StepPlan
from kvtier.scheduler import GroupKind, GroupSpec, RequestView, StepView
from sched_helpers import FakeClock, make_engine, prompt

# 5 blocks
P20 = prompt(20)


def view(req_id, like, num_tokens):
    """A request with `like`'s block hashes and `num_tokens` prompt tokens."""
    return RequestView(
        req_id=req_id,
        block_hashes=like.block_hashes,
        num_tokens=num_tokens,
        num_prompt_tokens=num_tokens,
    )


def serve(engine, req_id, tokens, max_new_tokens=1, **kw):
    req = engine.add_request(req_id, tokens, max_new_tokens, **kw)
    engine.run()
    return req


def test_reuse_comes_from_kvtier_after_the_engine_cache_is_emptied():
    engine = make_engine()
    # A computes 20 tokens → chunks 0..4 stored (5 whole chunks of 1 block)
    serve(engine, "A", P20)
    assert engine.scheduler.stats.stored_chunks == 5
    # the engine forgets its own cache; B repeats the prompt → loads 4 chunks (one token left to compute)
    engine.reset_prefix_cache()
    b = serve(engine, "B", P20 + [7, 7, 7])
    assert (b.num_cached_tokens, b.num_external_tokens) == (20, 20)
    assert len(engine.transfer.loads) == 1


def test_only_whole_chunks_are_stored():
    # chunks of 2 blocks (8 tokens); 21 tokens computed → chunks 0,1 (16 tokens), never the partial third
    engine = make_engine(blocks_per_chunk=2)
    a = serve(engine, "A", P20, max_new_tokens=2)
    assert engine.scheduler.stats.stored_chunks == 2
    ctx = ReqContext("probe")
    keys = [a.block_hashes[i] + b"\0\0\0\0" for i in (1, 3, 4)]
    assert [engine.scheduler.manager.lookup(k, ctx) for k in keys] == [
        LookupResult.HIT,
        LookupResult.HIT,
        LookupResult.MISS,
    ]


def test_a_hit_in_a_middle_chunk_loads_only_that_chunk():
    engine = make_engine()
    # chunks 0..4 in kvtier
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    # C re-computes the first 2 blocks only, so the engine's own cache holds chunks 0,1 again
    serve(engine, "C", P20[:8] + [1, 2, 3])
    # B (21 tokens): the engine serves chunks 0,1; kvtier loads chunks 2,3,4 only
    b = serve(engine, "B", P20 + [9])
    assert (b.num_cached_tokens, b.num_external_tokens) == (20, 12)
    load = engine.transfer.loads[-1]
    assert load.num_chunks == 3 and load.parts[0].skip_blocks == 0


def test_partial_local_hit_loads_the_rest_of_the_chunk_without_touching_the_local_blocks():
    # chunks of 2 blocks; the engine holds block 0 only → kvtier's chunk 0 is loaded without block 0
    engine = make_engine(blocks_per_chunk=2)
    # chunks 0,1 stored (16 tokens)
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    # the engine caches block 0 again
    serve(engine, "C", P20[:4] + [5])
    b = serve(engine, "B", P20)
    assert (b.num_cached_tokens, b.num_external_tokens) == (16, 12)
    assert engine.transfer.loads[-1].parts[0].skip_blocks == 1


def test_preemption_flushes_stores_and_the_request_reloads_later():
    engine = make_engine(max_tokens_per_step=8)
    # stores stay in flight for a while
    engine.faults.store_delay_steps = 5
    a = engine.add_request("A", P20, max_new_tokens=3)
    engine.step()
    # A computed 16 tokens: chunks 0..3 are being stored
    engine.step()
    assert engine.transfer.held_store_ids
    engine.preempt("A")
    engine.reset_prefix_cache()
    # the next step flushes A's stores before anything reuses its blocks...
    engine.step()
    assert engine.scheduler.stats.flushed_jobs >= 1 and not engine.transfer.held_store_ids
    # ...and A, re-admitted, loads what it had computed instead of recomputing it
    engine.run()
    assert engine.scheduler.stats.load_jobs == 1 and a.is_finished


def test_an_aborted_queued_request_stores_nothing():
    engine = make_engine()
    engine.add_request("A", P20)
    engine.abort("A")
    engine.run()
    s = engine.scheduler.manager.stats()
    assert (s.used_slots, engine.scheduler.stats.store_jobs) == (0, 0)
    assert engine.scheduler.request_state("A") is None


def test_two_requests_for_one_prefix_do_not_load_it_twice():
    engine = make_engine()
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    # B and C arrive together: B loads; C waits one step, then the engine's cache serves it
    b = engine.add_request("B", P20 + [1])
    c = engine.add_request("C", P20 + [2])
    engine.run()
    assert len(engine.transfer.loads) == 1
    assert (b.num_external_tokens, c.num_external_tokens) == (20, 0)
    assert c.num_cached_tokens == 20 and c.num_lookups == 2
    assert engine.scheduler.stats.deferrals == 1


def test_a_write_that_never_completes_stops_deferring_at_the_cap():
    engine = make_engine(max_deferrals=5, max_defer_s=3600)
    # every store stays PENDING forever
    engine.faults.stuck_stores = True
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    b = serve(engine, "B", P20)
    # asked 5 times "later", then once more: it proceeds without the pending chunks
    assert b.num_lookups == 6 and b.is_finished and b.num_external_tokens == 0
    assert engine.scheduler.stats.deferral_timeouts == 1


def test_a_write_that_never_completes_stops_deferring_at_the_deadline():
    clock = FakeClock()
    engine = make_engine(max_deferrals=10_000, max_defer_s=1.0, clock=clock)
    engine.faults.stuck_stores = True
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    b = engine.add_request("B", P20)
    for _ in range(1000):
        if b.is_finished:
            break
        clock.now += 0.1
        engine.step()
    assert b.is_finished and 10 <= b.num_lookups <= 12
    assert engine.scheduler.stats.deferral_timeouts == 1


def test_a_failed_load_is_recomputed():
    engine = make_engine()
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    engine.faults.fail_load = lambda job: True
    # B's load fails → its blocks are reported invalid → the engine recomputes them (no mismatch)
    b = serve(engine, "B", P20)
    assert b.is_finished and b.num_external_tokens == 16
    assert engine.scheduler.stats.failed_load_chunks == 4


def test_failed_load_reports_exactly_the_loaded_blocks():
    engine = make_engine()
    serve(engine, "A", P20)
    sched = engine.scheduler
    # local 1 block
    assert sched.get_num_new_matched_tokens(view("X", engine.requests["A"], 21), 4) == (
        16,
        False,
    )
    sched.update_state_after_alloc("X", ([30, 31, 32, 33, 34, 35],), 16)
    (job,) = sched.build_connector_meta(StepView()).load_jobs
    # the real worker gets the load with chunk 1's slot out of range: only that chunk fails
    (part,) = job.parts
    bad_part = dataclasses.replace(part, slot_ids=part.slot_ids + np.array([0, 10**6, 0, 0]))
    bad = dataclasses.replace(job, parts=(bad_part,))
    engine.worker.start_load_kv(StepPlan(load_jobs=[bad]))
    # the forward pass (the loads are copied layer by layer by now)
    for layer in engine.kv.tensors:
        engine.worker.wait_for_layer_load(layer)
    engine.worker.finish_layered_loads()
    assert engine.worker.take_load_errors() == {32}
    sched.update_connector_output(engine.worker.take_results())
    assert sched.stats.failed_load_chunks == 1 and not sched.has_jobs_in_flight()


def test_reset_cache_ignores_stale_completions():
    engine = make_engine()
    engine.faults.store_delay_steps = 3
    engine.add_request("A", P20, max_new_tokens=1)
    # A's chunks are being stored
    engine.step()
    assert engine.transfer.held_store_ids
    assert engine.scheduler.reset_cache()
    engine.run()
    for _ in range(4):
        # the stale stores complete
        engine.step()
    manager = engine.scheduler.manager
    assert engine.scheduler.stats.stale_completions >= 1
    assert manager.stats().used_slots == 0 and len(manager) == 0
    engine.reset_prefix_cache()
    assert serve(engine, "B", P20).num_external_tokens == 0
    manager.check()


def test_freed_blocks_with_a_store_in_flight_are_fenced():
    # 6 blocks only: B reuses A's freed blocks while A's delayed stores still read them
    engine = make_engine(num_blocks=6)
    engine.faults.store_delay_steps = 4
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    serve(engine, "B", prompt(20, seed=1))
    assert engine.scheduler.stats.flushed_jobs >= 1
    # A's chunks hold A's KV, not B's: reloading them passes the content checks
    engine.reset_prefix_cache()
    assert serve(engine, "A2", P20).num_external_tokens == 16


def test_full_attention_and_sliding_window_groups():
    groups = (
        GroupSpec(GroupKind.FULL, 4),
        GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8),
    )
    engine = make_engine(groups=groups, num_blocks=128)
    serve(engine, "A", prompt(40))
    engine.reset_prefix_cache()
    b = serve(engine, "B", prompt(40) + [3])
    assert b.num_external_tokens == 40
    full, window = engine.transfer.loads[-1].parts
    # the full-attention group loads all 10 chunks; the window group only chunks 8,9: token 40
    # attends to tokens 33..40
    assert (len(full.slot_ids), len(window.slot_ids)) == (10, 2)


def test_a_window_load_never_writes_the_blocks_the_engine_skipped():
    """Two blocks per chunk, a 12-token window: loading 16 tokens, the engine needs the window
    group's tokens 5..15 only, and points block 0 (tokens 0..3) at its null block (vLLM's
    sliding-window rule). kvtier's first window chunk still covers block 0: it must load
    blocks 1..3 only — before, it wrote that chunk's first half into the null block."""
    groups = (
        GroupSpec(GroupKind.FULL, 4, 2),
        GroupSpec(GroupKind.SLIDING_WINDOW, 4, 2, sliding_window=12),
    )
    engine = make_engine(groups=groups, num_blocks=64)
    serve(engine, "A", prompt(17))
    engine.reset_prefix_cache()
    # the fake engine checks the null block after every step
    b = serve(engine, "B", prompt(17) + [3])
    assert b.num_external_tokens == 16
    window = engine.transfer.loads[-1].parts[1]
    assert window.block_ids[0] == engine.pool.null_block and window.skip_blocks == 1


def test_a_window_store_never_reads_blocks_the_engine_freed():
    """The engine frees a window group's blocks once they leave the window, while it schedules the
    step, and may hand them to a request it admits in that same step (listed before the running
    ones, as vLLM's SchedulerOutput does, so no fence is planned for them yet; or to another group
    of the same request). A chunk not stored by then (no room in the CPU tier) must never be
    stored from such a block."""
    groups = (
        GroupSpec(GroupKind.FULL, 4, 2),
        GroupSpec(GroupKind.SLIDING_WINDOW, 4, 2, sliding_window=12),
    )
    engine = make_engine(groups=groups, num_blocks=24, num_slots=64, max_tokens_per_step=8)
    manager = engine.scheduler.manager
    real_prepare = manager.prepare_store
    # no room: A's store cursor stays at chunk 0
    manager.prepare_store = lambda keys, ctx: None
    engine.add_request("A", prompt(20), max_new_tokens=1)
    engine.step()
    # A computed 16 tokens; chunk 0 (blocks 0, 1) is still unstored
    engine.step()
    manager.prepare_store = real_prepare
    engine.add_request("X", prompt(9, seed=5), max_new_tokens=1)
    # A's window block 0 is freed and handed out again; A's chunks are stored now
    engine.step()
    engine.run()
    # the window group's chunk 0 had a freed block when it could be stored: it never was
    window_chunk_0 = engine.requests["A"].block_hashes[1] + b"\0\0\0\1"
    assert engine.scheduler.manager.lookup(window_chunk_0, ReqContext("x")) is LookupResult.MISS
    engine.reset_prefix_cache()
    # a request on A's first chunk: what was stored is checked
    serve(engine, "A2", prompt(20)[:8] + [1])


def test_a_window_load_covers_the_tokens_the_engine_retains_before_the_window():
    """vLLM keeps `extra_retained_tokens` before a window (multi-token-prediction drafts re-prefill
    them) and counts them computed: kvtier must load them too (found in review: it assumed the bare
    window, so vLLM kept a block nobody loaded). Window 8 + 4 retained tokens, loading 16 tokens:
    blocks 1..3 are the engine's, block 0 its null block."""
    window = GroupSpec(GroupKind.SLIDING_WINDOW, 4, 2, sliding_window=8, extra_retained_tokens=4)
    assert (window.num_skipped_blocks(16), window.first_needed_chunk(2)) == (1, 0)
    engine = make_engine(groups=(GroupSpec(GroupKind.FULL, 4, 2), window), num_blocks=64)
    serve(engine, "A", prompt(17))
    engine.reset_prefix_cache()
    assert serve(engine, "B", prompt(17) + [3]).num_external_tokens == 16
    part = engine.transfer.loads[-1].parts[1]
    # chunk 0 from its block 1, and chunk 1
    assert part.skip_blocks == 1 and len(part.block_ids) == 4


def test_sliding_window_suffix_scan_lowers_the_boundary():
    groups = (
        GroupSpec(GroupKind.FULL, 4),
        GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8),
    )
    engine = make_engine(groups=groups, num_blocks=128)
    a = serve(engine, "A", prompt(40))
    sched, ctx = engine.scheduler, ReqContext("x")
    # drop the window group's chunk 8: boundaries 10 and 9 need it, boundary 8 needs chunks 5..7 only
    sched.manager.reset()
    full_keys = [h + b"\0\0\0\0" for h in a.block_hashes[:10]]
    window_keys = [h + b"\0\0\0\1" for h in a.block_hashes[:10]]
    out = sched.manager.prepare_store(full_keys + window_keys[:8] + window_keys[9:], ctx)
    sched.manager.complete_store(out.keys_to_store, ctx)
    assert sched.get_num_new_matched_tokens(view("B", a, 41), 0) == (32, False)


def test_an_unsupported_group_gets_no_hits():
    groups = (GroupSpec(GroupKind.FULL, 4), GroupSpec(GroupKind.UNSUPPORTED, 4))
    engine = make_engine(groups=groups, num_blocks=128)
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    assert serve(engine, "B", P20).num_external_tokens == 0


@pytest.mark.parametrize("prompt_only, expected", [(True, 2), (False, 4)])
def test_offload_prompt_only(prompt_only, expected):
    engine = make_engine(offload_prompt_only=prompt_only)
    # 8 prompt tokens, 17 computed at the end
    serve(engine, "A", prompt(8), max_new_tokens=10)
    assert engine.scheduler.stats.stored_chunks == expected


@pytest.mark.parametrize(
    "params", ["garbage", 5, {"kvtier": 5}, {"kvtier": {"load": "yes", "bogus": 1}}]
)
def test_malformed_kv_transfer_params_are_ignored_with_a_warning(params, caplog):
    engine = make_engine()
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    with caplog.at_level(logging.WARNING, logger="kvtier.scheduler.params"):
        b = serve(engine, "B", P20, kv_transfer_params=params)
    assert b.num_external_tokens == 16
    assert caplog.records and all(r.levelno == logging.WARNING for r in caplog.records)


def test_kv_transfer_params_can_turn_loading_and_storing_off():
    engine = make_engine()
    serve(engine, "A", P20, kv_transfer_params={"kvtier": {"store": False}})
    assert engine.scheduler.stats.store_jobs == 0
    serve(engine, "A2", P20)
    engine.reset_prefix_cache()
    assert (
        serve(engine, "B", P20, kv_transfer_params={"kvtier": {"load": False}}).num_external_tokens
        == 0
    )


@pytest.mark.parametrize("cap, loaded", [(0, 0), (3, 0), (4, 4), (11, 8), (16, 16), (1000, 16)])
def test_max_load_tokens_caps_what_a_request_loads_to_whole_chunks(cap, loaded):
    engine = make_engine()
    a = serve(engine, "A", P20)
    engine.reset_prefix_cache()
    b = serve(engine, "B", P20, kv_transfer_params={"kvtier": {"max_load_tokens": cap}})
    # the rest recomputed, the same tokens
    assert b.num_external_tokens == loaded and b.output == a.output


def test_max_load_tokens_counts_after_the_engines_own_hits():
    engine = make_engine()
    a = serve(engine, "A", P20)
    engine.reset_prefix_cache()
    # the engine's cache now holds P20's first 2 chunks
    serve(engine, "W", P20[:8] + prompt(12, seed=3))
    b = serve(engine, "B", P20, kv_transfer_params={"kvtier": {"max_load_tokens": 4}})
    assert (b.num_cached_tokens - b.num_external_tokens, b.num_external_tokens) == (
        8,
        4,
    ) and b.output == a.output


def test_requests_are_forgotten_and_manager_is_told_once():
    engine = make_engine()
    finished = []
    original = engine.scheduler.manager.on_request_finished
    engine.scheduler.manager.on_request_finished = lambda ctx: (
        finished.append(ctx.req_id),
        original(ctx),
    )
    engine.faults.store_delay_steps = 2
    serve(engine, "A", P20, max_new_tokens=4)
    for _ in range(3):
        engine.step()
    assert finished == ["A"] and engine.scheduler.request_state("A") is None
    assert not engine.scheduler.has_jobs_in_flight()


def test_an_event_observer_that_raises_never_fails_a_step_and_chunks_are_still_stored(caplog):
    """The store observer describes chunks for KV events (vLLM's publisher); if describing fails, the
    step goes on, the chunks are stored and reused, and the observer is dropped (events by hash alone)."""
    engine = make_engine()
    calls = []

    def observer(req, ctx, keys, chunks):
        calls.append(len(keys))
        raise RuntimeError("describing failed")

    engine.scheduler.store_observer = observer
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        serve(engine, "A", P20)
        engine.reset_prefix_cache()
        b = serve(engine, "B", P20 + [7, 7, 7])
    # called once, then dropped
    assert calls == [calls[0]] and engine.scheduler.store_observer is None
    # A's chunks were stored and loaded
    assert b.num_external_tokens > 0
    assert "describing chunks for KV events failed" in caplog.text
