"""`kvtier status URL`: each tier's predicted hit ratio at other sizes, read from a real HTTP server's
`/metrics` on a loopback port, with one line of advice per tier; clear errors otherwise.
"""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from helpers import HANG_S, keys
from kvtier.cli.main import main
from kvtier.cli.status import TierCurve, advice, parse_curves
from tier_helpers import CTX, make_tiered, put, settle

PAGE = """\
# HELP kvtier:tier_predicted_hit_ratio The hit ratio a tier would get ...
# TYPE kvtier:tier_predicted_hit_ratio gauge
{ratios}
# TYPE kvtier:tier_capacity_bytes gauge
kvtier:tier_capacity_bytes{{engine="0",model_name="tiny",tier="cpu"}} 4294967296.0
kvtier:tier_capacity_bytes{{engine="0",model_name="tiny",tier="disk"}} 1.7179869184e+10
vllm:num_requests_running{{engine="0",model_name="tiny"}} 0.0
"""
CURVES = {
    "cpu": (0.05, 0.09, 0.21, 0.34, 0.41, 0.43),
    "disk": (0.40, 0.55, 0.61, 0.612, 0.62, 0.62),
}
FACTORS = ("0.25", "0.5", "1", "2", "4", "8")


def page(curves: dict[str, tuple[float, ...]]) -> str:
    ratios = "\n".join(
        f'kvtier:tier_predicted_hit_ratio{{engine="0",model_name="tiny",tier="{tier}",'
        f'capacity_factor="{f}"}} {r}'
        for tier, rs in curves.items()
        for f, r in zip(FACTORS, rs, strict=True)
    )
    return PAGE.format(ratios=ratios)


@contextlib.contextmanager
def serving(text: str, path: str = "/metrics") -> Iterator[str]:
    """A real HTTP server on a loopback port answering `path` with `text`; yields its address."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = text.encode()
            self.send_response(200 if self.path == path else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body if self.path == path else b"not found")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run_status(capsys, url: str) -> tuple[int, str, str]:
    status = main(["status", url, "--timeout", str(HANG_S)])
    out, err = capsys.readouterr()
    return status, out, err


def test_status_prints_each_tiers_curve_and_advice(capsys):
    with serving(page(CURVES)) as url:
        # the bare address: /metrics is appended
        status, out, err = run_status(capsys, url)
    # the screen, for the record (pytest -s)
    print(out)
    assert status == 0 and err == ""
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith(("cpu ", "disk "))
    }
    assert rows["cpu"][1:3] == ["4.0", "GiB"] and rows["cpu"][3:] == [
        "0.05",
        "0.09",
        "0.21",
        "0.34",
        "0.41",
        "0.43",
    ]
    assert rows["disk"][1:3] == ["16.0", "GiB"]
    assert "cpu: doubling cpu_bytes would raise its hit ratio from 0.21 to 0.34" in out
    # the disk curve is flat above 1x, and 0.5x would lose 0.06
    assert "disk: doubling disk_bytes would not help (0.61 -> 0.61): it is sized about right" in out


def test_advice_names_a_tier_with_room_to_spare_and_the_setting_of_each_tier():
    flat = TierCurve("redis", ratios={0.5: 0.30, 1.0: 0.305, 2.0: 0.31})
    assert advice(flat) == (
        "redis: halving the Redis server's maxmemory would lower its hit ratio only from "
        "0.30 to 0.30: it has more room than this traffic reuses"
    )
    assert advice(TierCurve("s3", ratios={1.0: 0.1, 2.0: 0.2})).startswith(
        "s3: doubling what the S3 bucket keeps"
    )


def test_status_of_an_unreachable_server_is_a_one_line_error(capsys):
    with serving("") as url:
        # closed: nothing listens on that port now
        pass
    status, out, err = run_status(capsys, url)
    assert status == 2 and out == ""
    assert (
        err.startswith(f"kvtier status: cannot read {url}/metrics:")
        and "is the server running" in err
    )


def test_status_of_a_page_without_kvtier_curves_says_why(capsys):
    with serving('vllm:num_requests_running{engine="0"} 0.0\n') as url:
        status, _, err = run_status(capsys, url + "/metrics")
    assert status == 2 and "no kvtier metrics at all" in err
    with serving('kvtier:num_slots{engine="0"} 8.0\n') as url:
        status, _, err = run_status(capsys, url)
    assert status == 2 and "no tier has been looked up yet" in err


def test_two_engines_get_a_row_each():
    text = page(CURVES) + page({"cpu": CURVES["cpu"]}).replace('engine="0"', 'engine="1"')
    curves = parse_curves(text)
    assert [(c.tier, c.engine) for c in curves] == [("cpu", "0"), ("disk", "0"), ("cpu", "1")]


def test_a_tiers_lookups_reach_the_status_screen_through_prometheus(tmp_path, capsys):
    """Tier lookups -> the scheduler side's report (`_add_tier_stats`, what get_stats() sends each
    step) -> kvtier's Prometheus metrics -> the registry's text page -> `kvtier status`."""
    pytest.importorskip("vllm")
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest

    from kvtier.integrations.vllm.metrics import KVTierPromMetrics, KVTierStats
    from kvtier.integrations.vllm.scheduler_side import SchedulerSide

    manager, slabs = make_tiered(tmp_path, num_slots=2, disk_chunks=16)
    # RAM holds 2 chunks: 1 and 2 end up on disk only
    for batch in (keys(1, 2), keys(3, 4)):
        put(manager, slabs, batch)
        settle(manager)
    # a request's scan, then its admission
    for k in keys(3, 1):
        manager.lookup(k, CTX)
    manager.count_query(keys(3, 1), CTX)
    side = SimpleNamespace(
        core=SimpleNamespace(manager=manager), payload_bytes=4096, _reported_tiers={}
    )
    stats = KVTierStats()
    SchedulerSide._add_tier_stats(side, stats, manager.stats())
    prom = KVTierPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["engine"],
        {0: ["0"]},
    )
    prom.observe(stats.data)
    samples = {
        (s.labels["tier"], s.labels["capacity_factor"]): s.value
        for m in REGISTRY.collect()
        for s in m.samples
        if s.name == "kvtier:tier_predicted_hit_ratio"
    }
    assert (
        {f for t, f in samples if t == "cpu"}
        == set(FACTORS)
        == {f for t, f in samples if t == "disk"}
    )
    assert samples["cpu", "8"] == stats.data["gauges"]["tier.cpu.predicted_hit_ratio.8"]
    with serving(generate_latest(REGISTRY).decode()) as url:
        status, out, _ = run_status(capsys, url)
    print(out)
    assert status == 0
    assert [line.split()[0] for line in out.splitlines() if line.startswith(("cpu ", "disk "))] == [
        "cpu",
        "disk",
    ]
    assert "disk: doubling disk_bytes" in out or "disk: halving disk_bytes" in out
