"""`simulate` and `sweep`: a trace replayed through the real scheduler, tiers and worker.

The fake engine checks every block a token attends to (content checks stay on here), so a
replay that moved wrong bytes fails with ContentMismatch instead of reporting a hit rate.
"""

from __future__ import annotations

import csv
import json
import math

import pytest

from kvtier.errors import ConfigError
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import CostModel, FakeEngine, SimOptions, belady_hit_rate, simulate, sweep, synthetic
from kvtier.sim.workload import engine_output_tokens, engine_prompt
from kvtier.tiers.cpu.manager import CPUTierManager
from sched_helpers import FakeClock, close_after_test

TRACE = synthetic(24, seed=7, conversations_per_s=2.0)  # 170 requests, 502 distinct blocks, the longest 53
ENGINE_BLOCKS = 57  # room for the longest request and its reply: the engine's cache alone serves 30 %
OPTIONS = SimOptions(host_slots=60, engine_blocks=ENGINE_BLOCKS, max_running=1)


def step_by_step(requests, opts: SimOptions) -> FakeEngine:
    """The same workload by hand: one request at a time through a fake engine, until it is done."""
    config = SchedulerOffloadConfig(groups=(GroupSpec(tokens_per_block=opts.engine_block_tokens),),
                                    offload_prompt_only=True)
    clock = FakeClock()
    scheduler = OffloadScheduler(config, CPUTierManager(opts.host_slots, policy=opts.policy), clock=clock)
    engine = close_after_test(FakeEngine(scheduler, num_blocks=opts.engine_blocks, clock=clock,
                                         block_size=opts.engine_block_tokens, max_tokens_per_step=1 << 30))
    scale = (opts.trace_block_tokens, opts.engine_block_tokens)
    for i, req in enumerate(requests):
        engine.add_request(str(i), engine_prompt(req, *scale), engine_output_tokens(req, *scale))
        engine.run()
    return engine


@pytest.mark.parametrize("policy", ["lru", "turns"])
def test_the_simulator_counts_what_the_fake_engine_gives_step_by_step(policy):
    opts = SimOptions(host_slots=60, engine_blocks=ENGINE_BLOCKS, max_running=1, policy=policy)
    report = simulate(TRACE, opts)
    engine = step_by_step(TRACE, opts)
    # per request: engine tokens (2 per trace block) -> trace tokens (512 per block)
    scale = opts.trace_block_tokens // opts.engine_block_tokens
    engine_hits = sum(r.num_cached_tokens - r.num_external_tokens for r in engine.requests.values()) * scale
    kvtier_hits = sum(r.num_external_tokens for r in engine.requests.values()) * scale
    stats, manager = engine.scheduler.stats, engine.scheduler.manager.stats()
    assert kvtier_hits > 0 and engine_hits > 0  # the workload exercises both caches
    assert (report.engine_hit_tokens, report.kvtier_hit_tokens) == (engine_hits, kvtier_hits)
    assert report.counters == stats.as_dict()
    assert (report.evictions["cpu"], report.num_steps) == (manager.evictions, engine.num_steps)


def test_a_report_has_every_figure_and_serializes():
    report = simulate(TRACE, OPTIONS)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["total_hit_rate"] == pytest.approx(data["engine_hit_rate"] + data["kvtier_hit_rate"])
    assert data["tier_hit_rates"] == {"cpu": pytest.approx(data["kvtier_hit_rate"])}
    chunk = 512 * CostModel().kv_bytes_per_token
    assert data["bytes_moved"]["cpu"] == {"store": report.counters["stored_chunks"] * chunk,
                                          "load": report.counters["loaded_chunks"] * chunk}
    assert data["num_requests"] == len(TRACE) and data["host_slots"] == 60
    # no policy beats MIN with room for the host tier and the engine cache together
    assert report.total_hit_rate <= belady_hit_rate(TRACE, 60 + ENGINE_BLOCKS) + 1e-12
    # a second replay gives the same figures
    again = simulate(TRACE, OPTIONS).to_dict()
    assert {k: v for k, v in again.items() if k != "wall_s"} == {k: v for k, v in data.items() if k != "wall_s"}


def test_a_disk_tier_serves_what_ram_evicted(tmp_path):
    # 8 RAM slots: little survives there; 400 disk slots hold the rest, promoted back on reuse
    opts = SimOptions(host_slots=8, engine_blocks=ENGINE_BLOCKS, disk_slots=400, disk_dir=str(tmp_path), max_running=2)
    report = simulate(TRACE, opts)
    ram_only = simulate(TRACE, SimOptions(host_slots=8, engine_blocks=ENGINE_BLOCKS, max_running=2))
    assert report.tier_hit_tokens["disk"] > 0
    assert report.kvtier_hit_rate > ram_only.kvtier_hit_rate
    assert report.bytes_moved["disk"]["store"] > 0 and report.bytes_moved["disk"]["load"] > 0
    assert report.deferrals > 0  # a promotion is a wait of a step
    assert report.ttft.saving_s > ram_only.ttft.saving_s


def test_the_cost_model_arithmetic():
    costs = CostModel(prefill_tokens_per_s=1000, kv_bytes_per_token=1000, cpu_gb_per_s=1.0, disk_gb_per_s=0.5)
    # 10 requests, 10,000 prompt tokens, 2,000 served by the engine, 4,000 by kvtier of which 1,000 from disk
    estimate = costs.estimate(10, 10_000, 2_000, 4_000, 1_000)
    # without: 8,000 tokens computed = 8 s; with: 4 s computed + 4 MB at 1 GB/s + 1 MB at 0.5 GB/s
    assert estimate.baseline_s == pytest.approx(8.0)
    assert estimate.with_kvtier_s == pytest.approx(4.0 + 0.004 + 0.002)
    assert estimate.mean_saving_ms == pytest.approx(1000 * (8.0 - 4.006) / 10)
    with pytest.raises(ConfigError):
        CostModel(prefill_tokens_per_s=0)


def test_an_engine_too_small_for_the_longest_request_is_refused():
    longest = max(len(r.hash_ids) for r in TRACE)
    with pytest.raises(ConfigError, match="raise engine_blocks"):
        simulate(TRACE, SimOptions(host_slots=8, engine_blocks=longest - 1))


def test_a_sweep_writes_a_row_per_point_and_belady_on_top(tmp_path):
    pytest.importorskip("matplotlib")
    result = sweep(TRACE, [0.05, 0.2], ["lru", "turns"], tmp_path, SimOptions(engine_blocks=ENGINE_BLOCKS))
    rows = list(csv.DictReader(result.csv_path.open()))
    assert [(r["policy"], float(r["capacity_fraction"])) for r in rows] == [
        ("lru", 0.05), ("lru", 0.2), ("turns", 0.05), ("turns", 0.2),
        ("belady", 0.05), ("belady_host_only", 0.05), ("belady", 0.2), ("belady_host_only", 0.2)]
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
    engine.run()  # A's 3 whole blocks stay cached, unreferenced; 5 blocks free
    engine.add_request("R", [90 + i for i in range(8)], max_new_tokens=6)  # runs, holding 2 blocks
    engine.add_request("B", a + list(range(100, 116)), max_new_tokens=2)  # 3 hits + 4 new blocks: 1 short
    engine.step()
    # B cannot start yet: taking A's cached blocks for it would hand B its own hits twice
    assert [r.req_id for r in engine.running] == ["R"] and engine.requests["B"].block_ids == []
    engine.run()  # R finishes and frees its blocks; B runs on its 3 hits (checked at every step)
    assert engine.requests["B"].num_cached_tokens == 12
