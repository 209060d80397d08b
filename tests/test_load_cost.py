"""Load or recompute under the scheduler protocol: the fake engine drives the real
OffloadScheduler, a TieredManager (a 4-slot CPU tier in shared memory, a real disk tier) and
the real worker, with the cost model's figures fixed (`OffloadScheduler(costs=...)`, as the
simulator runs it) so each test says how fast the disk is against recomputing. The fake engine
checks every block a token attends to: a loaded head with the wrong bytes raises.

Block size 4 tokens, chunks of 1 block.
"""

from __future__ import annotations

from helpers import HANG_S
from kvtier.costmodel import CostSnapshot, ReadEstimate
from kvtier.keys import make_offload_key
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import FakeEngine, KVCache
from kvtier.sim.fake_engine import SimRequest, make_slab
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.tiered import TieredManager
from sched_helpers import UNBOUNDED_DEFERRALS, FakeClock, close_after_test, prompt, run_until_done
from test_tiered_scheduler import _ClosesTiers, serve, settle

NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS = 32, 4, 4
FAST_RAM = ReadEstimate(1e10, 0.0)
SLOW_DISK = CostSnapshot(
    {"cpu": FAST_RAM, "disk": ReadEstimate(1e3, 0.01)}, prefill_tokens_per_s=1e4
)
FAST_DISK = CostSnapshot(
    {"cpu": FAST_RAM, "disk": ReadEstimate(1e10, 0.0)}, prefill_tokens_per_s=1e3
)


def engine_with(tmp_path, costs: CostSnapshot, policy: str = "cost") -> FakeEngine:
    slab = make_slab(KVCache(1, NUM_BLOCKS, BLOCK_SIZE), 1, NUM_SLOTS)
    namespace = Namespace("sim", "float32", "sim", BLOCK_SIZE, 1, "sha256", 1, slab.rows.shape[1])
    disk = DiskTier(tmp_path, namespace, 64 * (slab.rows.shape[1] + 4096))
    assert disk.wait_scanned(HANG_S)
    manager = TieredManager(
        CPUTierManager(NUM_SLOTS), [slab.rows], [(disk, TierRules())], job_timeout_s=HANG_S
    )
    clock = FakeClock()
    config = SchedulerOffloadConfig(
        groups=(GroupSpec(tokens_per_block=BLOCK_SIZE),),
        max_defer_s=60.0,
        max_deferrals=UNBOUNDED_DEFERRALS,
        load_policy=policy,
        chunk_bytes=slab.rows.shape[1],
    )
    engine = FakeEngine(
        OffloadScheduler(config, manager, clock=clock, costs=costs),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        clock=clock,
        slab=slab,
    )
    return close_after_test(_ClosesTiers(engine, manager))


def only_on_disk(engine, p: list[int]) -> None:
    """Serve `p`, then push its chunks out of the 4-slot RAM tier: they are on disk only."""
    serve(engine, "p", p)
    settle(engine)
    for i in range(2):
        serve(engine, f"filler-{i}", prompt(12, seed=40 + i))
        settle(engine)
    engine.reset_prefix_cache()


def decisions(engine) -> dict:
    return dict(engine.scheduler.stats.load_decisions)


def promotions(engine) -> int:
    return engine.manager.tier_stats()[0].counters["promotions"]


def test_a_prefix_only_on_a_slow_disk_is_recomputed_and_never_read(tmp_path):
    engine = engine_with(tmp_path, SLOW_DISK)
    p = prompt(12, seed=1)
    only_on_disk(engine, p)
    # p comes back: its 3 chunks are on a disk that reads 1 kB/s, recomputing 12 tokens takes 1.2 ms
    req = serve(engine, "p-again", p + [7])
    assert req.num_external_tokens == 0
    assert decisions(engine) == {("recompute", "disk"): 1}
    # no read started for chunks the request recomputes
    assert promotions(engine) == 0
    engine.manager.check()


def test_with_load_policy_always_the_same_prefix_is_read_from_the_slow_disk(tmp_path):
    engine = engine_with(tmp_path, SLOW_DISK, policy="always")
    p = prompt(12, seed=1)
    only_on_disk(engine, p)
    req = serve(engine, "p-again", p + [7])
    # every chunk promoted and loaded (the fake engine checked them)
    assert req.num_external_tokens == 12
    assert decisions(engine) == {("load", "disk"): 1}
    assert promotions(engine) == 3


def test_a_fast_disk_is_loaded_from(tmp_path):
    engine = engine_with(tmp_path, FAST_DISK)
    p = prompt(12, seed=1)
    only_on_disk(engine, p)
    # the disk reads 10 GB/s, the engine prefills 1,000 tokens/s: loading wins
    req = serve(engine, "p-again", p + [7])
    assert req.num_external_tokens == 12
    assert decisions(engine) == {("load", "disk"): 1}


def test_a_head_in_ram_and_a_tail_on_a_slow_disk_loads_exactly_the_head(tmp_path):
    engine = engine_with(tmp_path, SLOW_DISK)
    head, tail = prompt(8, seed=2), prompt(8, seed=3)
    # head + tail is served once (4 chunks, all written through to disk), then the head alone
    # more recently: RAM keeps the head's 2 chunks, the tail's are pushed out by a filler
    serve(engine, "whole", head + tail)
    settle(engine)
    serve(engine, "filler", prompt(8, seed=41))
    settle(engine)
    engine.reset_prefix_cache()
    serve(engine, "head", head + [5])
    settle(engine)
    assert [engine.manager.primary.place(k) for k in _keys(engine, "head", 2)] == ["cpu", "cpu"]
    engine.reset_prefix_cache()
    # the whole prefix again: the head comes from RAM, the tail is recomputed (not read from disk)
    req = serve(engine, "whole-again", head + tail + [9])
    assert req.num_external_tokens == 8
    assert decisions(engine)[("partial", "disk")] == 1
    assert promotions(engine) == 0


def test_the_request_cap_bounds_what_the_cost_model_would_load(tmp_path):
    engine = engine_with(tmp_path, FAST_DISK)
    p = prompt(12, seed=1)
    only_on_disk(engine, p)
    req = engine.add_request(
        "capped", p + [7], 1, kv_transfer_params={"kvtier": {"max_load_tokens": 4}}
    )
    run_until_done(engine)
    assert req.num_external_tokens == 4
    # only the chunk it may load is read up
    assert promotions(engine) == 1


def test_a_request_decides_once_while_its_promotions_run(tmp_path):
    engine = engine_with(tmp_path, FAST_DISK)
    p = prompt(12, seed=1)
    only_on_disk(engine, p)
    req = serve(engine, "p-again", p + [7])
    # it was asked again while its 3 chunks came up from disk, and kept its first decision
    assert engine.scheduler.stats.deferrals > 0
    assert sum(decisions(engine).values()) == 1 and req.num_external_tokens == 12
    # the load's expected and measured seconds were added
    assert engine.scheduler.stats.timed_loads == 1


def test_the_tiered_manager_measures_its_tiers_from_their_jobs(tmp_path):
    engine = engine_with(tmp_path, FAST_DISK)
    before = engine.manager.read_estimates()["disk"]
    # the prior
    assert before.num_samples == 0
    # write-through stores of 3 requests' chunks: the disk's read estimate stands on its writes
    for i in range(3):
        serve(engine, f"w-{i}", prompt(12, seed=50 + i))
        settle(engine)
    # applies the finished jobs
    engine.manager.stats()
    assert engine.manager.read_estimates()["disk"].num_samples >= 3


def _keys(engine, req_id: str, num_chunks: int):
    return [make_offload_key(h, 0) for h in engine.requests[req_id].block_hashes[:num_chunks]]


def test_a_decision_is_not_reused_once_answered(tmp_path):
    """Review finding F1: a request asked, answered, then not admitted (vLLM could not allocate its
    blocks) is asked again later; by then its prefix moved from RAM to a slow disk."""
    engine = engine_with(tmp_path, SLOW_DISK)
    p = prompt(12, seed=1)
    serve(engine, "p", p)
    settle(engine)
    engine.reset_prefix_cache()
    q = SimRequest("q", p + [7], 1)
    q.block_hashes = engine.hasher.hash_blocks(q.prompt)
    # ask 1: p's 3 chunks are in RAM: load them all
    assert engine.scheduler.get_num_new_matched_tokens(q.view(), 0) == (12, False)
    # q is not admitted; two fillers push p's chunks out of the 4-slot RAM tier, onto the slow disk
    for i in range(2):
        serve(engine, f"filler-{i}", prompt(12, seed=40 + i))
        settle(engine)
    # ask 2 decides afresh: recompute (a reused decision would promote from the 1 kB/s disk and wait)
    assert engine.scheduler.get_num_new_matched_tokens(q.view(), 0) == (0, False)
    assert decisions(engine) == {("load", "cpu"): 1, ("recompute", "disk"): 1}
    assert promotions(engine) == 0


def test_a_preempted_request_decides_again_when_it_resumes(tmp_path):
    """Review finding F1: q recomputed its prefix (on a slow disk), was preempted after storing it
    to RAM; when it resumes, RAM holds its chunks: it loads them."""
    engine = engine_with(tmp_path, SLOW_DISK)
    p = prompt(8, seed=1)
    only_on_disk(engine, p)
    q = engine.add_request("q", p + prompt(4, seed=9) + [7], max_new_tokens=6)
    # q recomputes p and starts decoding; its chunks are stored in RAM
    for _ in range(3):
        engine.step()
    settle(engine)
    assert decisions(engine) == {("recompute", "disk"): 1}
    engine.preempt("q")
    engine.reset_prefix_cache()
    loaded_before = engine.scheduler.stats.loaded_chunks
    engine.step()
    assert engine.scheduler.stats.loaded_chunks - loaded_before == 3
    assert decisions(engine) == {("recompute", "disk"): 1, ("load", "cpu"): 1}
    run_until_done(engine)
    assert q.is_finished
