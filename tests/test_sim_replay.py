"""`simulate` and `sweep`: a trace replayed through the real scheduler, tiers and worker.

The fake engine checks every block a token attends to (content checks stay on here), so a
replay that moved wrong bytes fails with ContentMismatch instead of reporting a hit rate.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace

import pytest

from kvtier.costmodel import choose_load
from kvtier.errors import ConfigError
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import (
    CostModel,
    FakeEngine,
    SimOptions,
    belady_hit_rate,
    simulate,
    sweep,
    synthetic,
)
from kvtier.sim.workload import engine_output_tokens, engine_prompt
from kvtier.tiers.cpu.manager import CPUTierManager
from sched_helpers import FakeClock, close_after_test

# 170 requests, 502 distinct blocks, the longest 53
TRACE = synthetic(24, seed=7, conversations_per_s=2.0)
ENGINE_BLOCKS = (
    # room for the longest request and its reply: the engine's cache alone serves 30 %
    57
)
OPTIONS = SimOptions(host_slots=60, engine_blocks=ENGINE_BLOCKS, max_running=1)


def step_by_step(requests, opts: SimOptions) -> FakeEngine:
    """The same workload by hand: one request at a time through a fake engine, until it is done,
    the load decisions weighing one trace block's KV per chunk, at the cost model's figures."""
    scale = (opts.trace_block_tokens, opts.engine_block_tokens)
    config = SchedulerOffloadConfig(
        groups=(GroupSpec(tokens_per_block=opts.engine_block_tokens),),
        offload_prompt_only=True,
        chunk_bytes=opts.trace_block_tokens * opts.costs.kv_bytes_per_token,
    )
    costs = opts.costs.snapshot(step_s=opts.step_s, token_scale=scale[0] / scale[1])
    clock = FakeClock()
    scheduler = OffloadScheduler(
        config, CPUTierManager(opts.host_slots, policy=opts.policy), clock=clock, costs=costs
    )
    engine = close_after_test(
        FakeEngine(
            scheduler,
            num_blocks=opts.engine_blocks,
            clock=clock,
            block_size=opts.engine_block_tokens,
            max_tokens_per_step=1 << 30,
        )
    )
    for i, req in enumerate(requests):
        engine.add_request(str(i), engine_prompt(req, *scale), engine_output_tokens(req, *scale))
        while engine.waiting or engine.running:
            engine.step()
            # as the replay's clock: a load's measured seconds agree
            clock.now += opts.step_s
    return engine


@pytest.mark.parametrize("policy", ["lru", "turns"])
def test_the_simulator_counts_what_the_fake_engine_gives_step_by_step(policy):
    opts = SimOptions(host_slots=60, engine_blocks=ENGINE_BLOCKS, max_running=1, policy=policy)
    report = simulate(TRACE, opts)
    engine = step_by_step(TRACE, opts)
    # per request: engine tokens (2 per trace block) -> trace tokens (512 per block)
    scale = opts.trace_block_tokens // opts.engine_block_tokens
    engine_hits = (
        sum(r.num_cached_tokens - r.num_external_tokens for r in engine.requests.values()) * scale
    )
    kvtier_hits = sum(r.num_external_tokens for r in engine.requests.values()) * scale
    stats, manager = engine.scheduler.stats, engine.scheduler.manager.stats()
    # the workload exercises both caches
    assert kvtier_hits > 0 and engine_hits > 0
    assert (report.engine_hit_tokens, report.kvtier_hit_tokens) == (engine_hits, kvtier_hits)
    # the load decisions and their expected seconds too
    assert report.counters == stats.as_dict()
    assert sum(report.load_decisions["load"].values()) > 0
    assert (report.evictions["cpu"], report.num_steps) == (manager.evictions, engine.num_steps)


def test_a_report_has_every_figure_and_serializes():
    report = simulate(TRACE, OPTIONS)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["total_hit_rate"] == pytest.approx(
        data["engine_hit_rate"] + data["kvtier_hit_rate"]
    )
    assert data["tier_hit_rates"] == {"cpu": pytest.approx(data["kvtier_hit_rate"])}
    chunk = 512 * CostModel().kv_bytes_per_token
    assert data["bytes_moved"]["cpu"] == {
        "store": report.counters["stored_chunks"] * chunk,
        "load": report.counters["loaded_chunks"] * chunk,
    }
    assert data["num_requests"] == len(TRACE) and data["host_slots"] == 60
    # no policy beats MIN with room for the host tier and the engine cache together
    assert report.total_hit_rate <= belady_hit_rate(TRACE, 60 + ENGINE_BLOCKS) + 1e-12
    # a second replay gives the same figures
    again = simulate(TRACE, OPTIONS).to_dict()
    assert {k: v for k, v in again.items() if k != "wall_s"} == {
        k: v for k, v in data.items() if k != "wall_s"
    }


def test_a_disk_tier_serves_what_ram_evicted(tmp_path):
    # 8 RAM slots: little survives there; 400 disk slots hold the rest, promoted back on reuse
    opts = SimOptions(
        host_slots=8,
        engine_blocks=ENGINE_BLOCKS,
        disk_slots=400,
        disk_dir=str(tmp_path),
        max_running=2,
    )
    report = simulate(TRACE, opts)
    ram_only = simulate(TRACE, SimOptions(host_slots=8, engine_blocks=ENGINE_BLOCKS, max_running=2))
    assert report.tier_hit_tokens["disk"] > 0
    assert report.kvtier_hit_rate > ram_only.kvtier_hit_rate
    assert report.bytes_moved["disk"]["store"] > 0 and report.bytes_moved["disk"]["load"] > 0
    # a promotion is a wait of a step
    assert report.deferrals > 0
    # the disk's hits still save time (a RAM hit saves more: it waits no step, reads no disk)
    assert report.ttft.saving_s > 0


def test_the_cost_model_arithmetic():
    costs = CostModel(
        prefill_tokens_per_s=1000,
        kv_bytes_per_token=1000,
        cpu_gb_per_s=1.0,
        disk_gb_per_s=0.5,
        cpu_latency_ms=0.0,
        disk_latency_ms=1.0,
    )
    # 10 requests, 10,000 prompt tokens, 2,000 served by the engine, 4,000 by kvtier, whose loads
    # were expected to take 0.5 s together
    estimate = costs.estimate(10, 10_000, 2_000, 4_000, load_s=0.5)
    # without: 8,000 tokens computed = 8 s; with: 4 s computed + the loads
    assert estimate.baseline_s == pytest.approx(8.0)
    assert estimate.with_kvtier_s == pytest.approx(4.5)
    assert estimate.mean_saving_ms == pytest.approx(1000 * (8.0 - 4.5) / 10)
    # one load of 10 chunks of 100 tokens, 4 in RAM then 6 on disk, after a step of 20 ms:
    # wait max(20 ms, 1 ms + 600 kB at 0.5 GB/s) = 20 ms, then 1 MB over the host link = 1 ms;
    # recomputing the 1,000 tokens would take 1 s
    choice = choose_load(["cpu"] * 4 + ["disk"] * 6, 100_000, 100, costs.snapshot(step_s=0.02))
    assert (choice.decision, choice.load_s) == ("load", pytest.approx(0.021))
    # a replay's engine token stands for `token_scale` modelled ones: its chunk of 1 token recomputes as 100
    assert costs.snapshot(token_scale=100).prefill_tokens_per_s == pytest.approx(10.0)
    with pytest.raises(ConfigError):
        CostModel(prefill_tokens_per_s=0)
    with pytest.raises(ConfigError):
        CostModel(s3_latency_ms=-1)


def test_a_slow_disk_is_recomputed_not_promoted(tmp_path):
    # a disk tier behind 8 RAM slots, read at 1 MB/s: a chunk (512 tokens x 128 KiB) takes a minute
    slow = CostModel(disk_gb_per_s=0.001)
    opts = SimOptions(
        host_slots=8,
        engine_blocks=ENGINE_BLOCKS,
        disk_slots=400,
        disk_dir=str(tmp_path / "cost"),
        max_running=2,
        costs=slow,
    )
    # the fake engine checks every block it attends to: no wrong byte
    cost = simulate(TRACE, opts)
    # with the cost model: what is found only on disk is recomputed, only RAM heads are loaded
    assert cost.load_decisions["recompute"]["disk"] > 0 and "disk" not in cost.load_decisions.get(
        "load", {}
    )
    assert cost.bytes_moved["disk"]["store"] > 0 and cost.bytes_moved["disk"]["load"] == 0
    # with load_policy "always": every found chunk is promoted through the slow disk, and the
    # estimate says what that costs: far more than recomputing
    always = simulate(TRACE, replace(opts, load_policy="always", disk_dir=str(tmp_path / "always")))
    assert always.bytes_moved["disk"]["load"] > cost.bytes_moved["disk"]["load"]
    assert set(always.load_decisions) == {"load"}
    assert always.ttft.saving_s < 0 < cost.ttft.saving_s


def test_a_report_says_how_many_decisions_were_load_partial_recompute(tmp_path):
    from kvtier.cli.simulate import render

    # the default cost model, a disk tier behind 8 RAM slots: a head of one disk chunk is not
    # worth a step's wait (50 ms) plus its read (34 ms) against 51 ms of prefill; longer ones are
    opts = SimOptions(
        host_slots=8,
        engine_blocks=ENGINE_BLOCKS,
        disk_slots=400,
        disk_dir=str(tmp_path),
        max_running=2,
    )
    report = simulate(TRACE, opts)
    counts = {d: sum(by_tier.values()) for d, by_tier in report.load_decisions.items()}
    assert counts["load"] > 0 and counts["recompute"] > 0
    # the text report says each, with its tiers
    line = next(
        line
        for line in render("synthetic", report.to_dict()).splitlines()
        if line.startswith("decisions")
    )
    for decision in ("load", "partial", "recompute"):
        by_tier = ", ".join(
            f"{tier} {n:,}" for tier, n in report.load_decisions.get(decision, {}).items()
        )
        assert (
            f"{decision} {counts.get(decision, 0):,}" + (f" ({by_tier})" if by_tier else "") in line
        )
    assert line.endswith("(load_policy cost)")


def test_an_engine_too_small_for_the_longest_request_is_refused():
    longest = max(len(r.hash_ids) for r in TRACE)
    with pytest.raises(ConfigError, match="raise engine_blocks"):
        simulate(TRACE, SimOptions(host_slots=8, engine_blocks=longest - 1))


def test_a_sweep_writes_a_row_per_point_and_belady_on_top(tmp_path):
    pytest.importorskip("matplotlib")
    result = sweep(
        TRACE, [0.05, 0.2], ["lru", "turns"], tmp_path, SimOptions(engine_blocks=ENGINE_BLOCKS)
    )
    rows = list(csv.DictReader(result.csv_path.open()))
    assert [(r["policy"], float(r["capacity_fraction"])) for r in rows] == [
        ("lru", 0.05),
        ("lru", 0.2),
        ("turns", 0.05),
        ("turns", 0.2),
        ("belady", 0.05),
        ("belady_host_only", 0.05),
        ("belady", 0.2),
        ("belady_host_only", 0.2),
    ]
    for fraction in (0.05, 0.2):
        ceiling = result.rate("belady", fraction)
        assert all(result.rate(p, fraction) <= ceiling + 1e-12 for p in ("lru", "turns"))
    assert result.png_path is not None and result.png_path.stat().st_size > 0
    assert json.loads(json.dumps(result.to_dict()))["csv"] == str(result.csv_path)
    assert not math.isnan(result.rate("lru", 0.05))


def test_the_fake_engine_never_evicts_a_requests_own_hits_to_make_room_for_it():
    # an engine of 8 blocks of 4 tokens, no offloading
    engine = close_after_test(FakeEngine(None, num_blocks=8, block_size=4))
    a = list(range(12))
    engine.add_request("A", a)
    # A's 3 whole blocks stay cached, unreferenced; 5 blocks free
    engine.run()
    # runs, holding 2 blocks
    engine.add_request("R", [90 + i for i in range(8)], max_new_tokens=6)
    # 3 hits + 4 new blocks: 1 short
    engine.add_request("B", a + list(range(100, 116)), max_new_tokens=2)
    engine.step()
    # B cannot start yet: taking A's cached blocks for it would hand B its own hits twice
    assert [r.req_id for r in engine.running] == ["R"] and engine.requests["B"].block_ids == []
    # R finishes and frees its blocks; B runs on its 3 hits (checked at every step)
    engine.run()
    assert engine.requests["B"].num_cached_tokens == 12
