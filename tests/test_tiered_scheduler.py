"""The tiered manager under the scheduler protocol: the fake engine drives the real
OffloadScheduler, a TieredManager (a 4-slot CPU tier in shared memory, a real disk tier) and
the real worker. The fake engine checks every block a token attends to, so a promotion that
brought the wrong bytes, or bytes into the wrong slot, raises ContentMismatch.

Block size 4 tokens, chunks of 1 block.
"""

from __future__ import annotations

from helpers import HANG_S
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import FakeEngine, KVCache
from kvtier.sim.fake_engine import make_slab
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.tiered import TieredManager
from sched_helpers import UNBOUNDED_DEFERRALS, FakeClock, close_after_test, prompt, run_until_done

NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS = 32, 4, 4


def tiered_engine(
    tmp_path, clock: FakeClock | None = None, max_defer_s: float = 60.0, **rules
) -> FakeEngine:
    slab = make_slab(KVCache(1, NUM_BLOCKS, BLOCK_SIZE), 1, NUM_SLOTS)
    namespace = Namespace("sim", "float32", "sim", BLOCK_SIZE, 1, "sha256", 1, slab.rows.shape[1])
    disk = DiskTier(tmp_path, namespace, 64 * (slab.rows.shape[1] + 4096))
    assert disk.wait_scanned(HANG_S)
    manager = TieredManager(
        CPUTierManager(NUM_SLOTS), [slab.rows], [(disk, TierRules(**rules))], job_timeout_s=HANG_S
    )
    clock = clock or FakeClock()
    # the fake engine's steps take microseconds, the disk's reads milliseconds: the fake clock's
    # seconds bound the wait, not a count of steps
    config = SchedulerOffloadConfig(
        groups=(GroupSpec(tokens_per_block=BLOCK_SIZE),),
        max_defer_s=max_defer_s,
        max_deferrals=UNBOUNDED_DEFERRALS,
    )
    engine = FakeEngine(
        OffloadScheduler(config, manager, clock=clock),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        clock=clock,
        slab=slab,
    )
    return close_after_test(_ClosesTiers(engine, manager))


class _ClosesTiers:
    """The fake engine, whose close also stops the manager's tiers (as the vLLM connector's does)."""

    def __init__(self, engine: FakeEngine, manager: TieredManager):
        self.engine, self.manager = engine, manager

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def close(self) -> None:
        self.manager.close()
        self.engine.close()


def serve(engine, req_id, tokens, max_new_tokens=1):
    req = engine.add_request(req_id, tokens, max_new_tokens)
    run_until_done(engine)
    return req


def settle(engine) -> None:
    for tier in engine.manager.tiers:
        assert tier.drain(HANG_S)


def test_prefixes_evicted_from_ram_come_back_from_disk_with_the_right_kv(tmp_path):
    engine = tiered_engine(tmp_path)
    # 3 chunks each: 12 chunks for a 4-slot CPU tier
    prompts = [prompt(12, seed=s) for s in range(4)]
    # four requests compute their prompts; every chunk is written through to disk; RAM keeps the last 4
    for i, p in enumerate(prompts):
        serve(engine, f"first-{i}", p)
        settle(engine)
    # the engine forgets its own cache; each prompt comes back: its chunks are promoted from disk
    # (HIT_PENDING, a deferral), then loaded — the fake engine checks every block's content
    for i, p in enumerate(prompts):
        engine.reset_prefix_cache()
        req = serve(engine, f"again-{i}", p + [7])
        assert req.num_external_tokens == 12, i
    counters = engine.manager.tier_stats()[0].counters
    assert counters["promotions"] >= 12 - 4 and counters["promotion_failures"] == 0, counters
    assert engine.scheduler.stats.deferrals > 0
    engine.manager.check()


def test_a_request_does_not_wait_past_its_budget_for_a_promotion_that_never_ends(tmp_path):
    clock = FakeClock()
    engine = tiered_engine(tmp_path, clock=clock, max_defer_s=1.0)
    p = prompt(12, seed=9)
    serve(engine, "A", p)
    settle(engine)
    # push A's chunks out of RAM
    for i in range(4):
        serve(engine, f"filler-{i}", prompt(12, seed=20 + i))
        settle(engine)
    # the disk's reads stop answering: promotions start and never end
    disk = engine.manager.tiers[0]
    # a read that hangs forever (the tier never reports it)
    disk.submit_load = lambda job: None
    engine.reset_prefix_cache()
    req = engine.add_request("B", p + [7], 1)
    for _ in range(50):
        engine.step()
        clock.now += 0.1
    # B stopped waiting after 1 s of deferrals and computed its prompt itself
    assert req.is_finished and req.num_external_tokens == 0
    assert engine.scheduler.stats.deferral_timeouts == 1


def test_a_prefix_half_in_ram_half_on_disk_is_promoted_once(tmp_path):
    """Issue 20, defect 3, under the scheduler: p's head is in RAM, its tail on disk. The scan finds
    the head, then promotes the tail: those promotions must not evict the head (before, they did, so
    the head was promoted back, evicting the tail in turn: 8 disk reads to serve 4 chunks)."""
    engine = tiered_engine(tmp_path)
    p, q = prompt(16, seed=1), prompt(8, seed=2)
    # 4 chunks in RAM (and on disk)
    serve(engine, "p", p)
    settle(engine)
    # q's 2 chunks evict p's tail (tails go before heads): RAM holds p0, p1, q0, q1
    serve(engine, "q", q)
    settle(engine)
    # q is now more recent than p's head
    serve(engine, "q-again", q + [5])
    engine.reset_prefix_cache()
    req = serve(engine, "p-again", p + [7])
    assert req.num_external_tokens == 16
    assert engine.manager.tier_stats()[0].counters["promotions"] == 2
