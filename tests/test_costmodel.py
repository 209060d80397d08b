"""The cost model's parts on their own: the online estimates (a tier's transfers, the engine's
prefill) and the decision (`choose_load`), checked against a brute-force search over every head
on seeded random inputs."""

from __future__ import annotations

import random

import pytest

from kvtier.costmodel import (
    CostSnapshot,
    PrefillRate,
    ReadEstimate,
    TransferRate,
    choose_load,
    read_prior,
)
from kvtier.errors import ConfigError

MB = 1_000_000
PRIOR = ReadEstimate(1e6, 0.5)


# -- a tier's transfers ------------------------------------------------------------------------


def test_the_prior_stands_until_three_jobs_were_measured():
    rate = TransferRate(PRIOR)
    rate.add(10 * MB, submitted_at=0.0, seconds=0.1)
    rate.add(10 * MB, submitted_at=1.0, seconds=0.1)
    assert rate.estimate() == PRIOR
    rate.add(10 * MB, submitted_at=2.0, seconds=0.1)
    measured = rate.estimate()
    assert measured.bytes_per_s == pytest.approx(100 * MB) and measured.num_samples == 3
    assert measured.latency_s == pytest.approx(0.0, abs=1e-9)


def test_concurrent_jobs_are_not_mistaken_for_slow_ones():
    rate = TransferRate(PRIOR)
    # four 10 MB jobs that all ran during the same second: 40 MB/s, though each took 1 s
    for _ in range(4):
        rate.add(10 * MB, submitted_at=5.0, seconds=1.0)
    assert rate.estimate().bytes_per_s == pytest.approx(40 * MB)


def test_one_stalled_job_lowers_the_estimate_for_a_while_only():
    rate = TransferRate(PRIOR, window=8)
    t = 0.0
    # 1 MB in 10 ms each: 100 MB/s
    for _ in range(7):
        rate.add(MB, submitted_at=t, seconds=0.01)
        t += 1.0
    # a job stuck for 10 s (given up on at its timeout)
    rate.add(MB, submitted_at=t, seconds=10.0)
    stalled = rate.estimate().bytes_per_s
    # it counts as at most 4 median jobs (40 ms), not 10 s: the tier does not look dead. (It ended
    # 10 s after the others: the estimate covers it and the two jobs before it, the fewest it
    # stands on, 3 MB in 60 ms; uncapped it would be 3 MB in 10.02 s.)
    assert 3 * MB / 0.06 * 0.99 < stalled < 100 * MB
    # the window moves on past it
    for _ in range(8):
        t += 20.0
        rate.add(MB, submitted_at=t, seconds=0.01)
    assert rate.estimate().bytes_per_s == pytest.approx(100 * MB)


def test_a_tier_slow_on_every_job_is_measured_slow():
    rate = TransferRate(PRIOR, window=8)
    for i in range(8):
        # 0.5 MB/s, job after job
        rate.add(MB, submitted_at=10.0 * i, seconds=2.0)
    assert rate.estimate().bytes_per_s == pytest.approx(0.5 * MB)


def test_queued_bytes_wait_ahead_of_a_new_read():
    estimate = ReadEstimate(100 * MB, 0.001, queued_bytes=50 * MB)
    assert estimate.seconds_for(50 * MB) == pytest.approx(1.001)
    with pytest.raises(ConfigError):
        ReadEstimate(0.0, 0.0)


def test_a_tier_that_is_not_registered_has_no_prior_and_the_built_ins_keep_theirs():
    # no silent default: a tier's prior is its descriptor's (kvtier.tiers.registry)
    with pytest.raises(ConfigError, match="no tier named 'my-tier' is registered"):
        read_prior("my-tier")
    assert (
        read_prior("cpu"),
        read_prior("disk"),
        read_prior("redis"),
        read_prior("s3"),
    ) == (
        ReadEstimate(4e9, 0.0002),
        ReadEstimate(1e9, 0.0005),
        ReadEstimate(1e9, 0.001),
        ReadEstimate(3e8, 0.03),
    )
    assert (
        read_prior("cpu").bytes_per_s
        > read_prior("disk").bytes_per_s
        > read_prior("s3").bytes_per_s
    )


# -- the engine's prefill ----------------------------------------------------------------------


def test_prefill_is_measured_from_consecutive_steps_of_a_busy_engine():
    prefill = PrefillRate(prior_tokens_per_s=10_000.0, min_tokens=256)
    now = 0.0
    # request "a" prefills 1,000 tokens in 0.5 s
    prefill.step_started(now, 1000, frozenset({"a"}))
    now += 0.5
    # and 1,000 more
    prefill.step_started(now, 1000, frozenset({"a"}))
    now += 0.5
    # one prefill step measured: still the prior
    assert prefill.tokens_per_s() == 10_000.0
    # then decodes, 0.1 s a step
    for _ in range(4):
        prefill.step_started(now, 1, frozenset({"a"}))
        now += 0.1
    # 0.1 s of each prefill step is what any step costs: 1,000 tokens in 0.4 s
    assert prefill.tokens_per_s() == pytest.approx(2500.0)
    assert prefill.step_seconds() == pytest.approx(0.1)


def test_a_noisy_fixed_part_never_makes_prefill_look_free():
    prefill = PrefillRate(prior_tokens_per_s=10_000.0, min_tokens=256)
    now = 0.0
    for tokens, seconds in [
        (8, 10.0),
        (1000, 0.2),
        (1000, 0.2),
        (1, 0.3),
        (1, 0.3),
        (1, 0.3),
        (1, 0.3),
    ]:
        prefill.step_started(now, tokens, frozenset({"a"}))
        now += seconds
    prefill.step_started(now, 1, frozenset({"a"}))
    # half of each prefill step at least
    assert prefill.tokens_per_s() == pytest.approx(2000 / 0.2)


def test_an_idle_gap_and_decode_steps_say_nothing_about_prefill_speed():
    prefill = PrefillRate(prior_tokens_per_s=10_000.0, min_tokens=256)
    prefill.step_started(0.0, 1000, frozenset({"a"}))
    # "a" ended; "b" arrived a minute later
    prefill.step_started(60.0, 1000, frozenset({"b"}))
    # decode steps: one token each
    for i in range(5):
        prefill.step_started(61.0 + i, 1, frozenset({"b"}))
    # still the prior
    assert prefill.tokens_per_s() == 10_000.0
    with pytest.raises(ConfigError):
        PrefillRate(prior_tokens_per_s=0.0)


# -- the decision ------------------------------------------------------------------------------

COSTS = CostSnapshot(
    {
        "cpu": ReadEstimate(10_000 * MB, 0.0),
        "disk": ReadEstimate(1000 * MB, 0.001),
        "s3": ReadEstimate(10 * MB, 0.05),
    },
    prefill_tokens_per_s=1000.0,
    step_s=0.01,
)


def test_ram_and_a_fast_disk_are_loaded_a_slow_store_is_not():
    # 16 tokens (16 ms to recompute) in 1 MB chunks: RAM 0.1 ms, disk 1 ms + 1 ms, S3 100 ms + 50 ms
    assert choose_load(["cpu"] * 4, MB, 16, COSTS).decision == "load"
    assert choose_load(["disk"] * 4, MB, 16, COSTS).decision == "load"
    choice = choose_load(["s3"] * 4, MB, 16, COSTS)
    assert (choice.decision, choice.tier, choice.num_chunks) == ("recompute", "s3", 0)
    assert choose_load(["s3"] * 4, MB, 16, COSTS, policy="always").num_chunks == 4


def test_a_head_in_ram_is_loaded_before_a_slow_tail():
    choice = choose_load(["cpu", "cpu", "s3", "s3"], MB, 16, COSTS)
    assert (choice.decision, choice.num_chunks, choice.tier) == ("partial", 2, "s3")
    assert choice.saved_s == pytest.approx(0.032)


def test_waiting_one_engine_step_is_charged_to_a_head_read_up_from_a_tier():
    slow_steps = CostSnapshot(COSTS.reads, prefill_tokens_per_s=1000.0, step_s=1.0)
    assert choose_load(["disk"] * 4, MB, 16, slow_steps).decision == "recompute"
    # nothing to wait for
    assert choose_load(["cpu"] * 4, MB, 16, slow_steps).decision == "load"


def _ttft(locations, n, chunk_bytes, chunk_tokens, costs):
    """Brute force: the expected time of loading the first n chunks and recomputing the rest."""
    per_tier: dict[str, int] = {}
    for medium in locations[:n]:
        if medium != "cpu":
            per_tier[medium] = per_tier.get(medium, 0) + chunk_bytes
    waits = [costs.read(m).seconds_for(b) for m, b in per_tier.items()]
    wait = max([costs.step_s, *waits]) if waits else 0.0
    load = wait + costs.read("cpu").seconds_for(n * chunk_bytes) if n else 0.0
    return load + (len(locations) - n) * chunk_tokens / costs.prefill_tokens_per_s


@pytest.mark.parametrize("seed", range(200))
def test_the_choice_is_the_fastest_head_and_never_slower_than_recomputing_or_loading_all(seed):
    rng = random.Random(seed)
    media = ["cpu", "disk", "redis", "s3"]
    costs = CostSnapshot(
        {
            m: ReadEstimate(
                10 ** rng.uniform(5, 10),
                rng.choice([0.0, 10 ** rng.uniform(-5, -1)]),
                queued_bytes=rng.choice([0, rng.randrange(10 * MB)]),
            )
            for m in media
            if rng.random() < 0.8
        },
        prefill_tokens_per_s=10 ** rng.uniform(2, 5),
        step_s=rng.choice([0.0, rng.uniform(0, 0.1)]),
    )
    locations = [rng.choice(media) for _ in range(rng.randrange(1, 12))]
    chunk_bytes, chunk_tokens = rng.choice([MB // 8, MB, 2 * MB]), rng.choice([16, 128, 256])
    choice = choose_load(locations, chunk_bytes, chunk_tokens, costs)
    ttfts = [
        _ttft(locations, n, chunk_bytes, chunk_tokens, costs) for n in range(len(locations) + 1)
    ]
    best = min(ttfts)
    assert ttfts[choice.num_chunks] == pytest.approx(best, rel=1e-9, abs=1e-12)
    # ties go to loading more: no longer head is as fast
    assert all(t > best * (1 + 1e-9) + 1e-12 for t in ttfts[choice.num_chunks + 1 :])
    assert (
        ttfts[choice.num_chunks] <= ttfts[0] + 1e-12
        and ttfts[choice.num_chunks] <= ttfts[-1] + 1e-12
    )
    assert choice.load_s == pytest.approx(
        ttfts[choice.num_chunks] - ttfts[0] + choice.saved_s, abs=1e-9
    )


def test_a_tie_goes_to_loading_more():
    # each chunk takes exactly as long to load as to recompute (2**-10 s, exact in binary)
    even = CostSnapshot({"cpu": ReadEstimate(2.0**30, 0.0)}, prefill_tokens_per_s=16 * 2.0**10)
    choice = choose_load(["cpu"] * 3, 2**20, 16, even)
    assert (choice.decision, choice.num_chunks) == ("load", 3)


def test_the_scheduler_stats_flatten_the_decisions_by_kind_and_tier():
    from kvtier.scheduler import SchedulerStats

    stats = SchedulerStats()
    for _ in range(13):
        stats.count_decision("load", "cpu")
    stats.count_decision("partial", "disk")
    flat = stats.as_dict()
    assert flat["load_decisions_load_cpu"] == 13 and flat["load_decisions_partial_disk"] == 1
    assert flat["requests"] == 0 and "load_decisions" not in flat


def _steps_timed(lag: int) -> PrefillRate:
    """An engine prefilling 10,000 tokens/s (2,048 tokens: 0.2048 s + 5 ms of any step; a decode
    step 5 ms), planned as vLLM plans: with `lag` steps ahead, step k when step k-1-lag ended."""
    steps = ([(2048, 0.2098)] + [(8, 0.005)] * 3) * 6
    ends, t = [], 0.0
    for _, seconds in steps:
        t += seconds
        ends.append(t)
    prefill = PrefillRate(prior_tokens_per_s=1.0, min_tokens=256, lag=lag)
    for k, (tokens, _) in enumerate(steps):
        planned_at = 0.0 if k <= lag else ends[k - 1 - lag]
        prefill.step_started(planned_at + 1e-9 * k, tokens, frozenset({"a"}))
    return prefill


def test_an_engine_that_plans_a_step_ahead_is_timed_by_the_step_that_ran():
    """Review finding F2: under vLLM's async scheduling (two steps in flight) pairing each step's
    tokens with the next planning interval read 983,040 tokens/s for this 10,000 tokens/s engine."""
    assert _steps_timed(lag=0).tokens_per_s() == pytest.approx(10_000, rel=0.01)
    assert _steps_timed(lag=1).tokens_per_s() == pytest.approx(10_000, rel=0.01)


def test_failed_or_empty_tier_reads_say_nothing_about_its_speed():
    """Review finding F3: rejected reads end at once with no bytes; counted, they made a 105 MB/s
    tier look 723 MB/s."""
    from kvtier.base import ReqContext
    from kvtier.tiers.flights import Flight, FlightKind
    from kvtier.tiers.rates import TierRates
    from kvtier.tiers.secondary import TierResult

    class Named:
        medium = "redis"

    rates = TierRates([Named()])
    ctx = ReqContext("r")
    # 10 MiB in 0.1 s, one read after another
    for i in range(3):
        flight = Flight(FlightKind.PROMOTION, 0, (b"k",), ctx, 10 * 2**20, 10.0 * i, 100.0)
        rates.submitted(flight)
        rates.ended(flight, TierResult(job_id=i, num_bytes=10 * 2**20, seconds=0.1))
    measured = rates.estimates()["redis"].bytes_per_s
    # a missing key, a breaker reject: failed at once
    for i in range(27):
        flight = Flight(FlightKind.PROMOTION, 0, (b"k",), ctx, 10 * 2**20, 50.0 + i, 100.0)
        rates.submitted(flight)
        rates.ended(flight, TierResult(job_id=100 + i, failed_keys=frozenset({b"k"}), seconds=0.0))
    assert rates.estimates()["redis"].bytes_per_s == pytest.approx(measured)
    assert rates.estimates()["redis"].queued_bytes == 0


def test_loads_a_worker_reported_together_ran_one_after_another():
    """Review finding F4: a worker copies its batches in turn; four 64 MiB loads reported in one
    step, 16 ms each, read as 16.8 GB/s when placed side by side (true: 4.2 GB/s)."""
    from kvtier.jobs import JobResult
    from kvtier.scheduler import OffloadScheduler, SchedulerOffloadConfig
    from kvtier.tiers.cpu.manager import CPUTierManager

    costs = OffloadScheduler(SchedulerOffloadConfig(), CPUTierManager(4)).costs
    for step in range(3):
        costs.worker_results(
            [
                (JobResult(job_id=4 * step + i, num_bytes=64 * 2**20, seconds=0.016), True)
                for i in range(4)
            ],
            now=10.0 + step,
        )
    assert costs.cpu.estimate().bytes_per_s == pytest.approx(64 * 2**20 / 0.016, rel=1e-6)


def test_jobs_submitted_together_do_not_read_their_queueing_as_latency():
    """bench_costmodel: seven promotions submitted at once through a slow link read a 6 ms latency
    as 34 ms (each waited for the ones before it); the decision counts queued bytes separately."""
    rate = TransferRate(PRIOR)
    # 10 MB at 100 MB/s after 6 ms, one after another: job i ends at 6 ms + (i+1) x 0.1 s
    for i in range(7):
        rate.add(10 * MB, submitted_at=0.0, seconds=0.006 + 0.1 * (i + 1))
    measured = rate.estimate()
    assert measured.latency_s == pytest.approx(0.006, abs=1e-3)
    assert measured.bytes_per_s == pytest.approx(70 * MB / 0.706, rel=1e-6)


def test_one_load_copied_by_two_workers_is_one_sample_of_both_halves():
    """Issue 32, defect 6: with tensor parallelism each worker copies its half of a load and reports
    it; the decision charges a chunk every worker's bytes, so the RAM estimate must see a job's
    bytes summed over its workers and its time as the longest of theirs (they copy side by side).
    Worker 1's report of a job may come a step after worker 0's: the job is one sample once both
    reported."""
    from kvtier.jobs import JobResult
    from kvtier.scheduler import OffloadScheduler, SchedulerOffloadConfig
    from kvtier.tiers.cpu.manager import CPUTierManager

    costs = OffloadScheduler(SchedulerOffloadConfig(num_workers=2), CPUTierManager(4)).costs
    half = 4 * 2**20
    samples_after_one_half = []
    # three loads; each worker copies its 4 MiB half in 1 ms (or less)
    for job_id in range(3):
        costs.worker_results(
            [(JobResult(job_id=job_id, num_bytes=half, seconds=0.001), True)], now=10.0 * job_id
        )
        samples_after_one_half.append(costs.cpu.num_samples)
        costs.worker_results(
            [(JobResult(job_id=job_id, num_bytes=half, seconds=0.0008), True)],
            now=10.0 * job_id + 0.1,
        )
    measured = costs.cpu.estimate()
    print(
        "RAM read estimate of 8 MiB loads in 1 ms:",
        measured.bytes_per_s,
        "samples",
        measured.num_samples,
        "after one half of each job",
        samples_after_one_half,
    )
    assert measured.bytes_per_s == pytest.approx(2 * half / 0.001, rel=1e-6)
    # half a job says nothing yet
    assert measured.num_samples == 3 and samples_after_one_half == [
        0,
        1,
        2,
    ]


# -- estimates age, and a written-off tier is explored (issue 32, defect 2) ---------------------


def test_a_slow_spell_stops_counting_once_newer_jobs_ended_well_after_it():
    """Issue 32, defect 2: a window of 32 jobs kept a slow spell for the next 29 jobs; now the jobs
    that ended more than 2 s before the newest no longer count once three newer ones did."""
    rate = TransferRate(PRIOR)
    # a slow spell: 10 MB in 1 s, one job after another
    for i in range(3):
        rate.add(10 * MB, submitted_at=float(i), seconds=1.0)
    assert rate.estimate().bytes_per_s == pytest.approx(10 * MB)
    t = 10.0
    # 10 s later the tier reads 1 GB/s again
    for i in range(3):
        rate.add(10 * MB, submitted_at=t + i, seconds=0.01)
        # too few jobs since: the spell still counts
        if i < 2:
            assert rate.estimate().bytes_per_s < 100 * MB
    print("after a slow spell and three fast jobs:", rate.estimate())
    assert rate.estimate().bytes_per_s == pytest.approx(1000 * MB)
    # a tier nobody used since keeps its last figure: time passing alone says nothing of its speed
    assert rate.num_samples == 6 and rate.last_ended_at == pytest.approx(12.01)


def _redis_rates():
    from kvtier.base import ReqContext
    from kvtier.tiers.flights import Flight, FlightKind
    from kvtier.tiers.rates import TierRates
    from kvtier.tiers.secondary import TierResult

    class Named:
        medium = "redis"

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    rates = TierRates([Named()], clock=clock)
    ids = iter(range(1_000))

    def flight(kind: FlightKind) -> Flight:
        made = Flight(kind, 0, (b"k",), ReqContext("r"), 10 * MB, clock.now, clock.now + 100.0)
        rates.submitted(made)
        return made

    def ok(seconds: float) -> TierResult:
        return TierResult(job_id=next(ids), num_bytes=10 * MB, seconds=seconds)

    return rates, clock, flight, ok, FlightKind


def test_a_tier_written_off_by_expired_reads_is_explored_once_its_wait_passed():
    """Issue 32, defect 2: three promotions given up on at a 0.5 s deadline wrote Redis off for
    good. Now it may be explored once it answered them (late), nothing in flight measures it and
    its last job is old enough (3x the 0.5 s it took: a slow tier spends at most a quarter of its
    time on explorations)."""
    from kvtier.costmodel.exploration import EXPLORE_AFTER_S

    rates, clock, flight, ok, kind = _redis_rates()
    given_up = [flight(kind.PROMOTION) for _ in range(3)]
    # as the manager's Flights.expire marks them, then counts them
    for read in given_up:
        read.is_expired = True
        rates.expired(read, timeout_s=0.5)
    # three reads of 10 MB in 0.5 s each
    assert rates.estimates()["redis"].bytes_per_s < 100 * MB
    clock.now = 1.0
    # 1 s after: the 0.5 s reads wait 1.5 s
    assert not rates.may_explore(0)
    clock.now = 10.0
    # and the tier has not answered them: hung, another read would hang
    assert not rates.may_explore(0)
    # Redis answers again: the late reads end (not measured: given up on)
    for read in given_up:
        rates.ended(read, ok(9.0))
    assert rates.may_explore(0)
    rates.explored(0)
    read = flight(kind.PROMOTION)
    # a read in flight will measure it
    assert not rates.may_explore(0)
    rates.ended(read, ok(0.01))
    clock.now += EXPLORE_AFTER_S - 0.01
    # one exploration per interval at most
    assert not rates.may_explore(0)
    for _ in range(2):
        clock.now += EXPLORE_AFTER_S
        assert rates.may_explore(0)
        rates.explored(0)
        rates.ended(flight(kind.PROMOTION), ok(0.01))
    print("Redis after three expired reads and three explorations:", rates.estimates()["redis"])
    assert rates.estimates()["redis"].bytes_per_s == pytest.approx(1000 * MB)


def test_a_tier_measured_by_writes_still_draining_is_not_explored():
    """The slow-link e2e test's case (tests/test_vllm_e2e_remote.py, (c)): Redis's estimate stands
    on write-through stores still draining through the link when requests recompute rather than
    read from it. Those writes will measure it: no exploration (it would read through the link
    the decision just refused)."""
    rates, clock, flight, ok, kind = _redis_rates()
    # 10 MB at 2 MB/s each, one after another
    for _ in range(3):
        write = flight(kind.CASCADE)
        clock.now += 5.0
        rates.ended(write, ok(5.0))
    # measured by its writes
    assert rates.estimates()["redis"].bytes_per_s == pytest.approx(2 * MB)
    draining = [flight(kind.CASCADE) for _ in range(3)]
    clock.now += 60.0
    # three writes still in flight
    assert not rates.may_explore(0)
    for write in draining:
        rates.ended(write, ok(5.0))
    clock.now += 15.0
    # nothing left to measure it, and its last job ended 3 x 5 s ago
    assert rates.may_explore(0)
