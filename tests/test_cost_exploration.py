"""Measuring what decides is also exploring (issue 32, defect 2): a tier the load-or-recompute
decision wrote off is measured again, so one slow spell never disables it (or RAM) for good.

The fake engine drives the real OffloadScheduler with its cost model measuring (no fixed figures),
a TieredManager over a 4-slot CPU tier and a real disk tier (RAM's test: the CPU tier alone), and
the real worker; `SlowReads` holds the disk's reads or answers them late, as a stalled or slow
disk would (real time: the timeouts and delays are the faults, not guesses). Time is a
`FakeClock` the test moves on by `REQUEST_GAP_S` before each request (the estimates age on it, and
explorations are spaced on it); the engine's prefill speed is injected (`PrefillRate`'s prior, which
a fake engine's steps never replace: its clock stands still within a request), so a chunk's 4 tokens
are worth 0.4 s of prefill: a read that takes 1 s or more per chunk is written off, one that takes
microseconds or milliseconds (the real tiers here) is not. The read seconds the model sees are the
test's figures (`SlowReads`), whatever the machine's speed.

Block size 4 tokens, chunks of 1 block, prefixes of 3 chunks.
"""

from __future__ import annotations

import dataclasses
import time
from itertools import pairwise

import pytest

from helpers import HANG_S
from kvtier.costmodel import PrefillRate
from kvtier.jobs import JobResult
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import FakeEngine, KVCache
from kvtier.sim.fake_engine import make_slab
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.secondary import SecondaryTier, TierJob, TierResult
from kvtier.tiers.tiered import TieredManager
from sched_helpers import UNBOUNDED_DEFERRALS, FakeClock, close_after_test, prompt, run_until_done
from test_tiered_scheduler import _ClosesTiers, serve, settle
from tier_helpers import HeldTier

NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS = 32, 4, 4
PREFIX_TOKENS = 12
# a chunk's 4 tokens: 0.4 s to recompute
PREFILL_TOKENS_PER_S = 10.0
# a read given up on counts as 1 s: three given up on together read as 1 s a chunk, 2.5x recomputing it.
# The stall test's fault (a real deadline); every other engine's tier jobs have HANG_S
TIER_JOB_TIMEOUT_S = 1.0
# fake seconds between two requests
REQUEST_GAP_S = 0.25
MAX_REQUESTS = (
    # 10 fake seconds of requests: a tier that recovered is loaded from again within them
    40
)
# what a read of a disk that is not slow reports (`SlowReads`)
HEALTHY_READ_S = 0.001


class SlowReads(HeldTier):
    """A real tier whose reads can be held (`hold_loads`, as `HeldTier`) or answered `read_delay_s`
    late (a slow link): a read's result is reported once that long has passed since it was
    submitted. The seconds it reports are the fault's, not the machine's: `read_delay_s` when slow,
    `HEALTHY_READ_S` when not (the real seconds included a busy machine's scheduling delays, which
    could make a healthy read cost more than recomputing, or a slow one space explorations wider)."""

    def __init__(self, inner: SecondaryTier):
        super().__init__(inner, hold_stores=False)
        self.hold_loads = False
        self.read_delay_s = 0.0
        # read job id -> when it was submitted (monotonic)
        self._submitted: dict[int, float] = {}
        # reads the inner tier ended, not yet due
        self._early: list[TierResult] = []

    def submit_load(self, job: TierJob) -> None:
        self._submitted[job.job_id] = time.monotonic()
        super().submit_load(job)

    def get_finished(self) -> list[TierResult]:
        now = time.monotonic()
        results, self._early = self._early + super().get_finished(), []
        due = []
        for result in results:
            submitted = self._submitted.get(result.job_id)
            if submitted is None:
                due.append(result)
            elif now - submitted >= self.read_delay_s:
                due.append(dataclasses.replace(result, seconds=self.read_delay_s or HEALTHY_READ_S))
            else:
                self._early.append(result)
        for result in due:
            self._submitted.pop(result.job_id, None)
        return due

    def drain(self, timeout: float) -> bool:
        """The inner tier's jobs ended, and every read is due (the delay is the fault: waited out)."""
        if not super().drain(timeout):
            return False
        if self.read_delay_s and self._submitted:
            time.sleep(
                max(0.0, max(self._submitted.values()) + self.read_delay_s - time.monotonic())
            )
        return True


def measuring_scheduler(manager, chunk_bytes: int, clock: FakeClock) -> OffloadScheduler:
    """A scheduler whose cost model measures (prefill injected); job deadlines far beyond the test."""
    config = SchedulerOffloadConfig(
        groups=(GroupSpec(tokens_per_block=BLOCK_SIZE),),
        max_defer_s=60.0,
        max_deferrals=UNBOUNDED_DEFERRALS,
        job_timeout_s=1e6,
        chunk_bytes=chunk_bytes,
    )
    scheduler = OffloadScheduler(config, manager, clock=clock)
    scheduler.costs.prefill = PrefillRate(prior_tokens_per_s=PREFILL_TOKENS_PER_S)
    return scheduler


def disk_engine(
    tmp_path, clock: FakeClock, num_prefixes: int, tier_timeout_s: float = HANG_S
) -> tuple[FakeEngine, SlowReads, list[list[int]]]:
    """An engine over RAM + disk, with `num_prefixes` prefixes on disk only (computed once, written
    through, then pushed out of RAM by two fillers)."""
    slab = make_slab(KVCache(1, NUM_BLOCKS, BLOCK_SIZE), 1, NUM_SLOTS)
    namespace = Namespace("sim", "float32", "sim", BLOCK_SIZE, 1, "sha256", 1, slab.rows.shape[1])
    # room for every chunk many times over: the disk evicts nothing here
    disk = DiskTier(tmp_path, namespace, 16 * (num_prefixes + 4) * (slab.rows.shape[1] + 4096))
    assert disk.wait_scanned(HANG_S)
    tier = SlowReads(disk)
    manager = TieredManager(
        CPUTierManager(NUM_SLOTS), [slab.rows], [(tier, TierRules())], job_timeout_s=tier_timeout_s
    )
    engine = close_after_test(
        _ClosesTiers(
            FakeEngine(
                measuring_scheduler(manager, slab.rows.shape[1], clock),
                num_blocks=NUM_BLOCKS,
                block_size=BLOCK_SIZE,
                clock=clock,
                slab=slab,
            ),
            manager,
        )
    )
    prefixes = [prompt(PREFIX_TOKENS, seed=s) for s in range(1, 1 + num_prefixes)]
    for i, p in enumerate(prefixes):
        serve(engine, f"first-{i}", p)
        settle(engine)
    for i in range(2):
        serve(engine, f"filler-{i}", prompt(PREFIX_TOKENS, seed=100 + i))
        settle(engine)
    return engine, tier, prefixes


def ram_engine(clock: FakeClock) -> tuple[FakeEngine, list[int]]:
    """An engine over an 8-chunk RAM tier alone, and a prefix it computed there."""
    slab = make_slab(KVCache(1, NUM_BLOCKS, BLOCK_SIZE), 1, 8)
    scheduler = measuring_scheduler(CPUTierManager(8), slab.rows.shape[1], clock)
    engine = close_after_test(
        FakeEngine(scheduler, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, clock=clock, slab=slab)
    )
    p = prompt(PREFIX_TOKENS, seed=1)
    serve(engine, "p", p)
    return engine, p


def slow_copies(scheduler: OffloadScheduler, clock: FakeClock) -> None:
    """Three RAM -> engine copies of a chunk that took 1 s each (2.5x recomputing it), one a second."""
    for i in range(3):
        clock.now += 1.0
        result = JobResult(job_id=-1 - i, num_bytes=scheduler.config.chunk_bytes, seconds=1.0)
        scheduler.costs.worker_results([(result, True)], now=clock())


def tier_counters(engine) -> dict:
    return dict(engine.manager.tier_stats()[0].counters)


def chunk_seconds(engine, medium: str) -> float:
    """What the cost model expects one chunk from `medium` to take now."""
    return (
        engine.scheduler.costs.snapshot()
        .read(medium)
        .seconds_for(engine.scheduler.config.chunk_bytes)
    )


@dataclasses.dataclass
class Served:
    """One request after the slow spell, as the test saw it."""

    # fake seconds since the tier answered again
    at: float
    loaded_tokens: int
    # its decision tried the tier it wrote off
    explored: bool
    # times it was asked to wait
    deferrals: int


def serve_one(
    engine, clock: FakeClock, req_id: str, tokens: list[int], medium: str, since: float
) -> Served:
    """Serve one request (the engine's own cache emptied first) and see what it did."""
    explorations, deferrals = _explorations(engine, medium), engine.scheduler.stats.deferrals
    engine.reset_prefix_cache()
    req = serve(engine, req_id, tokens)
    manager = engine.scheduler.manager
    if isinstance(manager, TieredManager):
        settle(engine)
        # the tier jobs that ended are applied: the estimate sees them
        manager.stats()
    return Served(
        clock() - since,
        req.num_external_tokens,
        _explorations(engine, medium) > explorations,
        engine.scheduler.stats.deferrals - deferrals,
    )


def _explorations(engine, medium: str) -> int:
    return engine.scheduler.stats.as_dict().get(f"explorations_{medium}", 0)


def test_a_tier_written_off_by_a_stall_is_loaded_from_again_once_it_answers(tmp_path):
    """Three promotions expire while the disk holds its reads; then it answers at full speed.
    Before exploration, its estimate (three reads of a whole timeout each) wrote it off for good:
    no promotion started again, so nothing measured it again."""
    clock = FakeClock()
    engine, disk, prefixes = disk_engine(
        tmp_path, clock, 1 + MAX_REQUESTS, tier_timeout_s=TIER_JOB_TIMEOUT_S
    )
    engine.reset_prefix_cache()
    # the disk stalls: the first prefix's 3 promotions are held until their deadline passes (real
    # time: TIER_JOB_TIMEOUT_S), the request recomputes; each counts as a read of a whole timeout
    disk.hold_loads = True
    stalled = serve(engine, "stalled", prefixes[0] + [7])
    assert stalled.num_external_tokens == 0 and tier_counters(engine)["expired_jobs"] == 3
    disk.hold_loads = False
    # the held reads end late: ignored (given up on), their slots freed
    disk.release()
    settle(engine)
    # written off
    assert chunk_seconds(engine, "disk") > BLOCK_SIZE / PREFILL_TOKENS_PER_S
    # the disk answers at full speed again; a request every REQUEST_GAP_S, each with a prefix only on disk
    healthy_at = clock()
    served = []
    for i, p in enumerate(prefixes[1:]):
        clock.now += REQUEST_GAP_S
        served.append(serve_one(engine, clock, f"again-{i}", p + [7], "disk", healthy_at))
        if served[-1].loaded_tokens == PREFIX_TOKENS:
            break
    print(
        "after the stall:",
        [(s.at, s.loaded_tokens, "explored" if s.explored else "") for s in served],
    )
    print(
        "decisions:",
        dict(engine.scheduler.stats.load_decisions),
        "disk:",
        {k: v for k, v in tier_counters(engine).items() if "promotion" in k or "expired" in k},
    )
    assert served[-1].loaded_tokens == PREFIX_TOKENS, served
    explored = [s for s in served if s.explored]
    # a request that explored recomputed as decided, without waiting for the read it started
    assert explored and all(s.loaded_tokens == 0 and s.deferrals == 0 for s in explored), explored
    # the newest three reads outweigh the stall
    assert len(explored) <= 3, explored


def test_exploring_a_tier_that_really_is_slow_costs_a_chunk_now_and_then_and_no_request_waits(
    tmp_path,
):
    """A disk whose reads answer 1 s late stays written off: each exploration measures it slow
    again. What that costs: one chunk read every few seconds, in the background. (The reads take 1 s
    of real time: 7 explorations over 20 fake seconds, about 8 s of this test.)"""
    clock = FakeClock()
    read_s = 1.0
    num_requests = int(20 / REQUEST_GAP_S)
    # a deadline the slow reads never reach: they end, slowly
    engine, disk, prefixes = disk_engine(tmp_path, clock, 20)
    chunk_bytes = engine.scheduler.config.chunk_bytes
    disk.read_delay_s = read_s
    engine.reset_prefix_cache()
    # the first request finds the prior (1 GB/s) and loads; its 3 reads, side by side, take 1 s
    first = serve(engine, "first-read", prefixes[0] + [7])
    settle(engine)
    assert first.num_external_tokens == PREFIX_TOKENS
    # written off
    assert chunk_seconds(engine, "disk") > BLOCK_SIZE / PREFILL_TOKENS_PER_S
    reads_before = tier_counters(engine).get("load_chunks", 0)
    start = clock()
    served = []
    # prefixes on disk in turn
    for i in range(num_requests):
        clock.now += REQUEST_GAP_S
        served.append(serve_one(engine, clock, f"q-{i}", prefixes[1 + i % 19] + [7], "disk", start))
    explored = [s.at for s in served if s.explored]
    reads = tier_counters(engine).get("load_chunks", 0) - reads_before
    # nothing read into RAM
    assert tier_counters(engine)["promotions"] == first.num_external_tokens // BLOCK_SIZE
    seconds = clock() - start
    print(
        f"a disk reading a chunk in {read_s} s, over {seconds:.0f} fake s and {num_requests} requests:",
        f"{len(explored)} explorations at",
        explored,
        f"= {reads} chunk reads ({reads * chunk_bytes} bytes),",
        f"the disk busy with them {reads * read_s / seconds:.0%} of the time",
    )
    # nobody loaded from it, nor waited
    assert all(s.loaded_tokens == 0 and s.deferrals == 0 for s in served)
    assert reads == len(explored)
    # a read of 1 s is followed by 3 s without one: at most one every 4 s (a quarter of the disk's time)
    assert all(b - a >= 3 * read_s for a, b in pairwise(explored)), explored
    # and it is measured again all along
    assert len(explored) >= seconds / 5


def written_off_disk(tmp_path, clock: FakeClock, num_prefixes: int):
    """A disk tier whose reads answer 1 s late, written off by a first load at its prior."""
    engine, disk, prefixes = disk_engine(tmp_path, clock, num_prefixes)
    disk.read_delay_s = 1.0
    engine.reset_prefix_cache()
    serve(engine, "first-read", prefixes[0] + [7])
    settle(engine)
    # written off
    assert chunk_seconds(engine, "disk") > BLOCK_SIZE / PREFILL_TOKENS_PER_S
    return engine, disk, prefixes


def test_a_request_sharing_an_explored_prefix_does_not_wait_for_the_exploration(tmp_path):
    # issue 32's review: an exploration read up into a PENDING RAM slot made its chunk "not known yet"
    # to every request sharing the prefix, which then waited for the read of a tier written off as
    # slower than recomputing (and after a hung read's deadline, its RETIRED slot kept the key out of RAM)
    clock = FakeClock()
    engine, _, prefixes = written_off_disk(tmp_path, clock, 3)
    # the disk's estimate is stale
    clock.now += 10.0
    engine.reset_prefix_cache()
    explored_before = _explorations(engine, "disk")
    a = serve(engine, "A", prefixes[1] + [7])
    assert _explorations(engine, "disk") == explored_before + 1 and a.num_external_tokens == 0
    # B has A's prefix and arrives while A's exploration read (1 s) still runs: it decides as A did
    engine.reset_prefix_cache()
    deferrals_before = engine.scheduler.stats.deferrals
    b = serve(engine, "B", prefixes[1] + [8])
    assert engine.scheduler.stats.deferrals == deferrals_before, "B waited for A's exploration"
    # A's own chunks, stored as it recomputed them
    assert b.num_external_tokens == PREFIX_TOKENS
    assert engine.manager.stats().pending_slots == 0


def test_an_exploration_never_evicts_the_ram_head_its_decision_loads(tmp_path):
    # issue 32's review: the exploration's promotion ran before the request's scan joined its RAM head
    # to its chain, evicted that head, and the request then waited for it from the slow disk
    clock = FakeClock()
    engine, _, prefixes = written_off_disk(tmp_path, clock, 3)
    p = prefixes[1]
    engine.reset_prefix_cache()
    serve(engine, "P", p + [7])
    settle(engine)
    # two one-chunk requests push P's tail out of RAM: its head [0, 1] stays
    for i in range(2):
        serve(engine, f"fill-{i}", prompt(5, seed=200 + i))
        settle(engine)
    clock.now += (
        # the disk's estimate is stale: the decision that stops before P's tail explores it
        20.0
    )
    engine.reset_prefix_cache()
    explored_before = _explorations(engine, "disk")
    deferrals_before = engine.scheduler.stats.deferrals
    a = serve(engine, "A", p + [7])
    assert _explorations(engine, "disk") == explored_before + 1
    assert (
        a.num_external_tokens == 2 * BLOCK_SIZE
        and engine.scheduler.stats.deferrals == deferrals_before
    )


def test_ram_written_off_by_three_slow_copies_is_loaded_from_again(tmp_path):
    """Three host -> engine copies that happened to be slow (a descheduled worker, first-touch page
    faults) wrote RAM off: every later request recomputed with its whole prefix in RAM, and since
    only loads measure RAM, nothing measured it again."""
    clock = FakeClock()
    engine, p = ram_engine(clock)
    scheduler = engine.scheduler
    slow_copies(scheduler, clock)
    assert chunk_seconds(engine, "cpu") > BLOCK_SIZE / PREFILL_TOKENS_PER_S
    slow_at = clock()
    served = [serve_one(engine, clock, "first", p + [7], "cpu", slow_at)]
    for i in range(MAX_REQUESTS):
        clock.now += REQUEST_GAP_S
        served.append(serve_one(engine, clock, f"again-{i}", p + [7], "cpu", slow_at))
    print(
        "after the slow copies:",
        [(s.at, s.loaded_tokens, "explored" if s.explored else "") for s in served],
    )
    print("decisions:", dict(scheduler.stats.load_decisions))
    # written off: recomputed
    assert served[0].loaded_tokens == 0
    explored = [i for i, s in enumerate(served) if s.explored]
    # each exploration loaded the RAM head; after at most three, RAM is trusted again: every later
    # request loads from it without exploring
    assert explored and len(explored) <= 3, explored
    assert all(served[i].loaded_tokens == PREFIX_TOKENS for i in explored)
    assert all(s.loaded_tokens == PREFIX_TOKENS for s in served[explored[-1] :]), served


def test_ram_written_off_while_every_prefix_is_on_disk_is_read_at_its_prior_once_long_unmeasured(
    tmp_path,
):
    # the stack fuzzer: only loads measure RAM, and every tier's reads end in a RAM copy; with RAM
    # written off and every prefix on disk (none in RAM to explore RAM with), nothing loaded again
    clock = FakeClock()
    engine, _, prefixes = disk_engine(tmp_path, clock, 4)
    slow_copies(engine.scheduler, clock)
    # a prefix only on disk (a fast one): the RAM copy alone costs more than recomputing
    before = serve_one(engine, clock, "before", prefixes[1] + [7], "cpu", clock())
    assert before.loaded_tokens == 0 and not before.explored
    # 30 s without a RAM copy measured: RAM is read at its prior again, and the disk's prefix loads
    clock.now += 31.0
    after = serve_one(engine, clock, "after", prefixes[2] + [7], "cpu", clock())
    assert after.loaded_tokens == PREFIX_TOKENS


def test_a_burst_after_ram_went_unmeasured_bets_on_its_prior_once(tmp_path):
    # review of d829ade: every decision made before the first copy was measured read RAM at its
    # prior, so a burst of requests all loaded from a RAM really slower than recomputing
    clock = FakeClock()
    engine, p = ram_engine(clock)
    slow_copies(engine.scheduler, clock)
    clock.now += 31.0
    # 6 requests arrive in one step, each with the prefix in RAM: one bets on RAM, the others recompute
    engine.reset_prefix_cache()
    burst = [engine.add_request(f"burst-{i}", p + [7 + i], 1) for i in range(6)]
    run_until_done(engine)
    assert sorted(r.num_external_tokens for r in burst) == [0] * 5 + [PREFIX_TOKENS]
    assert _explorations(engine, "cpu") == 1


def test_explorations_are_a_metric_per_tier():
    """`kvtier:tier_explorations_total{tier}`, from the scheduler's counter (`tier.<medium>.explorations`)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from kvtier.integrations.vllm.metrics import KVTierPromMetrics

    prom = KVTierPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["engine"],
        {0: ["0"]},
    )
    prom.observe(
        {"counters": {"tier.cpu.explorations": 2, "tier.redis.explorations": 1}, "gauges": {}}
    )
    found = {
        s.labels["tier"]: s.value
        for m in REGISTRY.collect()
        for s in m.samples
        if s.name == "kvtier:tier_explorations_total"
    }
    assert found == {"cpu": 2, "redis": 1}
