"""Loads that never stall the batch, and what kvtier costs when it cannot help (vLLM on CPU).

Three engines, alive together and pinned to the same cores (`pin_reserved_cpus`): vLLM without
kvtier, kvtier with `load_mode="async"`, kvtier with `load_mode="sync"` (the default). Each runs:

1. **Overlap**: background requests decode steadily; then requests whose 1,536-token prefixes
   kvtier holds (stored beforehand; vLLM's prefix cache emptied) arrive all at once. Printed:
   the background requests' inter-token latency p50/p99 (per engine step, from the wall clock
   of `LLMEngine.step`), and the loading requests' TTFT (arrival to first token). Without
   kvtier those prefixes are recomputed.
2. **Hit vs local**, as a user compares them: 3 documents of 1,536 tokens (stored once, not
   timed), then each asked again with a new 32-token suffix, 4 greedy tokens out, one request
   at a time. vLLM without kvtier serves the repeats from its own prefix cache; the kvtier
   engines empty theirs before each request (`reset_prefix_cache(reset_connector=False)`, not
   timed), so every prefix comes from kvtier's CPU tier. `hit_vs_local` = kvtier sync / no
   kvtier (`_async` for the async mode). The connector's fixed per-step costs count here, as
   users see them.
3. **Zero hit** (no reuse at all): unique 768-token prompts, 4 tokens each, one request at a
   time: `zero_hit_overhead` = kvtier sync / no kvtier (`_async` for the async mode).
4. `hit_vs_own_local`, the older figure: within the sync engine, its kvtier hit against its own
   prefix-cache hit (the connector's fixed costs on both sides, cancelling).

Parts 2 and 3 are measured in **pairs**, interleaved request by request: pair k is the same
request on every engine, back to back, the engines' order running through all their
permutations (with three engines each precedes each other in half the pairs), so drift and
whatever one engine leaves behind in the caches hit all alike. Each ratio is the geometric mean
of the per-pair ratios with Student's t 95 % interval on their logs, and the median per-pair
ratio with its order-statistic 95 % interval (`_median`, `_median_ci`; `paired_stats`): another
process's burst slows one side of a pair 2-5x on a shared machine and widens the former most.
The printout says about how many pairs would bring the t interval to ±1 % (`--pairs`).

Both intervals cover the noise between requests of one set of engines, not the difference
between sets of engines, which can be larger: on a shared machine, two runs of the same code and
settings minutes apart gave `hit_vs_local_median` 1.014 (1.003-1.025) and 0.850 (0.777-0.894).
`--instances R` starts the three engines R times one after the other, and adds each set's
median ratio and the t interval across the sets (`_instances`, `_instances_ci`): 4 sets of 100
pairs (`--instances 4 --pairs 100`, 11 min) gave `zero_hit_overhead_instances` 1.000
(0.993-1.007) and `hit_vs_local_instances` 1.052 (1.027-1.077). Parts 1 and 4 run on the first
set only.

glibc's malloc tunables are set for every engine (`GLIBC_TUNABLES`, unless already set;
`--no-malloc-tunables` leaves glibc's defaults, as a user runs): its arena trimming faults pages
back in at a rate that varies per engine instance, not per configuration. A hit request takes
0-7 minor page faults in its engine's processes either way (printed): two runs without the
tunables gave `hit_vs_local_median` 1.070 and 0.998, within the spread of runs with them.

    python benchmarks/bench_overlap.py [--quick] [--pairs N] [--instances R] [--no-malloc-tunables]
        [--walls]

Last line: RESULT itl_p99_ratio_async=… itl_p99_ratio_sync=… ttft_ratio_async=…
zero_hit_overhead=… hit_vs_local=… zero_hit_overhead_async=… hit_vs_local_async=… hit_vs_own_local=…
zero_hit_overhead_ci=<low>-<high> hit_vs_local_ci=… zero_hit_overhead_async_ci=…
hit_vs_local_async_ci=… zero_hit_overhead_median=… zero_hit_overhead_median_ci=<low>-<high> (and
the same two for the other three ratios) pairs=<n> [zero_hit_overhead_instances=…
zero_hit_overhead_instances_ci=<low>-<high> (the same for the other three) instances=<R>]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from paired_stats import RatioCI, median_ratio, paired_ratio

PREFIX_TOKENS = 1536
NUM_DOCUMENTS = 3
SUFFIX_TOKENS = 32
ZERO_HIT_PROMPT_TOKENS = 768
# every request of parts 2 and 3
OUTPUT_TOKENS = 4
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def tiny_llm(model: Path, transfer: Any, **settings):
    """An offline `LLM` of the tiny Llama as the end-to-end benchmarks serve it (token ids in,
    fp32, eager, seed 0), with `transfer` as its KV transfer config (None: no connector) and
    `settings` as further `LLM` arguments (bench_costmodel and bench_pd build theirs here too)."""
    from vllm import LLM

    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        max_model_len=4096,
        kv_transfer_config=transfer,
        **settings,
    )


def make_engine(model: Path, mode: str | None):
    from kvtier.integrations.vllm import kv_transfer_config

    transfer = None if mode is None else kv_transfer_config(cpu_bytes="2GiB", load_mode=mode)
    return tiny_llm(model, transfer)


def overlap(llm, num_background: int, num_loading: int) -> dict[str, list[float]]:
    """Background decodes + loading requests arriving together; ITLs of the former, TTFTs of the latter."""
    from vllm.inputs import TokensPrompt

    prefixes = [tokens(PREFIX_TOKENS, seed=1000 + i) for i in range(num_loading)]
    # stored
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prefixes], params(1), use_tqdm=False)
    llm.reset_prefix_cache(reset_connector=False)
    engine = llm.llm_engine
    for i in range(num_background):
        engine.add_request(
            f"bg{i}", TokensPrompt(prompt_token_ids=tokens(128, seed=2000 + i)), params(64)
        )
    last_token: dict[str, float] = {}
    itls: list[float] = []
    ttfts: list[float] = []
    arrived: dict[str, float] = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        num_steps += 1
        # the background requests are decoding: the loading ones arrive
        if num_steps == 4:
            for i, p in enumerate(prefixes):
                engine.add_request(
                    f"ld{i}",
                    TokensPrompt(prompt_token_ids=p + tokens(32, seed=3000 + i)),
                    params(4),
                )
                arrived[f"ld{i}"] = time.perf_counter()
        for out in outs:
            rid = out.request_id
            if rid.startswith("bg") and out.outputs and out.outputs[0].token_ids:
                if rid in last_token:
                    itls.append(now - last_token[rid])
                last_token[rid] = now
            # a loading request's first output: its first token
            elif rid in arrived:
                ttfts.append(now - arrived.pop(rid))
    return {"itl": itls, "ttft": ttfts}


class Served(NamedTuple):
    """One request: its `generate()` wall time, and the prompt tokens it did not compute."""

    seconds: float
    # vLLM's prefix-cache hits plus the connector's (kvtier's loads)
    num_cached_tokens: int


def serve_one(llm, prompt: list[int]) -> Served:
    """One `generate()` of `prompt`, OUTPUT_TOKENS greedy tokens."""
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)], params(OUTPUT_TOKENS), use_tqdm=False
    )
    return Served(time.perf_counter() - started, outs[0].num_cached_tokens or 0)


def timed(llm, prompt: list[int]) -> float:
    """Wall time of one `generate()` of `prompt`, OUTPUT_TOKENS greedy tokens."""
    return serve_one(llm, prompt).seconds


def paired_walls(
    engines: dict, num_pairs: int, serve: Callable[[str, object, int], float]
) -> dict[str, list[float]]:
    """`serve(name, llm, k)` on every engine for each pair k: the walls, per engine in pair order.

    The engines' order runs through all their permutations, one per pair: with two engines
    A,B then B,A; with three, each engine precedes each other one in half the pairs.
    """
    orders = list(itertools.permutations(engines))
    walls: dict[str, list[float]] = {name: [] for name in engines}
    for k in range(num_pairs):
        for name in orders[k % len(orders)]:
            walls[name].append(serve(name, engines[name], k))
    return walls


def child_pids() -> set[int]:
    """This process's descendants now (an engine's core and worker processes among them)."""
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def minor_faults(pids: list[int]) -> int:
    """The minor page faults the processes `pids` have taken so far (`/proc/<pid>/stat`)."""
    total = 0
    for pid in pids:
        # the fields after the command's closing parenthesis start at the 3rd; minflt is the 10th
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[7])
    return total


class HitWalls(NamedTuple):
    """Part 2's walls per engine (timed pairs, warm-up), and its requests that computed prefix."""

    walls: dict[str, list[float]]
    warm_up: dict[str, list[float]]
    # per engine: timed requests whose cached (or loaded) tokens fell short of the document
    num_short: dict[str, int]
    # per engine and timed request: the minor page faults its engine's processes took
    faults: dict[str, list[int]]


def hit_pairs(engines: dict, num_pairs: int, pids: dict[str, list[int]]) -> HitWalls:
    """Part 2: a document again with a new suffix, on every engine, for each pair.

    The documents are computed once first (kvtier stores them), then asked once more each, not
    timed: right after a store, a kvtier engine's first hits on it took 4-5x a later one (214
    and 238 ms against 45, a loaded machine), a transient that would swamp the mean. A kvtier
    engine empties vLLM's prefix cache before each request (not timed): its prefix comes from
    kvtier's CPU tier, while the engine without kvtier serves it from its own prefix cache.
    A request that got less than the whole document that way is counted (`num_short`), and
    the minor page faults of each engine's processes (`pids`) during each request are kept.
    """
    documents = [tokens(PREFIX_TOKENS, seed=6000 + d) for d in range(NUM_DOCUMENTS)]
    for llm in engines.values():
        for document in documents:
            timed(llm, document)
    num_short = dict.fromkeys(engines, 0)
    faults: dict[str, list[int]] = {name: [] for name in engines}

    def serve(name: str, llm, k: int) -> float:
        prompt = documents[k % NUM_DOCUMENTS] + tokens(SUFFIX_TOKENS, seed=7000 + k)
        if name != "none":
            llm.reset_prefix_cache(reset_connector=False)
        faults_before = minor_faults(pids[name])
        served = serve_one(llm, prompt)
        faults[name].append(minor_faults(pids[name]) - faults_before)
        if served.num_cached_tokens < PREFIX_TOKENS:
            num_short[name] += 1
        return served.seconds

    # warm-up: one hit per document and engine, with suffixes the timed pairs do not use
    warm_up = paired_walls(engines, NUM_DOCUMENTS, lambda name, llm, k: serve(name, llm, -1 - k))
    # the warm-up's short hits and faults are not counted
    num_short.update(dict.fromkeys(engines, 0))
    for name in engines:
        faults[name].clear()
    walls = paired_walls(engines, num_pairs, serve)
    return HitWalls(walls, warm_up, num_short, faults)


def zero_hit_pairs(engines: dict, num_pairs: int) -> dict[str, list[float]]:
    """Part 3: the same unique prompt (nothing to reuse) on every engine, for each pair."""

    def serve(name: str, llm, k: int) -> float:
        return timed(llm, tokens(ZERO_HIT_PROMPT_TOKENS, seed=10_000 + k))

    return paired_walls(engines, num_pairs, serve)


def own_local_round(llm, prefix: list[int], r: int) -> tuple[float, float]:
    """Within one kvtier engine: (a request on `prefix` served by kvtier, one by vLLM's own prefix cache).

    Even rounds: vLLM's cache is emptied, kvtier serves the first request, vLLM the second. Odd
    rounds the other way round (vLLM's cache still holds the prefix: it serves first; then it is
    emptied and kvtier serves), so neither side always runs on blocks the other just warmed.
    """
    suffixes = [tokens(16, seed=5000 + 2 * r + i) for i in range(2)]
    if r % 2 == 0:
        llm.reset_prefix_cache(reset_connector=False)
        kvtier = timed(llm, prefix + suffixes[0])
        return kvtier, timed(llm, prefix + suffixes[1])
    local = timed(llm, prefix + suffixes[0])
    llm.reset_prefix_cache(reset_connector=False)
    return timed(llm, prefix + suffixes[1]), local


def own_local_walls(llm, rounds: int) -> tuple[list[float], list[float]]:
    """Part 4 in the sync engine: (kvtier hit walls, own prefix-cache hit walls), paired."""
    prefix = tokens(PREFIX_TOKENS, seed=4000)
    # kvtier stores the prefix
    timed(llm, prefix)
    kvtier_walls = []
    local_walls = []
    for r in range(rounds):
        kvtier, local = own_local_round(llm, prefix, r)
        kvtier_walls.append(kvtier)
        local_walls.append(local)
    return kvtier_walls, local_walls


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def shutdown(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


ENGINES = (("none", None), ("async", "async"), ("sync", "sync"))


@dataclass(frozen=True)
class RunSize:
    """How much each part of the run measures."""

    # hit-vs-local and zero-hit pairs (one request on each engine per pair)
    pairs: int
    # own-local rounds
    rounds: int
    # overlap: requests decoding in the background, and requests loading their prefixes
    num_background: int
    num_loading: int


FULL = RunSize(pairs=120, rounds=9, num_background=6, num_loading=4)
QUICK = RunSize(pairs=12, rounds=3, num_background=4, num_loading=2)


class Measured(NamedTuple):
    """What one set of engines measured (parts 1 and 4 only by the first set)."""

    # part 1 per engine, or None
    overlap: dict[str, dict[str, float]] | None
    hits: HitWalls
    # part 3's walls per engine
    zero_hit: dict[str, list[float]]
    # part 4's (kvtier hit, own prefix-cache hit) walls, or None
    own: tuple[list[float], list[float]] | None


def measure(model: Path, size: RunSize, num_pairs: int, first: bool) -> Measured:
    """Start the three engines, measure, shut them down."""
    engines = {}
    pids: dict[str, list[int]] = {}
    try:
        # all three alive at once, on the same cores, measured in turns
        for name, mode in ENGINES:
            earlier = child_pids()
            engines[name] = make_engine(model, mode)
            pids[name] = sorted(child_pids() - earlier)
            # warm-up
            timed(engines[name], tokens(ZERO_HIT_PROMPT_TOKENS, seed=9))
        results = overlap_figures(engines, size) if first else None
        hits = hit_pairs(engines, num_pairs, pids)
        walls = zero_hit_pairs(engines, num_pairs)
        own = own_local_walls(engines["sync"], size.rounds) if first else None
    finally:
        for llm in engines.values():
            shutdown(llm)
    return Measured(results, hits, walls, own)


def pooled(per_run: list[dict[str, list]]) -> dict[str, list]:
    """Each engine's values of every run, run after run (pair k of run i stays paired)."""
    return {name: [v for run in per_run for v in run[name]] for name in per_run[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer pairs, rounds and requests")
    parser.add_argument(
        "--pairs",
        type=int,
        default=None,
        help=f"pairs of parts 2 and 3 per engine instance (default {FULL.pairs}, --quick {QUICK.pairs})",
    )
    parser.add_argument(
        "--instances",
        type=int,
        default=1,
        help="sets of engines started one after the other, each measuring --pairs pairs (default 1)",
    )
    parser.add_argument(
        "--no-malloc-tunables",
        action="store_true",
        help="leave glibc's malloc defaults (as a user runs) instead of setting GLIBC_TUNABLES",
    )
    parser.add_argument(
        "--walls", action="store_true", help="print every pair's walls (ms) of parts 2 and 3"
    )
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    num_pairs = size.pairs if args.pairs is None else args.pairs
    model = prepare_machine(malloc_tunables=not args.no_malloc_tunables)
    print(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}", flush=True)
    started = time.perf_counter()
    runs = [measure(model, size, num_pairs, first=i == 0) for i in range(args.instances)]
    print(
        f"{args.instances} engine set(s), {num_pairs} pairs each: "
        f"{time.perf_counter() - started:.0f} s with the engines' starts"
    )
    hit_walls = pooled([run.hits.walls for run in runs])
    walls = pooled([run.zero_hit for run in runs])
    if args.walls:
        print_walls("hit warm-up", pooled([run.hits.warm_up for run in runs]))
        print_walls("hit", hit_walls)
        print_walls("zero-hit", walls)
    num_short = {name: sum(run.hits.num_short[name] for run in runs) for name in hit_walls}
    print(
        "hit requests that computed part of their document (the rest cached or loaded): "
        + ", ".join(f"{name} {n}/{len(hit_walls[name])}" for name, n in num_short.items())
    )
    faults = pooled([run.hits.faults for run in runs])
    print(
        "minor page faults per hit request, the engine's processes (median, p90): "
        + ", ".join(
            f"{name} {statistics.median(fs):.0f}, {p(fs, 0.9):.0f}" for name, fs in faults.items()
        )
    )
    results = runs[0].overlap
    for name in results:
        results[name]["zero_hit"] = statistics.median(walls[name])
        results[name]["user_hit"] = statistics.median(hit_walls[name])
    results["sync"]["hit_kvtier"] = statistics.median(runs[0].own[0])
    results["sync"]["hit_local"] = statistics.median(runs[0].own[1])
    extra = print_instances(runs) if args.instances > 1 else ""
    print_report(results, hit_walls, walls, runs[0].own, extra)


def instance_pairs(run: Measured) -> dict[str, tuple[list[float], list[float]]]:
    """The four ratios' (kvtier walls, no-kvtier walls) of one set of engines."""
    return {
        "zero_hit_overhead": (run.zero_hit["sync"], run.zero_hit["none"]),
        "hit_vs_local": (run.hits.walls["sync"], run.hits.walls["none"]),
        "zero_hit_overhead_async": (run.zero_hit["async"], run.zero_hit["none"]),
        "hit_vs_local_async": (run.hits.walls["async"], run.hits.walls["none"]),
    }


def print_instances(runs: list[Measured]) -> str:
    """Each engine set's median ratio, and the t interval across the sets (their spread).

    Returns the RESULT line's fields for them.
    """
    per_run = [instance_pairs(run) for run in runs]
    print("median ratio per engine set, and across the sets (Student's t on their logs):")
    fields = []
    for key in per_run[0]:
        medians = [median_ratio(*pairs[key]).ratio for pairs in per_run]
        across = paired_ratio(medians, [1.0] * len(medians))
        print(f"  {key:24} " + " ".join(f"{m:.3f}" for m in medians) + f" -> {ci_text(across)}")
        fields.append(f"{key}_instances={across.ratio:.3f}")
        fields.append(f"{key}_instances_ci={across.low:.3f}-{across.high:.3f}")
    return " ".join(fields) + f" instances={len(runs)}"


def print_walls(part: str, walls: dict[str, list[float]]) -> None:
    """Each engine's walls in pair order, in ms."""
    for name, ws in walls.items():
        print(f"{part} walls {name} (ms): " + " ".join(f"{w * 1e3:.1f}" for w in ws))


def prepare_machine(malloc_tunables: bool = True) -> Path:
    """Set the engines' environment, pin this process's cores; the tiny model's directory."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # glibc's malloc returns freed arenas to the kernel and faults them back in: up to 2M page faults
    # per round, and +-14 % of a worker's CPU, varying per engine instance, not per configuration
    if malloc_tunables:
        os.environ.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)
    from kvtier.integrations.vllm.binding import pin_reserved_cpus
    from kvtier.integrations.vllm.tiny_model import ensure_tiny_llama

    pin_reserved_cpus()
    return ensure_tiny_llama(
        Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"))
    )


def overlap_figures(engines: dict, size: RunSize) -> dict[str, dict[str, float]]:
    """Part 1 for each engine: the background requests' ITL p50/p99, the loading ones' TTFT."""
    results = {name: {} for name in engines}
    for name, llm in engines.items():
        o = overlap(llm, size.num_background, size.num_loading)
        results[name].update(
            itl_p50=p(o["itl"], 0.5),
            itl_p99=p(o["itl"], 0.99),
            ttft=statistics.median(o["ttft"]),
        )
    return results


def ci_text(r: RatioCI) -> str:
    """The ratio, its CI, and about how many pairs would bring the CI to +-1 %."""
    half = (r.high - r.low) / 2
    needed = math.ceil(r.num_pairs * (half / 0.01) ** 2) if not math.isnan(half) else 0
    return (
        f"{r.ratio:.3f} (95% CI {r.low:.3f}-{r.high:.3f}, +-{half * 100:.1f} %; "
        f"n={r.num_pairs}, +-1 % needs ~{needed})"
    )


def print_report(
    results: dict[str, dict[str, float]],
    user_hits: dict[str, list[float]],
    walls: dict[str, list[float]],
    own: tuple[list[float], list[float]],
    extra: str,
) -> None:
    """The table, the paired ratios with their CIs, and the RESULT line (against no kvtier),
    `extra`'s fields at its end."""
    print(
        f"{'engine':8} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'TTFT ms':>9} {'zero-hit ms':>12} {'hit ms':>7} "
        f"{'own: kvtier ms':>15} {'own: local ms':>14}"
    )
    for name, f in results.items():
        print(
            f"{name:8} {f['itl_p50'] * 1e3:11.1f} {f['itl_p99'] * 1e3:11.1f} {f['ttft'] * 1e3:9.1f} "
            f"{f['zero_hit'] * 1e3:12.1f} {f['user_hit'] * 1e3:7.1f} "
            f"{f.get('hit_kvtier', float('nan')) * 1e3:15.1f} "
            f"{f.get('hit_local', float('nan')) * 1e3:14.1f}"
        )
    pairs = {
        "zero_hit_overhead": (walls["sync"], walls["none"]),
        "hit_vs_local": (user_hits["sync"], user_hits["none"]),
        "zero_hit_overhead_async": (walls["async"], walls["none"]),
        "hit_vs_local_async": (user_hits["async"], user_hits["none"]),
    }
    ratios = {key: paired_ratio(*walls_pair) for key, walls_pair in pairs.items()}
    medians = {key: median_ratio(*walls_pair) for key, walls_pair in pairs.items()}
    own_ratio = paired_ratio(*own)
    print("paired ratios (geometric mean of per-pair ratios; Student's t on the log-ratios):")
    for key, r in ratios.items():
        print(f"  {key:24} {ci_text(r)}")
    print(f"  {'hit_vs_own_local':24} {ci_text(own_ratio)}")
    print("median of the per-pair ratios (order-statistic CI, robust to one side's bursts):")
    for key, m in medians.items():
        print(f"  {key:24} {m.ratio:.3f} (95% CI {m.low:.3f}-{m.high:.3f})")
    none = results["none"]
    a = results["async"]
    s = results["sync"]
    print(
        f"RESULT itl_p99_ratio_async={a['itl_p99'] / none['itl_p99']:.2f} "
        f"itl_p99_ratio_sync={s['itl_p99'] / none['itl_p99']:.2f} ttft_ratio_async={a['ttft'] / none['ttft']:.2f} "
        + " ".join(f"{key}={r.ratio:.3f}" for key, r in ratios.items())
        + f" hit_vs_own_local={own_ratio.ratio:.3f} "
        + " ".join(f"{key}_ci={r.low:.3f}-{r.high:.3f}" for key, r in ratios.items())
        + " "
        + " ".join(
            f"{key}_median={m.ratio:.3f} {key}_median_ci={m.low:.3f}-{m.high:.3f}"
            for key, m in medians.items()
        )
        + f" pairs={len(walls['none'])}"
        + (f" {extra}" if extra else "")
    )


if __name__ == "__main__":
    main()
