"""S3 tier put / get GB/s against the bare client (obstore) on the same SeaweedFS, in the same run.

For values of 1, 2 and 4 MiB (a 128-byte header and the payload, as the tier stores them), on
one `weed mini` started here (benchmarks/servers/s3.py, loopback, a temporary directory):

- baseline, obstore alone: `obstore.put(mode="create")` of N values, each one contiguous
  buffer, from 16 threads; then `obstore.get(...).bytes()` of each, from 16 threads.
- S3Store: one `put` of the N (name, [header, payload]) items, then one `get` of the N names
  (its pool: `max_connections=16`, so 16 requests in flight, as the baseline).
- RemoteTier on an S3Store: store and load jobs of 8 keys from / into numpy rows, 8 jobs in
  flight, `io_threads=4`: with the value header, the xxh3 checksums and the slab copies.
- `--boto3`: boto3 too, without payload signing or checksums (the client comparison that
  chose obstore; see kvtier.tiers.remote.s3).

Beside each GB/s: this process's CPU seconds per GB meanwhile. The server shares the 2 cores
and is the bottleneck of every put (~0.25 GB/s), so a client's CPU is taken from it. The
server keeps one volume for the whole run: allocating the next one stalls writes for ~1 s,
which landed on whichever side happened to fill a volume.

Each GB/s figure is the best over rounds; each ratio is the median over rounds of that
round's side / baseline (paired: the server's drift cancels). `s3_store_ratio` and
`s3_load_ratio` are the tier's, the lowest over the sizes; `s3_put_ratio` / `s3_get_ratio` are the S3Store's alone.

Usage: python benchmarks/s3_bench.py [--quick] [--rounds R] [--boto3] [--dir DIR]
Last line: RESULT s3_store_ratio=<x> s3_load_ratio=<y> s3_put_ratio=<z> s3_get_ratio=<w>
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import obstore
from obstore.store import S3Store as ObjectStore

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.s3 import S3Store
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.secondary import HEADER_BYTES

# benchmarks/servers/, on sys.path above
from servers.s3 import SeaweedFS
from tier_driver import run_jobs

__all__ = ["measure"]

SIZES = (1 << 20, 2 << 20, 4 << 20)
# requests in flight: the baseline's threads, S3Store's max_connections
CONCURRENCY = 16
KEYS_PER_JOB = 8
JOBS_IN_FLIGHT = 8
IO_THREADS = 4
# distinct source buffers, reused round-robin
NUM_ROWS = 64
GB = 1e9


def measure(
    quick: bool, rounds: int | None = None, with_boto3: bool = False, directory: Path | None = None
) -> dict[str, float]:
    """Start SeaweedFS (its data under `directory`: the system's temporary directory by default),
    measure every side at every size (printing a table), stop it; the figures."""
    total, rounds = (32 << 20, rounds or 3) if quick else (128 << 20, rounds or 5)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-s3-", dir=directory))
    figures: dict[str, float] = {}
    try:
        # one volume for the whole run: allocating the next one stalls writes ~1 s (see SeaweedFS)
        volume_mb = max(1024, min(10 << 10, shutil.disk_usage(work).free // 2 >> 20))
        with SeaweedFS(work, volume_mb=volume_mb) as server:
            print(
                f"SeaweedFS (weed mini) at {server.endpoint}, started in {server.start_seconds:.2f} s; "
                f"{total >> 20} MiB per size, side and round, {rounds} rounds, {CONCURRENCY} requests in flight"
            )
            for size in SIZES:
                count = max(total // size, 2 * KEYS_PER_JOB)
                results = [
                    one_round(server, size, count, f"{size >> 20}m{r}", with_boto3)
                    for r in range(rounds)
                ]
                figures.update(report(size, count, results))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, side in (
        ("s3_store_ratio", "tier_store"),
        ("s3_load_ratio", "tier_load"),
        ("s3_put_ratio", "store_put"),
        ("s3_get_ratio", "store_get"),
    ):
        figures[name] = min(figures[f"{side}_ratio_{size >> 20}mib"] for size in SIZES)
    return figures


def one_round(
    server: SeaweedFS, size: int, count: int, tag: str, with_boto3: bool
) -> dict[str, float]:
    """GB/s of every side (each on names of its own), then the names are deleted."""
    rng = np.random.default_rng(len(tag))
    # the baseline's contiguous values
    values = rng.integers(0, 256, (NUM_ROWS, size), np.uint8)
    # the store's: a header part + a payload part
    payloads = values[:, HEADER_BYTES:]
    header = bytes(HEADER_BYTES)
    store = S3Store(
        server.endpoint,
        server.bucket,
        access_key_id=server.access_key_id,
        secret_access_key=server.secret_access_key,
        max_connections=CONCURRENCY,
        timeout_ms=30_000,
    )
    out = bare_rates(server, [f"bare-{tag}/{i}" for i in range(count)], values)
    names = [f"store-{tag}/{i}" for i in range(count)]
    timed(
        out,
        "store put",
        count * size,
        lambda: store.put(
            [(name, [header, memoryview(payloads[i % NUM_ROWS])]) for i, name in enumerate(names)]
        ),
    )
    got: list = []
    timed(out, "store get", count * size, lambda: got.extend(store.get(names)))
    if bytes(got[-1]) != header + payloads[(count - 1) % NUM_ROWS].tobytes():
        raise RuntimeError("S3Store returned other bytes than it stored")
    out.update(tier_rates(server, size, count, f"tier-{tag}"))
    if with_boto3:
        out.update(boto3_rates(server, [f"boto3-{tag}/{i}" for i in range(count)], values))
    for prefix in ("bare", "store", "tier", "boto3"):
        store.delete(list(store.list_names(f"{prefix}-{tag}")))
    store.close()
    return out


def timed(out: dict[str, float], side: str, num_bytes: int, fn: Callable[[], object]) -> None:
    """out[side]: GB/s of `fn`; out["cpu " + side]: this process's CPU seconds per GB meanwhile (the
    server, in its own process, shares the 2 cores: a client's CPU is taken from the server)."""
    cpu = time.process_time()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    out[side] = num_bytes / seconds / GB
    out[f"cpu {side}"] = (time.process_time() - cpu) / (num_bytes / GB)


def bare_rates(server: SeaweedFS, names: list[str], values: np.ndarray) -> dict[str, float]:
    """obstore alone, configured as S3Store configures it: put / get GB/s from CONCURRENCY threads."""
    client = ObjectStore(
        server.bucket,
        endpoint=server.endpoint,
        region="us-east-1",
        access_key_id=server.access_key_id,
        secret_access_key=server.secret_access_key,
        unsigned_payload=True,
        retry_config={"max_retries": 0},
        client_options={
            "allow_http": True,
            "timeout": "30s",
            "pool_max_idle_per_host": str(CONCURRENCY),
        },
    )
    num_bytes = len(names) * values.shape[1]
    out = {}
    got: list = []
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        timed(
            out,
            "bare put",
            num_bytes,
            lambda: list(
                pool.map(
                    lambda i: obstore.put(
                        client, names[i], memoryview(values[i % NUM_ROWS]), mode="create"
                    ),
                    range(len(names)),
                )
            ),
        )
        timed(
            out,
            "bare get",
            num_bytes,
            lambda: got.extend(pool.map(lambda name: obstore.get(client, name).bytes(), names)),
        )
    if bytes(got[-1]) != values[(len(names) - 1) % NUM_ROWS].tobytes():
        raise RuntimeError("obstore returned other bytes than it stored")
    return out


def boto3_rates(server: SeaweedFS, names: list[str], values: np.ndarray) -> dict[str, float]:
    """boto3 from CONCURRENCY threads, without payload signing or checksums (as obstore here)."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=server.access_key_id,
        aws_secret_access_key=server.secret_access_key,
        config=Config(
            max_pool_connections=CONCURRENCY,
            retries={"max_attempts": 1},
            s3={"payload_signing_enabled": False},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )
    bodies = [row.tobytes() for row in values]
    num_bytes = len(names) * values.shape[1]
    out = {}
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        timed(
            out,
            "boto3 put",
            num_bytes,
            lambda: list(
                pool.map(
                    lambda i: client.put_object(
                        Bucket=server.bucket,
                        Key=names[i],
                        Body=bodies[i % NUM_ROWS],
                        IfNoneMatch="*",
                    ),
                    range(len(names)),
                )
            ),
        )
        timed(
            out,
            "boto3 get",
            num_bytes,
            lambda: list(
                pool.map(
                    lambda name: client.get_object(Bucket=server.bucket, Key=name)["Body"].read(),
                    names,
                )
            ),
        )
    return out


def tier_rates(server: SeaweedFS, size: int, count: int, prefix: str) -> dict[str, float]:
    """RemoteTier store / load GB/s (bytes of values, header included, as the other sides)."""
    namespace = Namespace(
        "bench", "bfloat16", "blocks", 16, 4, "sha256_cbor", 1, size - HEADER_BYTES
    )
    store = S3Store(
        server.endpoint,
        server.bucket,
        access_key_id=server.access_key_id,
        secret_access_key=server.secret_access_key,
        max_connections=CONCURRENCY,
        timeout_ms=30_000,
    )
    tier = RemoteTier(store, namespace, prefix=prefix, io_threads=IO_THREADS, enable_events=False)
    rows = np.random.default_rng(1).integers(
        0, 256, (KEYS_PER_JOB * JOBS_IN_FLIGHT, size - HEADER_BYTES), np.uint8
    )
    out: dict[str, float] = {}
    try:
        for side in ("store", "load"):
            timed(
                out,
                f"tier {side}",
                count * size,
                lambda side=side: run_jobs(
                    tier, rows, count, KEYS_PER_JOB, side == "store", poll_s=0.001
                ),
            )
        return out
    finally:
        tier.close()


def report(size: int, count: int, results: list[dict[str, float]]) -> dict[str, float]:
    """Print one size's figures; the best GB/s of each side and each side's median ratio to its baseline."""
    mib = f"{size >> 20}mib"
    figures: dict[str, float] = {}
    print(f"{size >> 20} MiB x {count}:")
    for side in (side for side in results[0] if not side.startswith("cpu ")):
        direction = "put" if side.endswith(("put", "store")) else "get"
        best = max(r[side] for r in results)
        cpu = statistics.median(r[f"cpu {side}"] for r in results)
        figures[f"{side.replace(' ', '_')}_gbps_{mib}"] = best
        figures[f"{side.replace(' ', '_')}_cpu_s_per_gb_{mib}"] = cpu
        extra = ""
        if not side.startswith("bare"):
            ratio = statistics.median(r[side] / r[f"bare {direction}"] for r in results)
            figures[f"{side.replace(' ', '_')}_ratio_{mib}"] = ratio
            extra = f"   {ratio:.2f}x obstore's {direction}"
        print(f"    {side:12s} {best:5.2f} GB/s   client CPU {cpu:5.2f} s/GB{extra}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="32 MiB per size, side and round (16 values at least), 3 rounds",
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--boto3", action="store_true", help="also boto3 (pip install boto3)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the server keeps its data (e.g. /dev/shm: no disk in the figures; "
        "a full run writes ~6 GB, deleted objects' space is not reclaimed)",
    )
    args = parser.parse_args()
    figures = measure(args.quick, args.rounds, args.boto3, args.dir)
    print(
        f"RESULT s3_store_ratio={figures['s3_store_ratio']:.2f} s3_load_ratio={figures['s3_load_ratio']:.2f} "
        f"s3_put_ratio={figures['s3_put_ratio']:.2f} s3_get_ratio={figures['s3_get_ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
