"""Redis tier GB/s against `redis-benchmark` on the same server in the same run, and the S3
tier's ratios (from benchmarks/s3_bench.py, when there).

For values of 1, 2 and 4 MiB, on one `redis-server` started here (loopback, no persistence):

- baseline: `redis-benchmark -d <size> -c <threads>` at `-P 1` and at `-P <batch>`, the
  better of the two per direction; GB/s = requests/s x size. SET: `-t set -r 10^9`, every
  key new (as the store writes new names: the server faults in fresh memory for each value,
  which SETs over existing keys avoid; those are printed too). GET: `-t set,get -r <keys>
  -n <8 x keys>`, keys spanning 64 MiB (twice this machine's L3: no value is read from cache).
- RedisStore: `put` (SET NX of new names), `get` and `get_into` (into the caller's buffers)
  of values of <size> bytes (a 128-byte header part and a payload part, as the tier sends),
  <batch> names per call from <threads> threads. `get` receives each value into new memory,
  and faulting it in bounds it (1 MiB: 1.1-2.7 GB/s, as the allocator happens to reuse
  pages or not); `get_into` receives into memory already faulted in (as a slab's rows are).
- RemoteTier on a RedisStore: store and load jobs of <batch> keys (payload <size> - 128
  bytes, so a value is <size> bytes) from / into numpy rows, 2 x <threads> jobs in flight,
  `io_threads=<threads>`: with the value header, the xxh3 checksums, the slab copies.
- keyed mode: the same tier jobs with a deployment secret (HMAC names, and a keyed-BLAKE3 tag
  on every value, checked on every load), against the plain tier of the same round (the two
  take turns going first), and each tier side's client CPU seconds per GB (this process's
  threads: less at the mercy of other work on the machine than GB/s). Before
  the rounds, the MAC candidates' GB/s on one thread (keyed BLAKE3, keyed BLAKE2b, and the
  unkeyed xxh3 checksum for scale) on 1, 2 and 4 MiB.
- `--clients`: also redis-py's own pipeline (`set(name, b"".join(parts), nx=True)`, `get`),
  and valkey-glide's sync client when importable (`pip install valkey-glide-sync`).

Equal work on both sides: every side writes as many bytes as redis-benchmark's SET run (4
requests per key of the working set) and reads twice what it wrote, as many bytes as its GET
run (8 per key). Before (issue 22) a --quick round read 64 MiB against redis-benchmark's 256:
a single pass of 30-60 ms on a tier's fresh connections, whose first 8 MiB window of each
connection takes 1.5-2x as long as the next ones (scratch measurements in issue 22's report).

Brackets (issue 22): each side runs between two redis-benchmark runs of its direction (GET
over as many values as each side writes, kept in db 1; SET of new keys in db 2, emptied after
each run), and its ratio is to their mean. This VM's loopback throughput drifts 2-4x within seconds (a plain socket
pair: 0.3-1.8 GB/s), and a round's first baseline ran 5-20 s before the tier's loads; the
ratio to it is still printed in parentheses.

Each GB/s figure is the best over rounds; each ratio is the median over rounds of that
round's side / its brackets' mean. The RESULT ratios are the tier's, the lowest over the sizes.

Usage: python benchmarks/bench_remote.py [--quick] [--rounds R] [--threads T] [--batch B] [--clients] [--no-s3]
Last line: RESULT redis_store_ratio=<x> redis_load_ratio=<y> s3_store_ratio=<z> s3_load_ratio=<w>
keyed_store_ratio=<k> keyed_load_ratio=<l> (keyed tier / plain tier, same rounds; the lowest size's)
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import math
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable

import numpy as np
import redis
import xxhash
from blake3 import blake3

from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.redis import RedisStore
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.secondary import HEADER_BYTES
from servers.redis import RedisServer
from tier_driver import run_jobs

SIZES = (1 << 20, 2 << 20, 4 << 20)
# redis-benchmark's keys x size (--quick: half)
WORKING_SET = 64 << 20
# redis-benchmark's requests per key of the working set
SET_PER_KEY = 4
GET_PER_KEY = 8
# each read side reads what it wrote this many times
LOAD_PASSES = GET_PER_KEY // SET_PER_KEY
KEY_SECRET = b"bench deployment secret, 32 byte"
# redis-benchmark -r for "every SET a new key" (an int: 2^40 wraps, and every SET hits one key)
NEW_KEYS = 10**9
GB = 1e9


def redis_benchmark(
    port: int, size: int, clients: int, pipeline: int, working_set: int
) -> dict[str, float]:
    """GB/s that redis-benchmark reaches: SET of new keys; SET over and GET of `working_set` bytes of keys."""
    keys = max(8, working_set // size)
    new = _redis_benchmark(port, size, clients, pipeline, "set", NEW_KEYS, SET_PER_KEY * keys)
    redis.Redis(port=port).flushall()
    # 8 requests per key: nearly every key is set before the GETs start (e^-8 are not)
    reused = _redis_benchmark(port, size, clients, pipeline, "set,get", keys, GET_PER_KEY * keys)
    redis.Redis(port=port).flushall()
    return {"set": new["SET"], "set over": reused["SET"], "get": reused["GET"]}


def _redis_benchmark(
    port: int,
    size: int,
    clients: int,
    pipeline: int,
    tests: str,
    keys: int,
    requests: int,
    db: int = 0,
) -> dict[str, float]:
    done = subprocess.run(
        [
            "redis-benchmark",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-d",
            str(size),
            "-t",
            tests,
            "-c",
            str(clients),
            "-P",
            str(pipeline),
            "-r",
            str(keys),
            "-n",
            str(requests),
            "--dbnum",
            str(db),
            "--csv",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return {
        row[0]: float(row[1]) * size / GB for row in csv.reader(done.stdout.splitlines()[1:]) if row
    }


class Brackets:
    """redis-benchmark run right before and right after each side, on databases of its own (1: the
    GET run's values, kept for the round; 2: SETs of new keys, emptied after each run), so that each
    side is compared with the machine and server of its own moment: on this VM loopback
    throughput drifts by 2-4x within seconds, more than any difference between the sides.

    Each run moves the bytes of one side: a SET run writes `SET_PER_KEY` values per key of the
    working set (new keys), a GET run reads `GET_PER_KEY`, at random over `span` keys: as many
    distinct values as each side writes and then reads back (twice each, on average).

    `around(direction, fn)` runs fn (which returns seconds) between two baseline runs of that
    direction ("store": SET of new keys; "load": GET) and records their mean as that side's
    bracket; `pipelines` is the round's better `-P` per direction."""

    def __init__(
        self,
        port: int,
        size: int,
        clients: int,
        pipelines: dict[str, int],
        working_set: int,
        span: int,
    ):
        self.port = port
        self.size = size
        self.clients = clients
        self.pipelines = pipelines
        self.keys = max(8, working_set // size)
        self.span = span
        # db 1: the GET runs' values, under redis-benchmark's names (`key:` and 12 digits), each one set
        client = redis.Redis(port=port, db=1)
        value = os.urandom(size)
        for start in range(0, span, 8):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + 8, span)):
                pipe.set(f"key:{i:012d}", value)
            pipe.execute()
        client.close()

    def rate(self, direction: str) -> float:
        """One baseline run of `direction` now: GB/s."""
        if direction == "load":
            return _redis_benchmark(
                self.port,
                self.size,
                self.clients,
                self.pipelines["load"],
                "get",
                self.span,
                GET_PER_KEY * self.keys,
                db=1,
            )["GET"]
        rate = _redis_benchmark(
            self.port,
            self.size,
            self.clients,
            self.pipelines["store"],
            "set",
            NEW_KEYS,
            SET_PER_KEY * self.keys,
            db=2,
        )["SET"]
        redis.Redis(port=self.port, db=2).flushdb()
        return rate

    def around(self, direction: str, fn: Callable[[], float]) -> tuple[float, float]:
        """(fn's seconds, the mean GB/s of the baseline runs just before and just after it)."""
        before = self.rate(direction)
        seconds = fn()
        return seconds, (before + self.rate(direction)) / 2

    def close(self) -> None:
        redis.Redis(port=self.port, db=1).flushdb()


def in_threads(threads: int, batch: int, count: int, work: Callable[[int, range], None]) -> float:
    """Seconds for `threads` threads to run work(thread, batch of indices) over range(count)."""

    def run(thread: int) -> None:
        for start in range(thread * batch, count, threads * batch):
            work(thread, range(start, min(start + batch, count)))

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start


def store_rates(
    url: str, size: int, count: int, threads: int, batch: int, tag: str, brackets: Brackets
) -> dict[str, float]:
    """RedisStore put / get / get_into GB/s (and each one's `brackets`' GB/s, under "<side> bracket")."""
    store = RedisStore(url, max_connections=threads)
    names = [f"bench:{tag}:{i}" for i in range(count)]
    parts = [
        os.urandom(HEADER_BYTES),
        memoryview(np.random.default_rng(0).integers(0, 256, size - HEADER_BYTES, np.uint8)),
    ]
    # each thread's destinations, faulted in (as an engine's slab rows are)
    dests = [
        [
            [
                memoryview(np.ones(HEADER_BYTES, np.uint8)),
                memoryview(np.ones(size - HEADER_BYTES, np.uint8)),
            ]
            for _ in range(batch)
        ]
        for _ in range(threads)
    ]

    def put(_: int, idx: range) -> None:
        if not all(store.put([(names[i], parts) for i in idx])):
            raise RuntimeError("a name existed")

    def get(_: int, idx: range) -> None:
        if any(value is None or len(value) != size for value in store.get([names[i] for i in idx])):
            raise RuntimeError("a value is missing or of another size")

    def get_into(thread: int, idx: range) -> None:
        if store.get_into([names[i] for i in idx], dests[thread][: len(idx)]) != [size] * len(idx):
            raise RuntimeError("a value is missing or of another size")

    out = {}
    for side, fn, passes in (
        ("put", put, 1),
        ("get", get, LOAD_PASSES),
        ("get_into", get_into, LOAD_PASSES),
    ):
        seconds, out[f"{side} bracket"] = brackets.around(
            "store" if side == "put" else "load",
            lambda fn=fn, passes=passes: sum(
                in_threads(threads, batch, count, fn) for _ in range(passes)
            ),
        )
        out[side] = passes * count * size / seconds / GB
    if bytes(dests[0][0][1]) != bytes(parts[1]):
        raise RuntimeError("get_into received other bytes")
    store.close()
    return out


def tier_rates(
    url: str,
    size: int,
    count: int,
    threads: int,
    batch: int,
    tag: str,
    brackets: Brackets,
    key_secret: bytes | None = None,
) -> dict[str, float]:
    """RemoteTier store / load GB/s (bytes of values, header included, as the other sides; keyed
    mode's tag not counted, so that both modes move the same KV per GB/s), each with its
    `brackets`' GB/s ("<side> bracket") and this process's CPU seconds per GB ("<side> cpu")."""

    namespace = Namespace(
        "bench", "bfloat16", "blocks", 16, 4, "sha256_cbor", 1, size - HEADER_BYTES
    )
    tier = RemoteTier(
        RedisStore(url, max_connections=2 * threads),
        namespace,
        prefix=f"bench-tier-{tag}",
        key_secret=key_secret,
        io_threads=threads,
        enable_events=False,
    )
    in_flight = 2 * threads
    rows = np.random.default_rng(1).integers(
        0, 256, (batch * in_flight, size - HEADER_BYTES), np.uint8
    )
    out = {}
    try:
        cpu: dict[str, float] = {}

        def run(side: str, passes: int) -> float:
            # this process only: the client's CPU, not the server's
            start = time.process_time()
            seconds = sum(
                run_jobs(tier, rows, count, batch, side == "store", poll_s=0.0002)
                for _ in range(passes)
            )
            cpu[side] = time.process_time() - start
            return seconds

        for side, passes in (("store", 1), ("load", LOAD_PASSES)):
            seconds, out[f"{side} bracket"] = brackets.around(
                side, lambda side=side, passes=passes: run(side, passes)
            )
            out[side] = passes * count * size / seconds / GB
            out[f"{side} cpu"] = cpu[side] / (passes * count * size / GB)
        return out
    finally:
        tier.close()


def client_rates(port: int, size: int, count: int, threads: int, batch: int) -> dict[str, float]:
    """redis-py's own pipeline, and glide-sync when importable: put (joined value) / get GB/s."""
    parts = [os.urandom(HEADER_BYTES), os.urandom(size - HEADER_BYTES)]
    names = [f"bench:client:{i}" for i in range(count)]
    client = redis.Redis(port=port, max_connections=threads)

    def put(_: int, idx: range) -> None:
        pipe = client.pipeline(transaction=False)
        for i in idx:
            pipe.set(names[i], b"".join(parts), nx=True)
        pipe.execute()

    def get(_: int, idx: range) -> None:
        pipe = client.pipeline(transaction=False)
        for i in idx:
            pipe.get(names[i])
        pipe.execute()

    out = {
        f"redis-py {side}": count * size / in_threads(threads, batch, count, fn) / GB
        for side, fn in (("put", put), ("get", get))
    }
    client.flushall()
    try:
        from glide_sync import (
            Batch,
            ConditionalChange,
            GlideClient,
            GlideClientConfiguration,
            NodeAddress,
        )
    except ImportError:
        return out
    glide = GlideClient.create(
        GlideClientConfiguration([NodeAddress("127.0.0.1", port)], request_timeout=10_000)
    )

    def glide_put(_: int, idx: range) -> None:
        batch_ = Batch(is_atomic=False)
        for i in idx:
            batch_.set(
                names[i], b"".join(parts), conditional_set=ConditionalChange.ONLY_IF_DOES_NOT_EXIST
            )
        glide.exec(batch_, raise_on_error=True)

    def glide_get(_: int, idx: range) -> None:
        glide.mget([names[i] for i in idx])

    out.update(
        {
            f"glide-sync {side}": count * size / in_threads(threads, batch, count, fn) / GB
            for side, fn in (("put", glide_put), ("get", glide_get))
        }
    )
    glide.close()
    client.flushall()
    return out


def one_round(
    port: int, size: int, count: int, args: argparse.Namespace, tag: str, keyed_first: bool = False
) -> dict[str, float]:
    """Every side once, the baseline first (the keyed tier before the plain one when `keyed_first`)."""
    url = f"redis://127.0.0.1:{port}"
    threads = args.threads
    batch = args.batch
    working_set = WORKING_SET // 2 if args.quick else WORKING_SET
    by_pipeline = {
        pipeline: redis_benchmark(port, size, threads, pipeline, working_set)
        for pipeline in (1, batch)
    }
    out = {
        f"bench {test}": max(rates[test] for rates in by_pipeline.values())
        for test in ("set", "set over", "get")
    }
    out.update(
        {
            f"bench {test} -P{pipeline}": rate
            for pipeline, rates in by_pipeline.items()
            for test, rate in rates.items()
        }
    )
    best = {
        direction: max(by_pipeline, key=lambda p, test=test: by_pipeline[p][test])
        for direction, test in (("store", "set"), ("load", "get"))
    }
    brackets = Brackets(port, size, threads, best, working_set, count)
    # the sides' values (the brackets' are in dbs 1 and 2)
    flush = redis.Redis(port=port, db=0).flushdb
    try:
        out.update(
            {
                f"store {k}": v
                for k, v in store_rates(url, size, count, threads, batch, tag, brackets).items()
            }
        )
        flush()
        for mode in ("keyed", "plain") if keyed_first else ("plain", "keyed"):
            secret = KEY_SECRET if mode == "keyed" else None
            rates = tier_rates(url, size, count, threads, batch, f"{tag}-{mode}", brackets, secret)
            out.update({f"tier {'keyed ' if secret else ''}{k}": v for k, v in rates.items()})
            flush()
    finally:
        brackets.close()
    if args.clients:
        out.update(client_rates(port, size, count, threads, batch))
    return out


def report(size: int, results: list[dict[str, float]]) -> dict[str, float]:
    """Print one size's figures; its ratios (median over rounds)."""
    best = {
        name: (min if name.endswith("cpu") else max)(r[name] for r in results)
        for name in results[0]
        if not name.endswith("bracket")
    }
    # against the baseline runs right before and after the side; the round's first baseline in parentheses
    bases = {
        side: base
        for side, base in (
            ("store put", "set"),
            ("store get", "get"),
            ("store get_into", "get"),
            ("tier store", "set"),
            ("tier load", "get"),
        )
        if side in best
    }
    ratio = {
        side: statistics.median(r[side] / r[f"{side} bracket"] for r in results) for side in bases
    }
    first = {
        side: statistics.median(r[side] / r[f"bench {base}"] for r in results)
        for side, base in bases.items()
    }
    # against the plain tier, not redis-benchmark
    ratio.update(
        {
            f"tier keyed {side}": statistics.median(
                r[f"tier keyed {side}"] / r[f"tier {side}"] for r in results
            )
            for side in ("store", "load")
        }
    )
    print(
        f"{size >> 20} MiB  redis-benchmark SET (new keys) {best['bench set']:.2f}, GET {best['bench get']:.2f} "
        f"GB/s; SET over existing keys {best['bench set over']:.2f}"
    )
    print(
        f"      ({', '.join(f'{k[6:]} {v:.2f}' for k, v in best.items() if k.startswith('bench ') and '-P' in k)})"
    )
    for side, value in best.items():
        if not side.startswith("bench"):
            extra = ""
            if side in first:
                extra = f"  ({ratio[side]:.2f}x its brackets, {first[side]:.2f}x the round's first baseline)"
            elif side in ratio:
                extra = f"  ({ratio[side]:.2f}x plain)"
            unit = "s/GB of client CPU" if side.endswith("cpu") else "GB/s"
            print(f"      {side:20s} {value:5.2f} {unit}{extra}")
    return ratio


def mac_rates() -> None:
    """Print the keyed-mode MAC candidates' GB/s on one thread (and xxh3's, for scale)."""
    key = os.urandom(32)
    candidates = {
        "keyed BLAKE3": lambda buf: blake3(buf, key=key).digest(),
        "keyed BLAKE2b": lambda buf: hashlib.blake2b(buf, key=key).digest(),
        "xxh3 (unkeyed)": lambda buf: xxhash.xxh3_64_intdigest(buf),
    }
    for size in SIZES:
        buf = memoryview(np.random.default_rng(2).integers(0, 256, size, np.uint8))
        rates = {}
        for name, mac in candidates.items():
            best = math.inf
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(4):
                    mac(buf)
                best = min(best, (time.perf_counter() - start) / 4)
            rates[name] = size / best / GB
        print(
            f"MACs, {size >> 20} MiB, one thread: "
            + ", ".join(f"{k} {v:.2f}" for k, v in rates.items())
            + " GB/s"
        )


def s3_ratios(quick: bool) -> dict[str, float]:
    """benchmarks/s3_bench.py's ratios, or nan while that module is not there."""
    try:
        import s3_bench
    except ModuleNotFoundError as exc:
        if exc.name != "s3_bench":
            raise
        print("s3: benchmarks/s3_bench.py is not there yet")
        return {"s3_store_ratio": math.nan, "s3_load_ratio": math.nan}
    return s3_bench.measure(quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="128 MiB written per size and side, 2 rounds"
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--threads", type=int, default=2, help="client threads (redis-benchmark -c)"
    )
    parser.add_argument("--batch", type=int, default=8, help="names per call (redis-benchmark -P)")
    parser.add_argument(
        "--clients", action="store_true", help="also redis-py's pipeline and glide-sync"
    )
    parser.add_argument(
        "--no-s3", action="store_true", help="skip benchmarks/s3_bench.py (its ratios: nan)"
    )
    args = parser.parse_args()
    if shutil.which("redis-benchmark") is None:
        raise SystemExit(
            "redis-benchmark not found on PATH: apt-get install -y redis-server (or `make test`)"
        )
    rounds = (args.rounds or 2) if args.quick else (args.rounds or 4)
    # the bytes redis-benchmark sets
    total = SET_PER_KEY * (WORKING_SET // 2 if args.quick else WORKING_SET)
    ratios: dict[str, list[float]] = {}
    mac_rates()
    with RedisServer.temporary(prefix="kvtier-bench-redis-") as server:
        port = server.port
        version = redis.Redis(port=port).info("server")["redis_version"]
        print(
            f"redis-server {version} on 127.0.0.1:{port}; {args.threads} threads, {args.batch} names per call; "
            f"{total >> 20} MiB written and {LOAD_PASSES * total >> 20} read per size and side, {rounds} rounds"
        )
        for size in SIZES:
            count = max(total // size, args.threads * args.batch * 2)
            results = [
                one_round(port, size, count, args, f"{size}-{r}", keyed_first=r % 2 == 1)
                for r in range(rounds)
            ]
            for side, value in report(size, results).items():
                ratios.setdefault(side, []).append(value)
    redis_store = min(ratios["tier store"])
    redis_load = min(ratios["tier load"])
    keyed_store = min(ratios["tier keyed store"])
    keyed_load = min(ratios["tier keyed load"])
    s3 = {"s3_store_ratio": math.nan, "s3_load_ratio": math.nan}
    if not args.no_s3:
        s3 = s3_ratios(args.quick)
    print(
        f"RESULT redis_store_ratio={redis_store:.2f} redis_load_ratio={redis_load:.2f} "
        f"s3_store_ratio={s3['s3_store_ratio']:.2f} s3_load_ratio={s3['s3_load_ratio']:.2f} "
        f"keyed_store_ratio={keyed_store:.2f} keyed_load_ratio={keyed_load:.2f}"
    )


if __name__ == "__main__":
    main()
