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
