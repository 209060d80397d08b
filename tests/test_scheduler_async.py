"""Asynchronous loads (`load_mode="async"`) driven step by step by the fake engine.

The engine parks a request whose load is asynchronous (vLLM's WAITING_FOR_REMOTE_KVS) and
runs it once the worker reports the load; its content checks catch a request that runs
before its blocks hold the right KV. Block size 4 tokens, chunks of one block.
"""

from __future__ import annotations

from sched_helpers import FakeClock, make_engine, prompt

# 5 blocks
P20 = prompt(20)
OTHER = prompt(12, seed=5)


def serve(engine, req_id, tokens, max_new_tokens=1):
    req = engine.add_request(req_id, tokens, max_new_tokens)
    engine.run()
    return req


def stored_then_forgotten(engine):
    """A computes P20 (chunks stored), then the engine's own cache is emptied."""
    serve(engine, "A", P20)
    engine.reset_prefix_cache()


def test_a_loading_request_is_parked_while_the_others_keep_stepping():
    engine = make_engine(load_mode="async")
    stored_then_forgotten(engine)
    # B's load runs for 3 steps
    engine.faults.load_delay_steps = 3
    b = engine.add_request("B", P20 + [7, 7, 7])
    c = engine.add_request("C", OTHER, max_new_tokens=6)
    # B is offered 20 tokens asynchronously: parked; C is prefilled
    engine.step()
    assert "B" in engine.parked and b.num_external_tokens == 20 and c.num_computed == 12
    # C decodes while B's load runs
    for _ in range(3):
        engine.step()
    assert len(c.output) >= 3 and b.output == []
    # B runs once its load is reported, on the loaded KV (checked)
    engine.run()
    assert b.is_finished and c.is_finished and not engine.parked
    assert engine.scheduler.stats.failed_load_chunks == 0


def test_a_failed_async_load_is_recomputed_and_not_offered_again():
    engine = make_engine(load_mode="async")
    stored_then_forgotten(engine)
    engine.faults.fail_load = lambda job: True
    b = serve(engine, "B", P20)
    # its blocks were reported invalid: recomputed from the first (content checked), and its
    # next lookup was answered with no load (a failing load is never retried forever)
    assert b.is_finished and engine.scheduler.stats.failed_load_chunks == 4
    assert engine.scheduler.stats.load_jobs == 1


def test_a_request_aborted_while_parked_keeps_its_blocks_until_the_load_ends():
    engine = make_engine(load_mode="async", num_blocks=12)
    stored_then_forgotten(engine)
    engine.faults.load_delay_steps = 2
    b = engine.add_request("B", P20)
    engine.step()
    assert "B" in engine.parked
    held = set(b.block_ids[0])
    # the load still writes into B's blocks
    engine.abort("B")
    c = engine.add_request("C", OTHER, max_new_tokens=2)
    # C must not get a block the load is writing
    engine.step()
    assert not held & set(c.block_ids[0])
    engine.run()
    assert c.is_finished and not engine.parked
    # every block of B (and C) came back
    assert not any(engine.pool.refs)


def test_an_async_load_slower_than_the_request_budget_is_cancelled_and_recomputed():
    clock = FakeClock()
    engine = make_engine(load_mode="async", clock=clock, max_defer_s=1.0, job_timeout_s=10.0)
    stored_then_forgotten(engine)
    # never starts
    engine.faults.load_delay_steps = 10**6
    b = engine.add_request("B", P20)
    engine.step()
    assert "B" in engine.parked
    (job,) = engine.transfer.loads[-1:]
    # the request's waiting budget, not job_timeout_s
    assert job.deadline <= clock.now + 1.0
    # past it: the worker cancels the load and reports the request
    clock.now += 1.5
    engine.run()
    assert b.is_finished and engine.scheduler.stats.failed_load_chunks == 4
