"""The job path on the real worker (`WorkerSide` + `TransferEngine` on small CPU tensors):
flush order, stores after a load, the recompute paths, job deadlines, honest counters.

Each test names the defect of issue #8 it pins down. Block size 4 tokens, 1 block per chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import numpy as np
import pytest

from helpers import HANG_S
from kvtier.base import LookupResult, ReqContext
from kvtier.errors import ConfigError, NotReadyError
from kvtier.jobs import Endpoint, JobResult, StepPlan, TransferJob, TransferPart, check_slab_slots
from kvtier.scheduler import (
    GroupKind,
    GroupSpec,
    OffloadScheduler,
    RequestView,
    ScheduledRequest,
    SchedulerOffloadConfig,
    StepView,
)
from kvtier.sim import KVCache
from kvtier.sim.faults import Faults, SimTransferEngine
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.worker import WorkerSide
from sched_helpers import FakeClock, close_after_test, make_engine, prompt

# 5 blocks
P20 = prompt(20)
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def serve(engine, req_id, tokens, max_new_tokens=1, **kw):
    req = engine.add_request(req_id, tokens, max_new_tokens, **kw)
    engine.run()
    return req


def view(req_id: str, hashes, num_tokens: int) -> RequestView:
    return RequestView(
        req_id=req_id, block_hashes=hashes, num_tokens=num_tokens, num_prompt_tokens=num_tokens
    )


# -- defect 1: flush order, and the stores of a request that ends in its load step ---------


def test_a_finished_requests_last_stores_hold_its_kv_when_its_blocks_are_reused_at_once():
    engine = make_engine(num_blocks=8)
    # chunks 0..4 stored
    serve(engine, "A0", P20)
    engine.reset_prefix_cache()
    # A loads chunks 0..4, computes chunks 5, 6 and ends in that same step (1 new token)
    a_prompt = P20 + prompt(8, seed=3)
    assert serve(engine, "A", a_prompt).num_external_tokens == 20
    # B (7 blocks of 8) gets A's freed blocks in the next step: A's last store is flushed first
    serve(engine, "B", prompt(28, seed=5))
    assert engine.scheduler.stats.flushed_jobs >= 1
    engine.reset_prefix_cache()
    # all seven of A's chunks come back, and hold A's KV (the engine checks every block)
    assert serve(engine, "A2", a_prompt + [1]).num_external_tokens == 28


def one_worker(num_blocks: int = 8, num_slots: int = 4) -> tuple[KVCache, WorkerSide]:
    kv = KVCache(num_groups=1, num_blocks=num_blocks, block_size=4)
    worker = WorkerSide(num_slots=num_slots, blocks_per_chunk=1, layer_groups=kv.layer_groups)
    worker.register_kv_caches(kv.tensors)
    return kv, close_after_test(worker)


def job(
    job_id: int, src: Endpoint, slots: list[int], blocks: list[int], deadline: float | None = None
) -> TransferJob:
    part = TransferPart(group=0, slot_ids=np.array(slots), block_ids=np.array(blocks))
    dst = Endpoint.SLAB if src is Endpoint.ENGINE else Endpoint.ENGINE
    deadline = time.monotonic() + 60 if deadline is None else deadline
    return TransferJob(
        job_id=job_id, req_id="r", src=src, dst=dst, parts=(part,), deadline=deadline
    )


def run_plan(worker: WorkerSide, plan: StepPlan, forward=lambda: None) -> None:
    worker.handle_preemptions(plan)
    worker.start_load_kv(plan)
    forward()
    worker.wait_for_save(plan)


def test_a_store_the_plan_flushes_copies_its_blocks_before_the_forward_pass_rewrites_them():
    kv, worker = one_worker()
    old, new = kv.content(b"old owner", 0), kv.content(b"new owner", 0)
    kv.write(0, [3], [old])
    # the plan stores block 3 (its old owner's KV) and hands block 3 to a new request
    store = job(1, Endpoint.ENGINE, slots=[0], blocks=[3])
    run_plan(
        worker,
        StepPlan(store_jobs=[store], flush_job_ids={1}),
        forward=lambda: kv.write(0, [3], [new]),
    )
    assert worker.transfer.wait([1], timeout=HANG_S)
    # slot 0 holds the old owner's KV: load it into block 5 and check
    run_plan(worker, StepPlan(load_jobs=[job(2, Endpoint.SLAB, slots=[0], blocks=[5])]))
    kv.check("r", 0, [0], [5], [old])
    assert sorted((r.job_id, r.success) for r in worker.take_results()) == [(1, True), (2, True)]


# -- defect 2: the recompute paths --------------------------------------------------------


def test_the_engine_taking_fewer_external_tokens_than_offered_recomputes_them():
    engine = make_engine()
    a = serve(engine, "A", P20)
    sched = engine.scheduler
    assert sched.get_num_new_matched_tokens(view("X", a.block_hashes, 21), 0) == (20, False)
    # the engine took 8 of 20
    sched.update_state_after_alloc("X", ([30, 31, 32, 33, 34, 35],), 8)
    plan = sched.build_connector_meta(StepView())
    # no load; the blocks of every offered token are reported failed, so the engine recomputes them
    assert not plan.load_jobs and plan.failed_load_block_ids == {30, 31, 32, 33, 34}
    assert sched.stats.hit_tokens == 0


def test_prepare_load_failing_recomputes_the_blocks(monkeypatch, caplog):
    engine = make_engine()
    serve(engine, "A", P20)
    engine.reset_prefix_cache()

    def gone(keys, ctx):
        raise NotReadyError("evicted between lookup and load")

    monkeypatch.setattr(engine.scheduler.manager, "prepare_load", gone)
    with caplog.at_level(logging.WARNING, logger="kvtier.scheduler.core"):
        # the engine recomputes what kvtier offered: its checks pass
        b = serve(engine, "B", P20)
    assert b.is_finished and engine.scheduler.stats.load_prepare_failures == 1
    assert "will be recomputed" in caplog.text


# -- defect 3: every job has a deadline -----------------------------------------------------


class TwoWorkers:
    """A scheduler and two real workers (two tensor-parallel ranks), each with its own KV and slab."""

    def __init__(self, clock: FakeClock, job_timeout_s: float = 1.0):
        config = SchedulerOffloadConfig(
            groups=(GroupSpec(tokens_per_block=4),), num_workers=2, job_timeout_s=job_timeout_s
        )
        self.clock = clock
        self.sched = OffloadScheduler(config, CPUTierManager(8), clock=clock)
        self.ranks = [one_worker(num_blocks=16, num_slots=8) for _ in range(2)]
        # a 4-block prompt
        self.hashes = [bytes([i]) * 32 for i in range(1, 5)]

    def step(
        self, scheduled: list[ScheduledRequest], deliver=(True, True), compute: list[int] = ()
    ):
        """One engine step; rank i's results reach the scheduler only if deliver[i]."""
        plan = self.sched.build_connector_meta(StepView(scheduled))
        results = []
        for (kv, worker), delivered in zip(self.ranks, deliver, strict=True):
            contents = [kv.content(self.hashes[j], 0) for j in range(len(compute))]
            run_plan(
                worker,
                plan,
                forward=lambda kv=kv, contents=contents: kv.write(0, list(compute), contents),
            )
            assert worker.transfer.wait([j.job_id for j in plan.store_jobs], timeout=HANG_S)
            taken = worker.take_results()
            results += taken if delivered else []
        self.sched.update_connector_output(results)
        return plan

    def store_prefix(self, deliver=(True, True)) -> None:
        """Request S computes the 4 blocks (engine blocks 0..3) and stores them."""
        sched = self.sched
        assert sched.get_num_new_matched_tokens(view("S", self.hashes, 17), 0) == (0, False)
        sched.update_state_after_alloc("S", ([0, 1, 2, 3, 4],), 0)
        self.step(
            [
                ScheduledRequest(
                    req_id="S",
                    new_block_ids=([0, 1, 2, 3, 4],),
                    is_new_or_resumed=True,
                    num_computed_tokens=0,
                    num_scheduled_tokens=17,
                )
            ],
            deliver,
            compute=[0, 1, 2, 3],
        )
        sched.request_finished(view("S", self.hashes, 18))

    def lookups(self) -> list[LookupResult]:
        ctx = ReqContext("probe")
        return [self.sched.manager.lookup(h + b"\0\0\0\0", ctx) for h in self.hashes]


def test_a_store_one_worker_never_reports_is_failed_at_its_expiry():
    clock = FakeClock()
    w = TwoWorkers(clock)
    # rank 1's report is lost
    w.store_prefix(deliver=(True, False))
    assert w.lookups() == [PENDING] * 4 and w.sched.has_jobs_in_flight()
    # past the workers' deadline (1 s), not yet past the scheduler's expiry (2 s)
    clock.now = 1.9
    w.step([])
    assert w.lookups() == [PENDING] * 4
    clock.now = 2.0
    # the scheduler fails the job: the chunks are rolled back, nothing waits for them
    w.step([])
    assert w.lookups() == [MISS] * 4 and not w.sched.has_jobs_in_flight()
    assert w.sched.stats.expired_jobs == 1 and w.sched.manager.stats().used_slots == 0
    # a request on that prefix gets its answer at once: no deferral
    assert w.sched.get_num_new_matched_tokens(view("T", w.hashes, 17), 0) == (0, False)
    assert w.sched.stats.deferrals == 0
    w.sched.manager.check()


def test_an_expired_stores_slots_are_freed_only_after_the_workers_ran_the_step_that_cancels_it():
    """Issue 20, S1: the scheduler expires a job when it plans a step; a worker still copying it
    stops only when it runs that step (`handle_preemptions` cancels every job past its deadline).
    Its slots must not be free in between: a promotion (on the scheduler's own tier threads)
    could write them while the late copy still does."""
    clock = FakeClock()
    w = TwoWorkers(clock)
    w.store_prefix(deliver=(True, False))
    clock.now = 2.0
    # the job is failed here ...
    w.sched.build_connector_meta(StepView([]))
    assert w.sched.stats.expired_jobs == 1
    # ... but its slots are still held
    assert w.sched.manager.stats().used_slots == 4
    # the workers ran the step: now they are free
    w.sched.update_connector_output([])
    assert w.sched.manager.stats().used_slots == 0 and not w.sched.has_jobs_in_flight()
    w.sched.manager.check()


def test_a_request_preempted_in_the_step_its_store_expires_does_not_break_the_step():
    """Found by the stack fuzzer: a job expired while the step is planned is failed, and released
    only at the step's output; a preemption of its request in the same step must not look it up."""
    clock = FakeClock()
    w = TwoWorkers(clock)
    sched = w.sched
    assert sched.get_num_new_matched_tokens(view("S", w.hashes, 17), 0) == (0, False)
    sched.update_state_after_alloc("S", ([0, 1, 2, 3, 4],), 0)
    # S's store: rank 1's report is lost
    w.step(
        [
            ScheduledRequest(
                req_id="S",
                new_block_ids=([0, 1, 2, 3, 4],),
                is_new_or_resumed=True,
                num_computed_tokens=0,
                num_scheduled_tokens=16,
            )
        ],
        deliver=(True, False),
        compute=[0, 1, 2, 3],
    )
    # the store expires in the next plan, which also reports S preempted
    clock.now = 2.0
    plan = sched.build_connector_meta(StepView([], preempted_req_ids={"S"}))
    assert sched.stats.expired_jobs == 1 and not plan.flush_job_ids
    sched.update_connector_output([])
    assert sched.manager.stats().used_slots == 0
    sched.manager.check()


def test_a_late_report_of_an_expired_store_is_ignored():
    clock = FakeClock()
    w = TwoWorkers(clock)
    w.store_prefix(deliver=(True, False))
    clock.now = 2.0
    w.step([])
    assert w.lookups() == [MISS] * 4
    # the lost report turns up (a successful one): still nothing is readable, nothing breaks
    w.sched.update_connector_output([JobResult(job_id=1)])
    assert w.lookups() == [MISS] * 4 and w.sched.stats.stored_chunks == 0
    w.sched.manager.check()


def test_a_load_one_worker_never_reports_is_recomputed_and_releases_its_chunks():
    clock = FakeClock()
    w = TwoWorkers(clock)
    w.store_prefix()
    assert w.lookups() == [HIT] * 4
    # X loads the 4 chunks into blocks 8..11; rank 1's report is lost
    assert w.sched.get_num_new_matched_tokens(view("X", w.hashes, 17), 0) == (16, False)
    w.sched.update_state_after_alloc("X", ([8, 9, 10, 11, 12],), 16)
    x = ScheduledRequest(
        req_id="X",
        new_block_ids=([8, 9, 10, 11, 12],),
        is_new_or_resumed=True,
        num_computed_tokens=16,
        num_scheduled_tokens=1,
    )
    w.step([x], deliver=(True, False))
    assert w.sched.manager.stats().pinned_slots == 4
    clock.now = 2.5
    plan = w.step([])
    # failed by the scheduler: X's loaded blocks are recomputed, the pins released
    assert plan.failed_load_block_ids == {8, 9, 10, 11}
    assert w.sched.manager.stats().pinned_slots == 0 and w.sched.stats.expired_jobs == 1
    # another request on the prefix is not held back by a load that ended
    assert w.sched.get_num_new_matched_tokens(view("Y", w.hashes, 17), 0) == (16, False)


def test_a_stuck_store_that_must_be_flushed_is_cancelled_at_its_deadline():
    clock = FakeClock()
    engine = make_engine(num_blocks=6, clock=clock, job_timeout_s=1.0)
    # stores never start: a flush waits until their deadline
    engine.faults.stuck_stores = True
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    # B reuses A's blocks: A's store is flushed, does not end by its deadline, and is cancelled
    serve(engine, "B", prompt(20, seed=1))
    assert engine.worker.take_stats().get("cancelled_jobs", 0) >= 1
    stats = engine.scheduler.stats
    assert stats.flushed_jobs >= 1 and stats.failed_store_chunks == 5 and stats.stored_chunks == 0
    # nothing of A's is readable: its store was rolled back, not half written
    engine.reset_prefix_cache()
    engine.faults.stuck_stores = False
    assert serve(engine, "A2", P20).num_external_tokens == 0
    engine.scheduler.manager.check()


# -- defect 4: counters that tell the truth ------------------------------------------------


def test_hits_are_counted_once_per_admission_not_per_question():
    engine = make_engine()
    a = serve(engine, "A", P20)
    sched = engine.scheduler
    # A
    assert (sched.stats.requests, sched.stats.query_tokens, sched.stats.hit_tokens) == (
        1,
        19,
        0,
    )
    # vLLM re-asks a waiting request every step it cannot schedule it
    for _ in range(3):
        assert sched.get_num_new_matched_tokens(view("X", a.block_hashes, 21), 0) == (20, False)
    assert (sched.stats.requests, sched.stats.query_tokens, sched.stats.hit_tokens) == (1, 19, 0)
    # admitted: counted once
    sched.update_state_after_alloc("X", ([30, 31, 32, 33, 34, 35],), 20)
    assert (sched.stats.requests, sched.stats.query_tokens, sched.stats.hit_tokens) == (
        2,
        19 + 20,
        20,
    )


def test_exact_counts_with_a_deferred_request():
    engine = make_engine()
    # asks for 19 tokens, gets none
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    # loads 20
    engine.add_request("B", P20 + [1])
    # waits one step, then the engine's own cache serves 20
    engine.add_request("C", P20 + [2])
    engine.run()
    s = engine.scheduler.stats
    assert (s.requests, s.query_tokens, s.hit_tokens, s.local_hit_tokens, s.deferrals) == (
        3,
        19 + 20,
        20,
        20,
        1,
    )


# -- defect 5: a group kind kvtier cannot serve says so -------------------------------------


def test_an_unsupported_group_is_named_at_start_and_stores_nothing(caplog):
    groups = (
        GroupSpec(GroupKind.FULL, 4),
        GroupSpec(GroupKind.UNSUPPORTED, 4, reason="MambaSpec (layers ['m.0'])"),
    )
    with caplog.at_level(logging.WARNING, logger="kvtier.scheduler.core"):
        engine = make_engine(groups=groups, num_blocks=128)
    assert "KV-cache group 1 cannot be offloaded (MambaSpec (layers ['m.0']))" in caplog.text
    assert engine.scheduler.config.unsupported_groups() == [1]
    serve(engine, "A", P20)
    engine.reset_prefix_cache()
    assert serve(engine, "B", P20).num_external_tokens == 0
    # nothing stored that could never be loaded
    assert engine.scheduler.stats.store_jobs == 0


# -- defect 6: the workers' slabs agree with the scheduler ----------------------------------


def test_a_worker_slab_of_another_size_stops_the_engine_with_a_clear_error():
    check_slab_slots(64, [64, 64])
    with pytest.raises(
        ConfigError, match="a worker's host slab has 32 slots where the scheduler counts 64"
    ):
        check_slab_slots(64, [64, 32])


def test_a_plan_survives_pickling_to_the_workers():
    """vLLM pickles each step's plan to the worker processes (parts travel as raw int64 bytes)."""
    import pickle

    part = TransferPart(
        group=1,
        slot_ids=np.array([3, 1], np.int64),
        block_ids=np.array([7, 8, 9, 10]),
        skip_blocks=1,
    )
    plan = StepPlan(store_jobs=[job(5, Endpoint.ENGINE, [3, 1], [7, 8])], flush_job_ids={2})
    plan.load_jobs.append(dataclasses.replace(plan.store_jobs[0], job_id=6, parts=(part,)))
    back = pickle.loads(pickle.dumps(plan))
    got = back.load_jobs[0].parts[0]
    assert (got.group, got.slot_ids.tolist(), got.block_ids.tolist(), got.skip_blocks) == (
        1,
        [3, 1],
        [7, 8, 9, 10],
        1,
    )
    assert got.slot_ids.dtype == np.int64 and got.slot_ids.flags.writeable
    assert back.store_jobs[0].parts[0].block_ids.tolist() == [7, 8] and back.flush_job_ids == {2}


@pytest.mark.parametrize("idle", [True, False])
def test_a_step_that_computes_nothing_waits_a_little_for_its_asynchronous_loads(idle, monkeypatch):
    """vLLM asks for finished loads right after start_load_kv in a step with nothing to compute;
    reporting them then saves the engine empty round trips before the parked request runs."""
    # the wait returns when the load ends; its 50 ms was too little for a loaded machine's copy
    # thread to wake. Without the wait the held load never starts, so that still fails.
    monkeypatch.setattr("kvtier.worker.side.IDLE_STEP_WAIT_S", 30.0)
    kv = KVCache(num_groups=1, num_blocks=8, block_size=4)
    # loads held back until the step ends, unless a wait starts them (the simulator's slow device)
    slow = functools.partial(SimTransferEngine, faults=Faults(load_delay_steps=1))
    worker = close_after_test(
        WorkerSide(
            num_slots=4, blocks_per_chunk=1, layer_groups=kv.layer_groups, transfer_factory=slow
        )
    )
    worker.register_kv_caches(kv.tensors)
    load = job(1, Endpoint.SLAB, [0, 1], [2, 3])
    plan = StepPlan(async_load_jobs=[load], engine_idle=idle)
    worker.handle_preemptions(plan)
    worker.start_load_kv(plan)
    finished, failed = worker.take_finished_loads()
    assert finished == ({"r"} if idle else set()) and not failed
    # reported by a later step's poll instead
    if not idle:
        # the load is due one step later
        for _ in range(2):
            worker.transfer.end_step()
        assert worker.take_finished_loads()[0] == {"r"}
