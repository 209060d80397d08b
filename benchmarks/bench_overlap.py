"""Loads that never stall the batch, and what kvtier costs when it cannot help (vLLM on CPU).

Three engines, alive together and pinned to the same cores (`pin_reserved_cpus`): vLLM without
kvtier, kvtier with `load_mode="async"`, kvtier with `load_mode="sync"` (the default). Each runs:

1. **Overlap**: background requests decode steadily; then requests whose 1,536-token prefixes
   kvtier holds (stored beforehand; vLLM's prefix cache emptied) arrive all at once. Printed:
   the background requests' inter-token latency p50/p99 (per engine step, from the wall clock
   of `LLMEngine.step`), and the loading requests' TTFT (arrival to first token). Without
   kvtier those prefixes are recomputed.
2. **Zero hit** (no reuse at all): unique 768-token prompts, 4 tokens each, one batch;
   median wall time over rounds, the engines' rounds interleaved (each engine first, middle
   and last in turn), so the machine's drift hits all three alike (`zero_hit_overhead` =
   kvtier sync / no kvtier; `_async` for the async mode).
3. **Hit vs local**, as a user compares them (rounds interleaved too): 3 documents of 1,536
   tokens, each asked again every round with a new 32-token suffix, 4 tokens out. vLLM
   without kvtier serves the repeats from its own prefix cache; the kvtier engines empty
   theirs before each request (`reset_prefix_cache(reset_connector=False)`, not timed), so
   every prefix comes from kvtier's CPU tier. Median `generate()` time of rounds 2 on, the
   engines' order turning each request: `hit_vs_local` = kvtier sync / no kvtier (`_async`
   for the async mode). The connector's fixed per-step costs count here, as users see them.
   `hit_vs_own_local` is the older figure: within the sync engine, its kvtier hit against its
   own prefix-cache hit (the connector's fixed costs on both sides, cancelling).

glibc's malloc tunables are set for every engine (`GLIBC_TUNABLES`, unless already set): its
arena trimming faults pages back in at a rate that varies per engine instance, not per
configuration, and swamped the differences measured here.

    python benchmarks/bench_overlap.py [--quick]

Last line: RESULT itl_p99_ratio_async=… itl_p99_ratio_sync=… ttft_ratio_async=…
zero_hit_overhead=… hit_vs_local=… zero_hit_overhead_async=… hit_vs_local_async=… hit_vs_own_local=…
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX_TOKENS = 1536
NUM_DOCUMENTS = 3
SUFFIX_TOKENS = 32


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def make_engine(model: Path, mode: str | None):
    from vllm import LLM

    from kvtier.integrations.vllm import kv_transfer_config

    transfer = None if mode is None else kv_transfer_config(cpu_bytes="2GiB", load_mode=mode)
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        max_model_len=4096,
        kv_transfer_config=transfer,
    )


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


def zero_hit_round(llm, num_prompts: int, seed: int) -> float:
    """Wall time of one batch of unique 768-token prompts, 4 tokens each (nothing to reuse)."""
    from vllm.inputs import TokensPrompt

    prompts = [
        TokensPrompt(prompt_token_ids=tokens(768, seed=seed + i)) for i in range(num_prompts)
    ]
    started = time.perf_counter()
    llm.generate(prompts, params(4), use_tqdm=False)
    return time.perf_counter() - started


def timed(llm, prompt: list[int]) -> float:
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params(4), use_tqdm=False)
    return time.perf_counter() - started


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


def user_hit_round(engines: dict, documents: list[list[int]], r: int) -> dict[str, list[float]]:
    """Each document again with a new suffix, on every engine: wall time per engine and document.

    The kvtier engines empty vLLM's prefix cache first (not timed): the prefix comes from
    kvtier's CPU tier; the engine without kvtier serves it from its own prefix cache. The
    engines' order turns with every request, so the machine's drift hits all alike.
    """
    walls: dict[str, list[float]] = {name: [] for name in engines}
    for d, document in enumerate(documents):
        prompt = document + tokens(SUFFIX_TOKENS, seed=7000 + 100 * r + d)
        i = (r * len(documents) + d) % len(engines)
        for name in list(engines)[i:] + list(engines)[:i]:
            if name != "none":
                engines[name].reset_prefix_cache(reset_connector=False)
            walls[name].append(timed(engines[name], prompt))
    return walls


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

    # zero-hit and own-local rounds
    rounds: int
    # prompts of a zero-hit round
    num_prompts: int
    # hit-vs-local rounds (round 0 only stores the documents)
    hit_rounds: int
    # overlap: requests decoding in the background, and requests loading their prefixes
    num_background: int
    num_loading: int


FULL = RunSize(rounds=9, num_prompts=22, hit_rounds=8, num_background=6, num_loading=4)
QUICK = RunSize(rounds=3, num_prompts=8, hit_rounds=4, num_background=4, num_loading=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and requests")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    model = prepare_machine()
    engines = {}
    try:
        # all three alive at once, on the same cores, measured in turns
        for name, mode in ENGINES:
            engines[name] = make_engine(model, mode)
            # warm-up
            zero_hit_round(engines[name], 4, seed=9)
        results = overlap_figures(engines, size)
        user_hits = user_hit_walls(engines, size.hit_rounds)
        walls, hits = zero_hit_and_own_local_walls(engines, size)
    finally:
        for llm in engines.values():
            shutdown(llm)
    for name in engines:
        results[name]["zero_hit"] = statistics.median(walls[name])
        results[name]["user_hit"] = statistics.median(user_hits[name])
        if name in hits:
            kvtier_walls, local_walls = hits[name]
            results[name]["hit_kvtier"] = statistics.median(kvtier_walls)
            results[name]["hit_local"] = statistics.median(local_walls)
    print_report(results, user_hits, walls)


def prepare_machine() -> Path:
    """Set the engines' environment, pin this process's cores; the tiny model's directory."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # glibc's malloc returns freed arenas to the kernel and faults them back in: up to 2M page faults
    # per round, and +-14 % of a worker's CPU, varying per engine instance, not per configuration
    os.environ.setdefault(
        "GLIBC_TUNABLES",
        "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824",
    )
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


def user_hit_walls(engines: dict, hit_rounds: int) -> dict[str, list[float]]:
    """Part 3, hit vs local: each engine's request walls of every round but the first."""
    documents = [tokens(PREFIX_TOKENS, seed=6000 + d) for d in range(NUM_DOCUMENTS)]
    user_hits = {name: [] for name in engines}
    # round 0 computes (and kvtier stores) the documents: not counted
    for r in range(hit_rounds):
        round_walls = user_hit_round(engines, documents, r)
        if r == 0:
            continue
        for name, ws in round_walls.items():
            user_hits[name] += ws
    return user_hits


def zero_hit_and_own_local_walls(
    engines: dict, size: RunSize
) -> tuple[dict[str, list[float]], dict[str, tuple[list[float], list[float]]]]:
    """Part 2's zero-hit round walls per engine, and, for the kvtier engines, the older figure's
    (kvtier hit, own prefix-cache hit) walls, their rounds interleaved."""
    walls = {name: [] for name in engines}
    hits = {name: ([], []) for name in engines if name != "none"}
    prefix = tokens(PREFIX_TOKENS, seed=4000)
    for name in hits:
        # kvtier stores the prefix
        timed(engines[name], prefix)
    for r in range(size.rounds):
        # each engine first, middle and last in turn
        order = list(engines)[r % 3 :] + list(engines)[: r % 3]
        for name in order:
            walls[name].append(
                zero_hit_round(engines[name], size.num_prompts, seed=10_000 + 100 * r)
            )
        for name in order:
            if name in hits:
                kvtier, local = own_local_round(engines[name], prefix, r)
                hits[name][0].append(kvtier)
                hits[name][1].append(local)
    return walls, hits


def print_report(
    results: dict[str, dict[str, float]],
    user_hits: dict[str, list[float]],
    walls: dict[str, list[float]],
) -> None:
    """The table, each engine's walls, and the RESULT line (ratios against vLLM without kvtier)."""
    print(
        f"{'engine':8} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'TTFT ms':>9} {'zero-hit s':>11} {'hit ms':>7} "
        f"{'own: kvtier ms':>15} {'own: local ms':>14}"
    )
    for name, f in results.items():
        print(
            f"{name:8} {f['itl_p50'] * 1e3:11.1f} {f['itl_p99'] * 1e3:11.1f} {f['ttft'] * 1e3:9.1f} "
            f"{f['zero_hit']:11.2f} {f['user_hit'] * 1e3:7.1f} {f.get('hit_kvtier', float('nan')) * 1e3:15.1f} "
            f"{f.get('hit_local', float('nan')) * 1e3:14.1f}"
        )
    print(
        "hit walls per request (ms): "
        + "; ".join(f"{n} " + " ".join(f"{w * 1e3:.0f}" for w in ws) for n, ws in user_hits.items())
    )
    print(
        "zero-hit walls per round (s): "
        + "; ".join(f"{n} " + " ".join(f"{w:.2f}" for w in ws) for n, ws in walls.items())
    )
    none = results["none"]
    a = results["async"]
    s = results["sync"]
    print(
        f"RESULT itl_p99_ratio_async={a['itl_p99'] / none['itl_p99']:.2f} "
        f"itl_p99_ratio_sync={s['itl_p99'] / none['itl_p99']:.2f} ttft_ratio_async={a['ttft'] / none['ttft']:.2f} "
        f"zero_hit_overhead={s['zero_hit'] / none['zero_hit']:.3f} "
        f"hit_vs_local={s['user_hit'] / none['user_hit']:.3f} "
        f"zero_hit_overhead_async={a['zero_hit'] / none['zero_hit']:.3f} "
        f"hit_vs_local_async={a['user_hit'] / none['user_hit']:.3f} "
        f"hit_vs_own_local={s['hit_kvtier'] / s['hit_local']:.3f}"
    )


if __name__ == "__main__":
    main()
