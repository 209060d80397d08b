"""Load or recompute, where it matters (issue 22): vLLM on CPU, a shared tier slow on purpose.

Four engines of the tiny Llama (16 KiB of KV per token, chunks of 128 tokens = 2 MiB), pinned to
the same cores (`pin_reserved_cpus`), alive together, one run:

- **disk** (kvtier, cost): Redis reached directly, a disk tier, a RAM tier of `DISK_RAM_CHUNKS`
  chunks (LRU). It computes the prefixes the others meet: the "disk" ones, then the "slow"
  ones; all go to Redis and to disk, and the slow ones push the disk ones out of its RAM, so
  each disk prefix is then on disk only (checked: 8 promotions per disk hit, decided on tier
  "disk").
- **always** and **cost** (kvtier, `load_policy` "always" / "cost"), each reaching Redis through
  a `ThrottledProxy` of its own at `LINK_BYTES_PER_S`, and **none** (vLLM without kvtier). Each
  warms up (a tiny request takes the engine's cold first forward pass; then prompts of its own,
  a few tokens out: the cost model measures the prefill and, through the write-through stores,
  the link), then computes the "RAM" prefixes under a salt of its own (no engine finds
  another's in Redis); then the links drain.

Rounds, the engines' order turning each round, every request after
`reset_prefix_cache(reset_connector=False)` (vLLM's own cache serves nothing):
1. always, cost, none: a slow prefix (in Redis only, behind the link), then a RAM prefix (the
   engine without kvtier recomputes both).
2. always, cost, none: a prefix no one has seen (each engine's salt): what kvtier costs when it
   finds nothing, Redis probe included — the part of the cost engine's slow-prefix TTFT that
   is not its decision's.
3. disk: a disk prefix (promoted into RAM, then loaded; the deferrals — engine steps it waited
   for the promotion — counted), the same prefix again (its own prefix cache), again after a
   reset (a RAM-tier hit); none: the same prefix twice, the second a hit in its own prefix
   cache — the local hit a user compares with (bench_overlap's `hit_vs_local`).

TTFT is the wall time of `generate()` of one request with `max_tokens=1` (the request's whole
life: its waits, its forward pass, its one token); medians over the rounds.

    python benchmarks/bench_costmodel.py [--quick]

Last line: RESULT slow_vs_recompute=<cost / none, slow prefixes> always_vs_recompute=<always /
none, slow prefixes> fast_vs_recompute=<cost / none, RAM prefixes> disk_hit_vs_local=<disk-tier
hit / the engine without kvtier's prefix-cache hit>
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench_overlap import shutdown, tiny_llm, tokens
from servers.redis import RedisServer
from servers.throttle import ThrottledProxy

# 8 chunks: 16 MiB of KV
PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 32
# The tiny Llama recomputes ~1,000-1,300 tokens/s here: 16-21 MB/s of KV. At 4 MB/s a prefix
# loads 4-5x slower than it is recomputed (tests/test_vllm_e2e_remote.py's slow link too).
LINK_BYTES_PER_S = 4e6
# a load through the link (~4 s) must not be given up on
SLOW_ENGINE = {
    "cpu_bytes": "1GiB",
    "redis_timeout_ms": 60_000,
    "job_timeout_s": 60.0,
    "max_defer_s": 30.0,
    "max_deferrals": 100_000,
}
# the disk engine's RAM tier: 3 prefixes
DISK_RAM_CHUNKS = 24
DISK_ENGINE = {
    "cpu_bytes": f"{2 * DISK_RAM_CHUNKS}MiB",
    "eviction_policy": "lru",
    "disk_bytes": "4GiB",
}
# 640-token prompts of each engine's own
WARMUPS = 3


def make_engine(model: Path, extra: dict | None):
    from kvtier.integrations.vllm import kv_transfer_config

    transfer = None if extra is None else kv_transfer_config(**extra)
    return tiny_llm(model, transfer, disable_log_stats=extra is None)


def ttft(llm, prompt: list[int], salt: str | None = None, max_tokens: int = 1) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    request = TokensPrompt(
        prompt_token_ids=prompt, **({} if salt is None else {"cache_salt": salt})
    )
    started = time.perf_counter()
    llm.generate([request], params, use_tqdm=False)
    return time.perf_counter() - started


class Metrics:
    """One engine's `kvtier:` metrics. Each engine built replaces the previous one's in the
    registry (`KVTierPromMetrics`); they stay live for their engine, so they are taken here
    right after it is built."""

    def __init__(self) -> None:
        from prometheus_client import REGISTRY

        self.collectors = [
            c
            for c in list(REGISTRY._collector_to_names)
            if getattr(c, "_name", "").startswith("kvtier:")
        ]

    def __call__(self, name: str, **labels: str) -> float:
        return sum(
            s.value
            for c in self.collectors
            for family in c.collect()
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def decisions(self) -> dict[str, int]:
        return {
            f"{s.labels['decision']}/{s.labels['tier']}": int(s.value)
            for c in self.collectors
            for family in c.collect()
            for s in family.samples
            if s.name == "kvtier:load_decisions_total"
        }

    def estimates(self) -> str:
        reads = {
            t: self("kvtier:tier_read_bytes_per_second", tier=t) for t in ("cpu", "disk", "redis")
        }
        return (
            f"prefill {self('kvtier:prefill_tokens_per_second'):,.0f} tokens/s, reads "
            + ", ".join(f"{t} {v / 1e6:,.1f} MB/s" for t, v in reads.items() if v)
        )


def warm_up(llm, salt: str) -> None:
    """The engine's first forward pass is cold (~10 s here, whatever its size); then prefill steps
    followed by decode steps (what the prefill estimate measures), under the engine's own salt."""
    ttft(llm, tokens(8, seed=1), salt=salt)
    for i in range(WARMUPS):
        ttft(llm, tokens(640, seed=700 + i), salt=salt, max_tokens=4)


def drain(proxies: list[ThrottledProxy], quiet_s: float = 1.5, timeout_s: float = 180.0) -> None:
    """Until no link has carried a byte for `quiet_s` (the engines' write-through is done)."""
    deadline = time.monotonic() + timeout_s
    last = None
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        now = [p.bytes_forwarded for p in proxies]
        if now != last:
            last = now
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.25)


def start_disk_engine(
    model: Path, url: str, disk_path: str, disk: list[list[int]], slow: list[list[int]]
):
    llm = make_engine(model, {**DISK_ENGINE, "redis_url": url, "disk_path": disk_path})
    metrics = Metrics()
    warm_up(llm, "disk")
    # the slow ones push the disk ones out of its RAM tier
    for prefix in disk + slow:
        ttft(llm, prefix, max_tokens=4)
    return llm, metrics


def link_rounds(engines: dict, metrics: dict, slow: list[list[int]], ram: list[list[int]]) -> dict:
    """Per engine: TTFTs of requests on slow prefixes and on RAM prefixes, the order rotating;
    the deferrals of each slow request (kvtier engines)."""
    names = list(engines)
    times = {name: {"slow": [], "ram": [], "new": [], "deferrals": []} for name in names}
    for r, (slow_prefix, ram_prefix) in enumerate(zip(slow, ram, strict=True)):
        suffix = tokens(SUFFIX_TOKENS, seed=9000 + r)
        for name in names[r % 3 :] + names[: r % 3]:
            llm = engines[name]
            m = metrics.get(name)
            llm.reset_prefix_cache(reset_connector=False)
            deferrals = m("kvtier:deferrals_total") if m else 0.0
            times[name]["slow"].append(ttft(llm, slow_prefix + suffix))
            times[name]["deferrals"].append(
                int(m("kvtier:deferrals_total") - deferrals) if m else 0
            )
            llm.reset_prefix_cache(reset_connector=False)
            times[name]["ram"].append(ttft(llm, ram_prefix + suffix, salt=name))
    return times


def new_prefix_rounds(engines: dict, times: dict, prefixes: list[list[int]]) -> None:
    """Per engine: TTFTs of requests on prefixes no one has seen (their stores go through the
    links afterwards, so this pass comes after the slow-prefix rounds)."""
    names = list(engines)
    for r, prefix in enumerate(prefixes):
        for name in names[r % 3 :] + names[: r % 3]:
            engines[name].reset_prefix_cache(reset_connector=False)
            times[name]["new"].append(ttft(engines[name], prefix, salt=name))


def start_link_engines(
    stack: ExitStack, model: Path, server: RedisServer, ram: list[list[int]]
) -> tuple:
    """always, cost (each behind a link of its own) and none, warmed up, RAM prefixes computed,
    links drained; their metrics (the kvtier ones)."""
    links = {
        name: stack.enter_context(ThrottledProxy(server.port, LINK_BYTES_PER_S))
        for name in ("always", "cost")
    }
    engines: dict = {}
    # before the links close
    stack.callback(shutdown_all, engines)
    metrics = {}
    # each link drains while the next engine starts
    for name in ("always", "cost", "none"):
        extra = (
            None
            if name == "none"
            else {
                **SLOW_ENGINE,
                "load_policy": name,
                "redis_url": f"redis://{server.host}:{links[name].port}",
            }
        )
        engines[name] = make_engine(model, extra)
        if extra is not None:
            metrics[name] = Metrics()
        warm_up(engines[name], name)
        for prefix in ram:
            ttft(engines[name], prefix, salt=name)
    drain(list(links.values()))
    # a step reports the estimates as they are now (the gauges are a step's)
    for name in metrics:
        ttft(engines[name], tokens(8, seed=2), salt=name)
    print(f"cost engine before the rounds: {metrics['cost'].estimates()}")
    return engines, metrics


def shutdown_all(engines: dict) -> None:
    for llm in engines.values():
        shutdown(llm)


def disk_rounds(llm, metrics: Metrics, none, prefixes: list[list[int]]) -> dict[str, list]:
    print(f"disk engine before its rounds: {metrics.estimates()}")
    times: dict[str, list] = {
        k: [] for k in ("disk", "own_local", "ram", "local", "deferrals", "promotions")
    }
    counted = {"deferrals": "kvtier:deferrals_total", "promotions": "kvtier:tier_promotions_total"}
    for r, prefix in enumerate(prefixes):
        suffixes = [tokens(SUFFIX_TOKENS, seed=9500 + 3 * r + i) for i in range(3)]
        for side in ("disk", "none") if r % 2 == 0 else ("none", "disk"):
            if side == "none":
                none.reset_prefix_cache(reset_connector=False)
                # computed: now in its prefix cache
                ttft(none, prefix + suffixes[0])
                times["local"].append(ttft(none, prefix + suffixes[1]))
                continue
            llm.reset_prefix_cache(reset_connector=False)
            before = {what: metrics(name) for what, name in counted.items()}
            # only on disk: promoted, then loaded
            times["disk"].append(ttft(llm, prefix + suffixes[0]))
            for what, name in counted.items():
                times[what].append(int(metrics(name) - before[what]))
            # its own prefix cache
            times["own_local"].append(ttft(llm, prefix + suffixes[1]))
            llm.reset_prefix_cache(reset_connector=False)
            # promoted above: now in RAM
            times["ram"].append(ttft(llm, prefix + suffixes[2]))
    print(f"disk engine: decisions {metrics.decisions()}; {metrics.estimates()}")
    return times


def run(model: Path, rounds: int) -> tuple[dict, dict]:
    slow, ram, disk, new = (
        [tokens(PREFIX_TOKENS, seed=seed + r) for r in range(rounds)]
        for seed in (100, 200, 300, 400)
    )
    with ExitStack() as stack:
        disk_path = tempfile.mkdtemp(prefix="kvtier-bench-disk-")
        stack.callback(shutil.rmtree, disk_path, ignore_errors=True)
        server = RedisServer.temporary()
        stack.callback(server.close)
        server.start()
        disk_llm, disk_metrics = start_disk_engine(model, server.url, disk_path, disk, slow)
        stack.callback(shutdown, disk_llm)
        engines, metrics = start_link_engines(stack, model, server, ram)
        link = link_rounds(engines, metrics, slow, ram)
        new_prefix_rounds(engines, link, [p + tokens(SUFFIX_TOKENS, seed=9900) for p in new])
        for name, m in metrics.items():
            print(
                f"{name}: decisions {m.decisions()}, promotions {m('kvtier:tier_promotions_total'):.0f}, "
                f"hit tokens {m('kvtier:hit_tokens_total'):.0f}, deferrals per slow request "
                f"{link[name]['deferrals']}; {m.estimates()}"
            )
        return link, disk_rounds(disk_llm, disk_metrics, engines["none"], disk)


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.1f}"


def report(link: dict, disk: dict, rounds: int) -> None:
    med = {
        name: {k: statistics.median(v) for k, v in t.items() if k != "deferrals"}
        for name, t in link.items()
    }
    print(
        f"\nTTFT medians over {rounds} rounds (ms), {PREFIX_TOKENS}-token prefixes + {SUFFIX_TOKENS} new tokens, "
        f"link {LINK_BYTES_PER_S / 1e6:.0f} MB/s"
    )
    print(f"{'engine':8} {'slow prefix':>12} {'RAM prefix':>11} {'new prefix':>11}")
    for name, t in link.items():
        print(f"{name:8} {ms(t['slow']):>12} {ms(t['ram']):>11} {ms(t['new']):>11}")
    print(
        f"disk engine: disk-tier hit {ms(disk['disk'])}, RAM-tier hit {ms(disk['ram'])}, own prefix-cache hit "
        f"{ms(disk['own_local'])}; engine without kvtier, prefix-cache hit {ms(disk['local'])}"
    )
    print(f"per disk hit: deferrals {disk['deferrals']}, promotions {disk['promotions']}")
    none = med["none"]
    always = med["always"]
    cost = med["cost"]
    local = statistics.median(disk["local"])
    print(
        f"RAM prefix, always / recompute {always['ram'] / none['ram']:.3f}; new prefix, cost / none "
        f"{cost['new'] / none['new']:.3f}; cost engine, slow prefix / new prefix {cost['slow'] / cost['new']:.3f}; "
        f"RAM-tier hit / local hit {statistics.median(disk['ram']) / local:.3f}; disk-tier hit / own local hit "
        f"{statistics.median(disk['disk']) / statistics.median(disk['own_local']):.3f}"
    )
    print(
        f"RESULT slow_vs_recompute={cost['slow'] / none['slow']:.3f} "
        f"always_vs_recompute={always['slow'] / none['slow']:.3f} fast_vs_recompute={cost['ram'] / none['ram']:.3f} "
        f"disk_hit_vs_local={statistics.median(disk['disk']) / local:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    args = parser.parse_args()
    rounds = 3 if args.quick else 7
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault(
        # as bench_overlap: glibc's arena trimming varies per engine instance
        "GLIBC_TUNABLES",
        "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824",
    )
    from kvtier.integrations.vllm.binding import pin_reserved_cpus
    from kvtier.integrations.vllm.tiny_model import ensure_tiny_llama

    pin_reserved_cpus()
    model = ensure_tiny_llama(
        Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"))
    )
    link, disk = run(model, rounds)
    report(link, disk, rounds)


if __name__ == "__main__":
    main()
