"""Disaggregated prefill through kvtier's shared tiers (issue 35): what the hand-off costs, against
one engine doing both, and the Redis path's bytes/s against `redis-benchmark` in the same run.

Engines (vLLM on CPU, the tiny random Llama, one process, all pinned alike by
`pin_reserved_cpus`, stats logging on for all):

- **single**: stock vLLM without a connector, alive for the whole run. It is what a user runs
  without disaggregation; kvtier's own cost on an engine that stores (`kv_both`) is
  bench_overlap.py's `zero_hit_overhead`, not measured again here.
- **Redis path**: a `kv_producer` and a `kv_consumer` with kvtier, one `redis-server` started
  here (loopback, no persistence) as their hand-off tier.
- **disk path**: a `kv_producer` and a `kv_consumer` whose disk tiers share one `disk_path`
  (`handoff_tier="disk"`, no `disk_rescan_s`: the consumer sees the producer's files only
  through the hand-off's own rescans). The two paths run one after the other, three engines alive
  at most; `single` is measured beside each path.

Prompts: 12 whole chunks of 128 tokens and a 40-token tail (1,576 tokens), new ones each round (a
warm-up round first, not counted), the same prompts on every engine (`single` empties its prefix
cache before each request: both paths send it the same ones). Within a round each prompt is
served by `single` and by the path's pair, which one first alternating prompt by prompt. A P/D
request is what a proxy does: the producer prefills it (`max_tokens=1`, vLLM's
`do_remote_decode`), and at its answer the consumer gets the prompt with the returned
`kv_transfer_params` at once. Then the same prompt goes to the consumer again without them: its
own prefix cache now holds the prompt, so that request is the consumer's compute alone.

Measured (each request driven by `LLMEngine.step`, times from the wall clock):

- TTFT: from adding a request to the step whose output carries its first token. `single`: the
  whole prompt. `prefill`: the producer's request to its answer. `consumer`: the decode
  request's TTFT (it loads the hand-off, computes the tail, samples). P/D TTFT = prefill +
  consumer, what a client behind a proxy waits (the proxy's own hop not counted).
- hand-off time = consumer TTFT - the same prompt's TTFT on the consumer from its own prefix
  cache (per prompt): what waiting for, reading and copying in the hand-off adds to the decode
  engine's first token, from the producer's answer on.
- hand-off bytes: the chunks the producer's hand-off wrote (its tier's `handoff_chunks`) x the
  bytes of one value in the tier (read there: Redis `STRLEN`, a chunk file's size).
  handoff GB/s = those bytes per prompt / the median hand-off time (total bytes / total hand-off
  time is printed too: one stalled write moves it a lot here). It counts the consumer's wait for
  the producer's writes, its reads and the copy into its KV cache: a hand-off's end-to-end rate,
  not a link's.
- `redis-benchmark -t set -d <value bytes> -c 1 -P 1` on new keys, once per round right after
  the round's P/D requests: `redis_ratio` = Redis handoff GB/s / its median SET GB/s.
- the consumer's loaded tokens (`num_cached_tokens` of the decode output: its prefix cache held
  nothing of a new prompt) against the promise's `tokens`; recomputed tokens = prompt tokens -
  loaded (the tail is never promised: 40 a request at best); the consumer's kvtier counters
  (`handoff_waits`, `handoff_timeouts`, deferrals: steps it waited) and the producer's
  (`handoff_promised_chunks`, its tier's `handoff_chunks`, `handoff_failures`), collected per
  engine from the stats each engine reports (a stat logger of its own: the `kvtier:` Prometheus
  metrics of one process keep only the last engine started); Redis's SET calls per chunk
  handed off (`INFO commandstats`, redis-benchmark's own subtracted).
- the decode outputs' token ids against `single`'s (greedy, 4 tokens).

On a 2-core machine shared with other work the times are noisy; the engines run on the same cores,
so P/D cannot be faster than one engine: it computes the prompt once too, and adds the hand-off.

    python benchmarks/bench_pd.py [--quick]

Last line: RESULT handoff_hit_ratio=<loaded/promised tokens, both paths>
consumer_recomputed_tokens=<prompt tokens - loaded, summed over both paths' decode requests>
handoff_timeouts=<consumer, both paths> handoff_gbps=<Redis path> redis_ratio=<vs redis-benchmark>
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from bench_overlap import prepare_machine, tiny_llm, tokens
from servers.redis import RedisServer

CHUNK = 128
NUM_CHUNKS = 12
TAIL = 40
PROMPT_TOKENS = NUM_CHUNKS * CHUNK + TAIL
DECODE_TOKENS = 4
MARKER = {"do_remote_decode": True}
# the engine's processes get this long to exit (a killed one leaves kvtier's host slab behind)
SHUTDOWN_S = 60
# redis-benchmark's db, emptied after each run: kvtier's values are in db 0
BENCH_DB = 2
NEW_KEYS = 10**9
GB = 1e9


@dataclass(frozen=True)
class RunSize:
    """How much each path measures."""

    # counted rounds (a warm-up round comes first)
    rounds: int
    # prompts a round
    num_prompts: int
    # requests of one redis-benchmark run
    bench_requests: int


FULL = RunSize(rounds=4, num_prompts=3, bench_requests=96)
QUICK = RunSize(rounds=1, num_prompts=2, bench_requests=48)


class KVTierTally:
    """A stat logger (what `LLMEngine` calls of vLLM's `StatLoggerBase`; it never sleeps here) that
    sums the kvtier counters one engine reports. One per engine: the `kvtier:` Prometheus metrics
    of a process follow the engine started last."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:
        data = getattr(scheduler_stats, "kv_connector_stats", None) or {}
        for name, value in data.get("counters", {}).items():
            self.counters[name] += value

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass


@dataclass
class Engine:
    name: str
    llm: object
    tally: KVTierTally
    ids: itertools.count = field(default_factory=itertools.count)


@dataclass
class Served:
    """One request's time to its first token, and its finished output."""

    ttft: float
    output: object


def make_engine(model: Path, name: str, role: str | None = None, **extra) -> Engine:
    from kvtier.integrations.vllm import kv_transfer_config

    transfer = None
    if role is not None:
        transfer = kv_transfer_config(role=role, **extra)
    llm = tiny_llm(model, transfer, served_model_name=name, disable_log_stats=False)
    tally = KVTierTally()
    # `LLM` takes no stat logger of the caller's: added to its engine's (an internal list)
    llm.llm_engine.logger_manager.stat_loggers.append(tally)
    engine = Engine(name, llm, tally)
    # warm-up: the first requests of an engine are slower
    serve(engine, tokens(300, seed=1), 2)
    return engine


def shutdown(engine: Engine) -> None:
    import gc

    engine.llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)
    engine.llm = None
    gc.collect()


def serve(engine: Engine, prompt: list[int], max_tokens: int, kv_params=None) -> Served:
    """One greedy request, stepped to its end: its TTFT and final output."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = None if kv_params is None else {"kv_transfer_params": kv_params}
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        extra_args=extra,
    )
    core = engine.llm.llm_engine
    req_id = f"{engine.name}-{next(engine.ids)}"
    started = time.perf_counter()
    core.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), params)
    ttft = None
    final = None
    while final is None:
        for out in core.step():
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - started
            if out.finished:
                final = out
    return Served(ttft, final)


@dataclass
class PD:
    """One prompt through the producer and the consumer."""

    prefill: Served
    decode: Served
    local: Served

    @property
    def promised_tokens(self) -> int:
        return self.prefill.output.kv_transfer_params["kvtier"]["handoff"]["tokens"]

    @property
    def loaded_tokens(self) -> int:
        return self.decode.output.num_cached_tokens

    @property
    def handoff_s(self) -> float:
        return self.decode.ttft - self.local.ttft


def serve_pd(producer: Engine, consumer: Engine, prompt: list[int]) -> PD:
    prefill = serve(producer, prompt, 1, MARKER)
    # at once, as a proxy does
    decode = serve(consumer, prompt, DECODE_TOKENS, prefill.output.kv_transfer_params)
    # the prompt is in the consumer's own prefix cache now: its compute alone
    local = serve(consumer, prompt, DECODE_TOKENS)
    return PD(prefill, decode, local)


def serve_single(single: Engine, prompt: list[int]) -> Served:
    # the other path ran the same prompts: none of them from its prefix cache
    single.llm.reset_prefix_cache()
    return serve(single, prompt, DECODE_TOKENS)


def redis_benchmark(redis: RedisServer, value_bytes: int, requests: int) -> float:
    """GB/s of `redis-benchmark` SETs of new keys, one client, no pipelining."""
    command = (
        f"redis-benchmark -h {redis.host} -p {redis.port} -t set -d {value_bytes} -n {requests} "
        f"-c 1 -P 1 -r {NEW_KEYS} --dbnum {BENCH_DB} --csv"
    )
    done = subprocess.run(command.split(), capture_output=True, text=True, check=True)
    with redis.client(db=BENCH_DB) as client:
        client.flushdb()
    row = done.stdout.splitlines()[1].replace('"', "").split(",")
    return float(row[1]) * value_bytes / GB


def set_calls(redis: RedisServer) -> int:
    with redis.client() as client:
        return int(client.info("commandstats").get("cmdstat_set", {}).get("calls", 0))


def redis_value_bytes(redis: RedisServer) -> int:
    with redis.client() as client:
        name = next(client.scan_iter(match="kvtier:*", count=1000))
        return int(client.strlen(name))


def disk_value_bytes(root: Path) -> int:
    return max(p.stat().st_size for p in root.rglob("*") if p.is_file())


@dataclass
class PathRun:
    """One path's measurements, and `single`'s beside them."""

    name: str
    single: list[Served] = field(default_factory=list)
    pds: list[PD] = field(default_factory=list)
    same_tokens: int = 0
    producer: Counter = field(default_factory=Counter)
    consumer: Counter = field(default_factory=Counter)
    value_bytes: int = 0
    bench_gbps: list[float] = field(default_factory=list)
    sets_per_chunk: float = float("nan")

    @property
    def handoff_chunks(self) -> float:
        return self.producer[f"tier.{self.name}.handoff_chunks"]

    @property
    def handoff_bytes(self) -> float:
        return self.handoff_chunks * self.value_bytes

    @property
    def handoff_gbps(self) -> float:
        """Bytes per prompt over the median hand-off time."""
        per_prompt = self.handoff_bytes / len(self.pds)
        return per_prompt / median(pd.handoff_s for pd in self.pds) / GB

    @property
    def mean_handoff_gbps(self) -> float:
        return self.handoff_bytes / sum(pd.handoff_s for pd in self.pds) / GB


def prompts_of(round_: int, size: RunSize) -> list[list[int]]:
    return [tokens(PROMPT_TOKENS, seed=35_000 + 100 * round_ + i) for i in range(size.num_prompts)]


def run_path(
    name: str,
    single: Engine,
    producer: Engine,
    consumer: Engine,
    size: RunSize,
    redis: RedisServer | None,
) -> PathRun:
    """A warm-up round, then the counted rounds; the engines' counters over the counted ones."""
    warm_up = PathRun(name)
    serve_round(warm_up, 0, single, producer, consumer, size)
    # the warm-up's counters in, none of the counted rounds'
    settle(producer, consumer)
    producer_before = Counter(producer.tally.counters)
    consumer_before = Counter(consumer.tally.counters)
    sets_before = set_calls(redis) if redis else 0
    run = PathRun(name)
    for r in range(1, size.rounds + 1):
        serve_round(run, r, single, producer, consumer, size)
        if redis is not None:
            run.value_bytes = redis_value_bytes(redis)
            run.bench_gbps.append(redis_benchmark(redis, run.value_bytes, size.bench_requests))
    settle(producer, consumer)
    run.producer = producer.tally.counters - producer_before
    run.consumer = consumer.tally.counters - consumer_before
    if redis is not None:
        sets = set_calls(redis) - sets_before - size.bench_requests * size.rounds
        run.sets_per_chunk = sets / max(1, run.handoff_chunks)
    return run


def serve_round(
    run: PathRun, r: int, single: Engine, producer: Engine, consumer: Engine, size: RunSize
) -> None:
    """Round `r`'s prompts, each on `single` and through the pair, which first alternating."""
    for i, prompt in enumerate(prompts_of(r, size)):
        is_single_first = (r + i) % 2 == 0
        if is_single_first:
            alone = serve_single(single, prompt)
        pd = serve_pd(producer, consumer, prompt)
        if not is_single_first:
            alone = serve_single(single, prompt)
        run.single.append(alone)
        run.pds.append(pd)
        run.same_tokens += (
            alone.output.outputs[0].token_ids == pd.decode.output.outputs[0].token_ids
        )


def settle(producer: Engine, consumer: Engine) -> None:
    """Let the last writes end, then one step on each engine reports its last counters."""
    time.sleep(1.0)
    for engine in (producer, consumer):
        serve(engine, tokens(8, seed=2), 1)


def redis_path(model: Path, single: Engine, size: RunSize) -> PathRun:
    with RedisServer.temporary() as redis:
        config = {"cpu_bytes": "512MiB", "redis_url": redis.url, "handoff_tier": "redis"}
        return pair_run("redis", model, single, size, config, redis)


def disk_path(model: Path, single: Engine, size: RunSize) -> PathRun:
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-pd-"))
    try:
        config = {
            "cpu_bytes": "512MiB",
            "disk_path": str(root),
            "disk_bytes": "2GiB",
            "handoff_tier": "disk",
        }
        run = pair_run("disk", model, single, size, config, None)
        run.value_bytes = disk_value_bytes(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return run


def pair_run(name: str, model: Path, single: Engine, size: RunSize, config: dict, redis) -> PathRun:
    producer = consumer = None
    try:
        producer = make_engine(model, f"producer-{name}", "kv_producer", **config)
        consumer = make_engine(model, f"consumer-{name}", "kv_consumer", **config)
        return run_path(name, single, producer, consumer, size, redis)
    finally:
        for engine in (producer, consumer):
            if engine is not None:
                shutdown(engine)


def print_path(run: PathRun) -> None:
    """The path's times, then its tokens and counters."""
    print(f"-- {run.name} path: {len(run.pds)} prompts of {PROMPT_TOKENS} tokens")
    print_times(run)
    print_counters(run)


def print_times(run: PathRun) -> None:
    single = median(s.ttft for s in run.single)
    prefill = median(pd.prefill.ttft for pd in run.pds)
    consumer = median(pd.decode.ttft for pd in run.pds)
    local = median(pd.local.ttft for pd in run.pds)
    pd_ttft = median(pd.prefill.ttft + pd.decode.ttft for pd in run.pds)
    print(
        f"   medians (ms): single TTFT {single * 1e3:.0f} | P/D TTFT {pd_ttft * 1e3:.0f} "
        f"(prefill {prefill * 1e3:.0f} + consumer {consumer * 1e3:.0f}) "
        f"| P/D / single {pd_ttft / single:.2f}"
    )
    print(
        f"   consumer TTFT {consumer * 1e3:.0f} = own compute {local * 1e3:.0f} (same prompt from "
        f"its prefix cache) + hand-off {median(pd.handoff_s for pd in run.pds) * 1e3:.0f}"
    )
    print(
        "   per prompt (ms), single/prefill/consumer/own compute: "
        + " ".join(
            f"{s.ttft * 1e3:.0f}/{pd.prefill.ttft * 1e3:.0f}/{pd.decode.ttft * 1e3:.0f}/"
            f"{pd.local.ttft * 1e3:.0f}"
            for s, pd in zip(run.single, run.pds, strict=True)
        )
    )


def print_counters(run: PathRun) -> None:
    n = len(run.pds)
    promised = sum(pd.promised_tokens for pd in run.pds)
    loaded = sum(pd.loaded_tokens for pd in run.pds)
    c = run.consumer
    p = run.producer
    tier = f"tier.{run.name}"
    print(
        f"   tokens: promised {promised}, loaded {loaded}, recomputed "
        f"{n * PROMPT_TOKENS - loaded} (tail {n * TAIL}); decode tokens equal to single's "
        f"{run.same_tokens}/{n}"
    )
    print(
        f"   consumer: handoff_waits {c['handoff_waits']:.0f} timeouts {c['handoff_timeouts']:.0f} "
        f"unreachable {c['handoff_unreachable']:.0f} deferrals {c['deferrals']:.0f} "
        f"hit_tokens {c['hit_tokens']:.0f}; copied in {c['load_bytes'] / 2**20:.0f} MiB in "
        f"{c['load_seconds'] * 1e3:.0f} ms; {run.name} read {c[f'{tier}.load_chunks']:.0f} "
        f"chunks in {c[f'{tier}.load_seconds'] * 1e3:.0f} ms (thread-seconds)"
    )
    print(
        f"   producer: promised {p['handoff_promised_chunks']:.0f} chunks; the hand-off wrote "
        f"{run.handoff_chunks:.0f} (failures {p[f'{tier}.handoff_failures']:.0f}), the write-down "
        f"{p[f'{tier}.cascaded_chunks']:.0f}; {run.name} stored {p[f'{tier}.store_chunks']:.0f} "
        f"chunks in {p[f'{tier}.store_seconds'] * 1e3:.0f} ms (thread-seconds); a value is "
        f"{run.value_bytes} bytes"
    )
    line = (
        f"   hand-off: {run.handoff_gbps:.3f} GB/s at the median hand-off time "
        f"({run.mean_handoff_gbps:.3f} over their sum)"
    )
    if run.bench_gbps:
        line += (
            f"; redis-benchmark SET {median(run.bench_gbps):.3f} GB/s (runs: "
            + " ".join(f"{g:.3f}" for g in run.bench_gbps)
            + f"); Redis SETs per chunk handed off {run.sets_per_chunk:.2f}"
        )
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one counted round of 2 prompts")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    model = prepare_machine()
    single = make_engine(model, "single")
    try:
        runs = [redis_path(model, single, size), disk_path(model, single, size)]
    finally:
        shutdown(single)
    for run in runs:
        print_path(run)
    promised = sum(pd.promised_tokens for run in runs for pd in run.pds)
    loaded = sum(pd.loaded_tokens for run in runs for pd in run.pds)
    recomputed = sum(PROMPT_TOKENS - pd.loaded_tokens for run in runs for pd in run.pds)
    timeouts = sum(run.consumer["handoff_timeouts"] for run in runs)
    redis_run = runs[0]
    print(
        f"RESULT handoff_hit_ratio={loaded / promised:.3f} consumer_recomputed_tokens={recomputed} "
        f"handoff_timeouts={timeouts:.0f} handoff_gbps={redis_run.handoff_gbps:.3f} "
        f"redis_ratio={redis_run.handoff_gbps / median(redis_run.bench_gbps):.3f}"
    )


if __name__ == "__main__":
    main()
