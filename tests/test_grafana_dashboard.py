"""docs/grafana/kvtier.json against a real Prometheus scraping `kvtier serve`.

Grafana itself is not packaged here; what breaks a dashboard is its queries (a renamed metric, a
label that is not there, a PromQL typo), and those a real Prometheus checks. One `kvtier serve` for
the module (the tiny model; an 8-chunk CPU tier with disk and Redis behind it; the engine's own
prefix cache off, so repeated prefixes come from kvtier), Debian's `prometheus` scraping its
/metrics every second, a short workload, then every query of every panel through Prometheus's
HTTP API must return data.

The workload makes what each panel shows happen: repeated prefixes (hits, load decisions),
more prompts than the CPU tier holds (evictions, reads back from disk and Redis), and a Redis
stalled for a moment (SIGSTOP: operation timeouts, its circuit breaker opens, and closes again).
Every wait is bounded; Prometheus keeps its data in a temporary folder and listens on loopback only.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from redis_servers import RedisServer
from serve_helpers import KVTIER, Server, free_port
from vllm_helpers import tokens

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "kvtier.json"
PROMETHEUS = shutil.which("prometheus")
SCRAPE_INTERVAL_S = 1
PROMETHEUS_START_TIMEOUT_S = 60
# for a counter to reach /metrics, or Prometheus to scrape it (busy cores)
WAIT_TIMEOUT_S = 90
# Grafana's variables, as the test sets them: every model; a window that covers the whole workload
VARIABLES = {"$model_name": ".*", "$__rate_interval": "10m"}
MRC_METRIC = "kvtier:tier_predicted_hit_ratio"
# the tiny model's block, one chunk (blocks_per_chunk 1): 1 MiB of KV
CHUNK_TOKENS = 128


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def query_panels() -> list[dict]:
    return [panel for panel in load_dashboard()["panels"] if panel["type"] != "row"]


def promql(expr: str) -> str:
    """A target's expression as Grafana sends it, with the test's variable values."""
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a variable the test does not set: {expr}"
    return expr


# --- the dashboard as a Grafana JSON model (no server needed) ---


def test_dashboard_is_a_grafana_model_on_a_prometheus_datasource_variable():
    dashboard = load_dashboard()
    assert dashboard["uid"] == "kvtier" and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource"
        and variables["datasource"]["query"] == "prometheus"
    )
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in query_panels():
        # every panel and target reads the chosen Prometheus, never a datasource of the author's Grafana
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and {"h", "w", "x", "y"} <= panel["gridPos"].keys(), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        for target in panel["targets"]:
            assert (
                target["datasource"] == panel["datasource"] and target["refId"] and target["expr"]
            )
            promql(target["expr"])


def test_dashboard_shows_what_the_issue_asks_for():
    exprs = " ".join(t["expr"] for panel in query_panels() for t in panel["targets"])
    for metric in (
        "kvtier:hit_tokens_total",
        "kvtier:transfer_bytes_total",
        "kvtier:transfer_seconds_total",
        "kvtier:tier_bytes_total",
        "kvtier:tier_seconds_total",
        "kvtier:deferrals_total",
        "kvtier:deferral_timeouts_total",
        "kvtier:tier_timeouts_total",
        "kvtier:tier_breaker_open",
        "kvtier:load_decisions_total",
        MRC_METRIC,
    ):
        assert metric in exprs, f"no panel shows {metric}"


# --- against a real Prometheus ---


class Prometheus:
    """A `prometheus` subprocess scraping one target, its data in `root`, on a loopback port."""

    def __init__(self, binary: str, target: str, root: Path):
        self.url = f"http://127.0.0.1:{free_port()}"
        config = root / "prometheus.yml"
        config.write_text(
            json.dumps(
                # JSON is YAML
                {
                    "global": {
                        "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                        "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
                    },
                    "scrape_configs": [
                        {"job_name": "kvtier", "static_configs": [{"targets": [target]}]}
                    ],
                }
            )
        )
        self.log_path = root / "prometheus.log"
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.loads(response.read())
        # a bad query: 400 with Prometheus's reason in the body
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())

    def wait_ready(self) -> None:
        deadline = time.monotonic() + PROMETHEUS_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"prometheus exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        pytest.fail(
            f"prometheus not ready after {PROMETHEUS_START_TIMEOUT_S} s:\n{self.log_tail()}"
        )

    def query(self, expr: str) -> list[dict]:
        """An instant query's result (a list of series); fails the test on a query Prometheus rejects."""
        answer = self.get("/api/v1/query", query=expr)
        assert answer["status"] == "success", f"Prometheus rejected {expr}: {answer.get('error')}"
        return answer["data"]["result"]

    def wait_for_result(self, expr: str, timeout_s: float = WAIT_TIMEOUT_S) -> list[dict]:
        """The query's result once it has one (what the server counted may not be scraped yet)."""
        deadline = time.monotonic() + timeout_s
        while not (result := self.query(expr)) and time.monotonic() < deadline:
            time.sleep(SCRAPE_INTERVAL_S)
        return result

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


@dataclass
class Stack:
    server: Server
    prometheus: Prometheus
    redis: RedisServer


# before the session's model and Redis: without it, nothing starts
@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    if PROMETHEUS is None:
        pytest.skip(
            "the prometheus binary is not on PATH (`make servers` installs Debian's prometheus)"
        )
    return PROMETHEUS


@pytest.fixture(scope="module")
def stack(prometheus_binary, model, redis_server, tmp_path_factory) -> Iterator[Stack]:
    """`kvtier serve` with an 8-chunk CPU tier, disk and Redis, and a Prometheus scraping it."""
    assert KVTIER is not None, "pip install -e . installs the `kvtier` console script"
    root = tmp_path_factory.mktemp("dashboard")
    # running, not paused, empty
    redis_server.ready()
    server = Server(
        model,
        root / "server.log",
        (
            "--no-enable-prefix-caching",
            "--cpu-bytes",
            "8MiB",
            "--disk-path",
            str(root / "disk"),
            "--disk-bytes",
            "64MiB",
            "--redis-url",
            redis_server.url,
            "--remote-prefix",
            "kvtier-dashboard",
            "--redis-timeout-ms",
            "300",
            "--redis-connect-timeout-ms",
            "300",
            "--remote-breaker-failures",
            "2",
            "--remote-breaker-retry-s",
            "0.2",
        ),
    )
    prometheus = None
    try:
        prometheus = Prometheus(prometheus_binary, server.url.removeprefix("http://"), root)
        server.wait_ready()
        prometheus.wait_ready()
        yield Stack(server, prometheus, redis_server)
    finally:
        if prometheus is not None:
            prometheus.stop()
        server.stop()


def complete(server: Server, prompt: list[int]) -> None:
    status, body = server.post(
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    assert status == 200, body


def scraped_total(server: Server, name: str) -> float:
    """A kvtier sample /metrics shows now, summed over its labels (a tier's counters exist at 0
    from its first report, so a wait is on their values, not their names)."""
    status, text = server.get("/metrics")
    assert status == 200
    return sum(
        float(line.rsplit(None, 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in "{ "
    )


def drive_until(server: Server, done: Callable[[], bool], what: str) -> None:
    """Small requests (each engine step reports kvtier's counters) until `done()`, bounded."""
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    seed = 1000
    while not done():
        assert (
            time.monotonic() < deadline
        ), f"not seen in {WAIT_TIMEOUT_S} s: {what}\n{server.log_tail()}"
        seed += 1
        complete(server, tokens(CHUNK_TOKENS + 10, seed=seed))


@pytest.fixture(scope="module")
def scraped(stack) -> tuple[Server, Prometheus]:
    """The stack after the workload, once Prometheus has scraped its end."""
    server, prometheus = stack.server, stack.prometheus
    prompts = {
        name: tokens(4 * CHUNK_TOKENS + 40, seed=seed) for seed, name in enumerate("abc", start=70)
    }
    # stores a's 4 chunks in RAM, on disk and in Redis
    complete(server, prompts["a"])
    # the hit ratio is a rate(): Prometheus must hold a sample from before the hits, or they are
    # in its first sample and never counted (the next request takes well under a 1 s scrape)
    assert prometheus.wait_for_result("kvtier:hit_tokens_total"), prometheus.log_tail()
    # the same 4 chunks again: loaded from RAM
    complete(server, prompts["a"][:-5] + [7, 7, 7, 7, 7])
    # 8 chunks in RAM: full
    complete(server, prompts["b"])
    # evicts a's chunks (RAM holds 8)
    complete(server, prompts["c"])
    # a again, from disk or Redis: loaded or recomputed as the cost model decides
    complete(server, prompts["a"])
    # Redis stalls: its operations time out, 2 failures in a row open its breaker
    with stack.redis.paused():
        drive_until(
            server,
            lambda: scraped_total(server, "kvtier:tier_timeouts_total") > 0
            and scraped_total(server, "kvtier:tier_breaker_opens_total") > 0,
            "a Redis timeout and its breaker opening",
        )
    # it answers again: a ping 0.2 s later closes the breaker
    drive_until(
        server,
        lambda: scraped_total(server, "kvtier:tier_breaker_closes_total") > 0,
        "the breaker closing",
    )
    # Prometheus has scraped the end of the workload
    assert prometheus.wait_for_result("kvtier:tier_breaker_closes_total > 0"), prometheus.log_tail()
    return server, prometheus


@pytest.mark.parametrize("panel", query_panels(), ids=lambda panel: panel["title"])
def test_every_panel_query_returns_data_from_prometheus(scraped, panel):
    _, prometheus = scraped
    exprs = [promql(target["expr"]) for target in panel["targets"]]
    results = {expr: prometheus.wait_for_result(expr) for expr in exprs}
    # shown with -rP
    for expr, result in results.items():
        print(
            f"{expr}\n  -> "
            + ", ".join(f"{series['metric']}={series['value'][1]}" for series in result)
        )
    empty = [expr for expr, result in results.items() if not result]
    assert not empty, f"no data from Prometheus for panel {panel['title']!r}: {empty}"


def test_the_workload_hit_and_the_model_variable_finds_the_model(scraped):
    server, prometheus = scraped
    hit_ratio = next(panel for panel in query_panels() if "hit ratio (all tiers)" in panel["title"])
    (series,) = prometheus.query(promql(hit_ratio["targets"][0]["expr"]))
    # a's second request hit its 4 chunks; the rest missed
    assert 0 < float(series["value"][1]) < 1, series
    assert prometheus.query(
        "sum(kvtier:tier_breaker_opens_total) >= 1"
    ), "the Redis stall opened no breaker"
    # the dashboard's model_name variable: label_values(kvtier:num_slots, model_name)
    (variable,) = [v for v in load_dashboard()["templating"]["list"] if v["name"] == "model_name"]
    metric, label = re.fullmatch(
        r"label_values\((.+), (\w+)\)", variable["query"]["query"]
    ).groups()
    answer = prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": metric})
    assert answer["data"] == ["tiny"], answer
