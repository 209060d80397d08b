"""kvtier's Prometheus metrics (`kvtier.integrations.vllm.metrics.KVTierPromMetrics`) as the
registry holds them after the reports vLLM hands over."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY, Counter, Gauge, Histogram  # noqa: E402

from kvtier.integrations.vllm.metrics import TIER_COUNTERS, KVTierPromMetrics  # noqa: E402


def samples(name: str) -> dict[tuple, float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for m in REGISTRY.collect()
        for s in m.samples
        if s.name == name
    }


def value(name: str, **labels) -> float | None:
    return samples(name).get(tuple(sorted({"engine": "0", **labels}.items())))


@pytest.fixture
def prom() -> KVTierPromMetrics:
    return KVTierPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["engine"],
        {0: ["0"]},
    )


def test_a_tiers_counters_exist_at_zero_from_its_first_report(prom):
    """An alert such as increase(kvtier:tier_failures_total[5m]) > 0 sees a tier's first failure
    only if the series existed before it: every counter of a tier starts at 0 with its first report."""
    prom.observe({"counters": {}, "gauges": {"tier.disk.used_bytes": 4096}})
    assert value("kvtier:tier_failures_total", tier="disk", direction="load") == 0
    assert value("kvtier:tier_timeouts_total", tier="disk") == 0
    assert value("kvtier:load_decisions_total", tier="disk", decision="recompute") == 0
    # disk only: no tier that never reported
    assert len(samples("kvtier:tier_corrupt_total")) == 1
    assert all(
        value(
            f"kvtier:tier_{name}_total",
            tier="disk",
            **(
                {"direction": "store"} if name in ("chunks", "bytes", "seconds", "failures") else {}
            ),
        )
        == 0
        for name in TIER_COUNTERS
    )

    prom.observe(
        {
            "counters": {
                "tier.disk.load_failures": 2,
                "tier.redis.timeouts": 1,
                "load_decisions.partial.redis": 3,
            },
            "gauges": {},
        }
    )
    assert value("kvtier:tier_failures_total", tier="disk", direction="load") == 2
    assert value("kvtier:tier_failures_total", tier="disk", direction="store") == 0
    assert value("kvtier:tier_timeouts_total", tier="redis") == 1
    assert value("kvtier:load_decisions_total", tier="redis", decision="partial") == 3
    assert value("kvtier:load_decisions_total", tier="redis", decision="load") == 0


# -- what the scheduler side reports, step by step (`SchedulerSide.get_stats`) -----------------------


@pytest.fixture
def side(model):
    """A scheduler-side connector (no engine) on a clock the test moves."""
    from vllm_helpers import scheduler_connector

    _, connector = scheduler_connector(model, {"cpu_bytes": "1MiB"})
    side = connector._scheduler
    now = [100.0]
    side._clock = lambda: now[0]
    side.now = now
    yield connector
    connector.shutdown()


def a_request(req_id: str, num_tokens: int):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        req_id,
        list(range(1, num_tokens + 1)),
        SamplingParams(max_tokens=4),
        None,
        block_hasher=get_request_block_hasher(16, sha256),
    )


def a_step(connector, *req_ids: str) -> None:
    """vLLM plans a step of the running requests `req_ids` (one token each, no new blocks)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    n = len(req_ids)
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=list(req_ids),
        resumed_req_ids=set(),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None] * n,
        num_computed_tokens=[0] * n,
        num_output_tokens=[0] * n,
    )
    out.num_scheduled_tokens = dict.fromkeys(req_ids, 1)
    out.total_num_scheduled_tokens = n
    connector.build_connector_meta(out)


def test_a_busy_engine_gets_counters_each_step_and_gauges_once_a_second(side):
    """vLLM asks at every step; the gauges and the tiers' stats (the miss-ratio curves among them)
    are rebuilt at most once every `_REPORT_EVERY_S` while requests run, the counters' deltas
    shipped whenever one moved, and nothing counted is lost between full reports."""
    from kvtier.integrations.vllm.metrics import tier_stat_name
    from kvtier.integrations.vllm.scheduler_side import _REPORT_EVERY_S

    sched = side._scheduler
    request = a_request("r0", 64)
    side.get_num_new_matched_tokens(request, 0)
    a_step(side, "r0")
    first = side.get_kv_connector_stats()
    assert first is not None and "num_slots" in first.data["gauges"]
    # the same instant, nothing moved: nothing to ship
    assert side.get_kv_connector_stats() is None
    a_step(side, "r0")
    sched.core.stats.deferrals += 2
    second = side.get_kv_connector_stats()
    assert second.data == {"counters": {"deferrals": 2}, "gauges": {}}
    assert side.get_kv_connector_stats() is None
    sched.now[0] += _REPORT_EVERY_S / 2
    sched.core.stats.deferrals += 1
    assert side.get_kv_connector_stats().data == {"counters": {"deferrals": 1}, "gauges": {}}
    # a second after the last full report: one is due, counters moved or not
    sched.now[0] += _REPORT_EVERY_S
    third = side.get_kv_connector_stats()
    assert third.data["counters"] == {} and "num_slots" in third.data["gauges"]
    assert tier_stat_name("cpu", "used_bytes") in third.data["gauges"]


def test_the_step_that_ends_the_last_request_gets_a_full_report(side):
    """A client reads the metrics once its requests' outputs are back: the report of the step in
    which the last running request ended is a full one, whatever the clock says (vLLM steps on
    while kvtier's stores finish, but nobody waits for those steps' reports). A request that is no
    longer scheduled and never ended (a streaming-input session paused between turns) does not
    count as running."""
    sched = side._scheduler
    request = a_request("r0", 64)
    other = a_request("r1", 64)
    paused = a_request("s0", 64)
    for req in (request, other, paused):
        side.get_num_new_matched_tokens(req, 0)
    a_step(side, "r0", "r1", "s0")
    assert "num_slots" in side.get_kv_connector_stats().data["gauges"]
    a_step(side, "r0", "r1")
    sched.core.stats.deferrals += 1
    side.request_finished(request, [])
    # r1 still runs
    assert side.get_kv_connector_stats().data["gauges"] == {}
    a_step(side, "r1")
    side.request_finished(other, [])
    sched.core.stats.deferrals += 1
    last = side.get_kv_connector_stats()
    assert last.data["counters"] == {"deferrals": 1} and "num_slots" in last.data["gauges"]
