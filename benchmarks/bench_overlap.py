"""Loads that never stall the batch, and what kvtier costs when it cannot help (vLLM on CPU).

Three engines in turn, on the same cores (`pin_reserved_cpus`): vLLM without kvtier, kvtier
with `load_mode="async"`, kvtier with `load_mode="sync"`. Each runs:

1. **Overlap**: background requests decode steadily; then requests whose 1,536-token prefixes
   kvtier holds (stored beforehand; vLLM's prefix cache emptied) arrive all at once. Printed:
   the background requests' inter-token latency p50/p99 (per engine step, from the wall clock
   of `LLMEngine.step`), and the loading requests' TTFT (arrival to first token). Without
   kvtier those prefixes are recomputed.
2. **Zero hit** (no reuse at all): unique 768-token prompts, 4 tokens each, one batch;
   median wall time over rounds (`zero_hit_overhead` = kvtier async / no kvtier).
3. **Hit vs local** (kvtier engines): a 4-token request on a reused 1,536-token prefix, served
   by kvtier (prefix cache emptied first) against the same request served by vLLM's own prefix
   cache; medians over rounds (`hit_vs_local`).

    python benchmarks/bench_overlap.py [--quick]

Last line: RESULT itl_p99_ratio_async=… itl_p99_ratio_sync=… ttft_ratio_async=…
zero_hit_overhead=… hit_vs_local=…
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

PREFIX_TOKENS = 1536


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
    return LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True,
               max_model_len=4096, kv_transfer_config=transfer)


def overlap(llm, num_background: int, num_loading: int) -> dict[str, list[float]]:
    """Background decodes + loading requests arriving together; ITLs of the former, TTFTs of the latter."""
    from vllm.inputs import TokensPrompt

    prefixes = [tokens(PREFIX_TOKENS, seed=1000 + i) for i in range(num_loading)]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prefixes], params(1), use_tqdm=False)  # stored
    llm.reset_prefix_cache(reset_connector=False)
    engine = llm.llm_engine
    for i in range(num_background):
        engine.add_request(f"bg{i}", TokensPrompt(prompt_token_ids=tokens(128, seed=2000 + i)), params(64))
    last_token: dict[str, float] = {}
    itls: list[float] = []
    ttfts: list[float] = []
    arrived: dict[str, float] = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        num_steps += 1
        if num_steps == 4:  # the background requests are decoding: the loading ones arrive
            for i, p in enumerate(prefixes):
                engine.add_request(f"ld{i}", TokensPrompt(prompt_token_ids=p + tokens(32, seed=3000 + i)), params(4))
                arrived[f"ld{i}"] = time.perf_counter()
        for out in outs:
            rid = out.request_id
            if rid.startswith("bg") and out.outputs and out.outputs[0].token_ids:
                if rid in last_token:
                    itls.append(now - last_token[rid])
                last_token[rid] = now
            elif rid in arrived:  # a loading request's first output: its first token
                ttfts.append(now - arrived.pop(rid))
    return {"itl": itls, "ttft": ttfts}


def zero_hit(llm, rounds: int, num_prompts: int, seed: int) -> list[float]:
    from vllm.inputs import TokensPrompt

    walls = []
    for r in range(rounds):
        prompts = [TokensPrompt(prompt_token_ids=tokens(768, seed=seed + 100 * r + i)) for i in range(num_prompts)]
        started = time.perf_counter()
        llm.generate(prompts, params(4), use_tqdm=False)
        walls.append(time.perf_counter() - started)
    return walls


def hit_vs_local(llm, rounds: int) -> tuple[list[float], list[float]]:
    from vllm.inputs import TokensPrompt

    prefix = tokens(PREFIX_TOKENS, seed=4000)
    llm.generate([TokensPrompt(prompt_token_ids=prefix)], params(1), use_tqdm=False)
    from_kvtier, from_local = [], []
    for r in range(rounds):
        llm.reset_prefix_cache(reset_connector=False)
        for where in (from_kvtier, from_local):  # first kvtier serves the prefix, then vLLM's cache
            started = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prefix + tokens(16, seed=5000 + 2 * r + len(where)))],
                         params(4), use_tqdm=False)
            where.append(time.perf_counter() - started)
    return from_kvtier, from_local


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def shutdown(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run(model: Path, mode: str | None, args: argparse.Namespace) -> dict[str, float]:
    llm = make_engine(model, mode)
    try:
        zero_hit(llm, 1, 4, seed=9)  # warm-up
        o = overlap(llm, args.background, args.loading)
        walls = zero_hit(llm, args.rounds, args.prompts, seed=10_000)
        figures = {"itl_p50": p(o["itl"], 0.5), "itl_p99": p(o["itl"], 0.99), "ttft": statistics.median(o["ttft"]),
                   "zero_hit": statistics.median(walls)}
        if mode is not None:
            kv, local = hit_vs_local(llm, args.rounds)
            figures["hit_kvtier"], figures["hit_local"] = statistics.median(kv), statistics.median(local)
        return figures
    finally:
        shutdown(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and requests")
    args = parser.parse_args()
    args.rounds, args.prompts = (3, 8) if args.quick else (9, 22)
    args.background, args.loading = (4, 2) if args.quick else (6, 4)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from kvtier.integrations.vllm.binding import pin_reserved_cpus
    from kvtier.integrations.vllm.tiny_model import ensure_tiny_llama

    pin_reserved_cpus()
    model = ensure_tiny_llama(Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier")))
    results = {name: run(model, mode, args) for name, mode in (("none", None), ("async", "async"), ("sync", "sync"))}
    print(f"{'engine':8} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'TTFT ms':>9} {'zero-hit s':>11} "
          f"{'hit kvtier ms':>14} {'hit local ms':>13}")
    for name, f in results.items():
        print(f"{name:8} {f['itl_p50'] * 1e3:11.1f} {f['itl_p99'] * 1e3:11.1f} {f['ttft'] * 1e3:9.1f} "
              f"{f['zero_hit']:11.2f} {f.get('hit_kvtier', float('nan')) * 1e3:14.1f} "
              f"{f.get('hit_local', float('nan')) * 1e3:13.1f}")
    none, a, s = results["none"], results["async"], results["sync"]
    print(f"RESULT itl_p99_ratio_async={a['itl_p99'] / none['itl_p99']:.2f} "
          f"itl_p99_ratio_sync={s['itl_p99'] / none['itl_p99']:.2f} ttft_ratio_async={a['ttft'] / none['ttft']:.2f} "
          f"zero_hit_overhead={a['zero_hit'] / none['zero_hit']:.3f} "
          f"hit_vs_local={a['hit_kvtier'] / a['hit_local']:.3f}")


if __name__ == "__main__":
    main()
