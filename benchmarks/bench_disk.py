"""DiskTier store and load GB/s against `dd` with O_DIRECT on the same filesystem, plus the
index's memory per chunk and the start-up scan rate.

For chunks of 1, 2 and 4 MiB (world size 1), a DiskTier stores N chunks from the rows of a
real host slab (`HostSlab`: a populated MAP_SHARED segment in /dev/shm, what the tier serves in
an engine), in jobs of 8 chunks with up to 8 jobs in flight as the tiered manager submits them,
then loads them all back; every byte is checksummed both ways. (O_DIRECT throughput depends on
the destination memory: the slab's pages come in ~2x longer physically contiguous runs than
anonymous memory faulted in by numpy, so each request carries fewer segments; see
benchmarks/README.md.)
The baseline, in the same round on the same filesystem, is

    dd if=/dev/zero of=F bs=<chunk> count=N oflag=direct     (write)
    dd if=F of=/dev/null bs=<chunk> iflag=direct             (read)

The page cache cannot be dropped here, so the tier's figures are honest only with O_DIRECT:
the output says whether it was used. Each side's GB/s column is its best round; each ratio is
the median over rounds of that round's tier/dd ratio (paired: the disk's drift cancels).
disk_store_ratio and disk_load_ratio are the lowest over the chunk sizes.

Also: bytes of memory per chunk of the tier's index at 1 M chunks (tracemalloc around
inserting 1 M 36-byte keys into the policy one at a time, as stores do), and files per second
of the start-up scan over 10,000 files (names only, as the scan reads no contents).

Usage: python benchmarks/bench_disk.py [--quick] [--dir DIR] [--rounds R] [--anon-rows]
Last line: RESULT disk_store_ratio=<x> disk_load_ratio=<y> index_bytes_per_chunk=<z> scan_files_per_s=<w>
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from kvtier.policies import make_policy
from kvtier.slab import HostSlab
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from tier_driver import bench_key, run_jobs

CHUNK_SIZES = (1 << 20, 2 << 20, 4 << 20)
KEYS_PER_JOB = 8
JOBS_IN_FLIGHT = 8
GB = 1e9


def namespace(slot_bytes: int) -> Namespace:
    return Namespace("bench", "bfloat16", "blocks", 16, 4, "sha256_cbor", 1, slot_bytes)


def dd(args: list[str]) -> float:
    """GB/s that dd reports (bytes and seconds from its last stderr line)."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    line = done.stderr.strip().splitlines()[-1]
    match = re.match(r"(\d+) bytes .* copied, ([\d.]+) s", line)
    if match is None:
        raise RuntimeError(f"cannot parse dd's output: {line!r}")
    return int(match[1]) / float(match[2]) / GB


def disk_gbps(tier: DiskTier, rows: np.ndarray, chunks: range, is_store: bool) -> float:
    """Store (or load) `chunks` through `rows`, jobs of KEYS_PER_JOB, as many in flight as `rows` holds; GB/s."""
    seconds = run_jobs(
        tier, rows, len(chunks), KEYS_PER_JOB, is_store, poll_s=0.0002, first_key=chunks.start
    )
    return len(chunks) * rows.shape[1] / seconds / GB


def one_round(work: Path, chunk: int, num_chunks: int, rows: np.ndarray) -> dict[str, float]:
    """Tier fill, dd write, tier store at capacity, dd read, tier load: each next to its baseline."""
    data = work / "dd.bin"
    root = work / "tier"
    ns = namespace(chunk)
    with DiskTier(root, ns, capacity_bytes=num_chunks * (chunk + 4096)) as tier:
        tier.wait_scanned(10)
        # an empty tier: new files
        out = {"fill": disk_gbps(tier, rows, range(num_chunks), is_store=True)}
        out["dd_write"] = dd(
            ["if=/dev/zero", f"of={data}", f"bs={chunk}", f"count={num_chunks}", "oflag=direct"]
        )
        # each evicts one
        out["store"] = disk_gbps(tier, rows, range(num_chunks, 2 * num_chunks), is_store=True)
        out["dd_read"] = dd([f"if={data}", "of=/dev/null", f"bs={chunk}", "iflag=direct"])
        out["load"] = disk_gbps(tier, rows, range(num_chunks, 2 * num_chunks), is_store=False)
        c = tier.stats().counters
        out["direct"] = float(
            c["store_direct_chunks"] == c["store_chunks"] and c["load_buffered_chunks"] == 0
        )
    data.unlink()
    shutil.rmtree(root)
    return out


def bench_chunk_size(
    work: Path, chunk: int, total_bytes: int, rounds: int, anon_rows: bool = False
) -> tuple[float, float]:
    num_chunks = max(total_bytes // chunk, 2 * KEYS_PER_JOB * JOBS_IN_FLIGHT)
    num_rows = KEYS_PER_JOB * JOBS_IN_FLIGHT
    # the method before: anonymous memory, faulted in by numpy's fill
    if anon_rows:
        slab = contextlib.nullcontext()
        rows = np.frombuffer(mmap.mmap(-1, num_rows * chunk), np.uint8)
        rows = rows.reshape(num_rows, chunk)
    # the memory the tier reads into and writes from in an engine
    else:
        slab = HostSlab(f"kvtier-bench-disk-{os.getpid()}-{chunk}", num_rows, chunk, owner=True)
        rows = slab.rows
    with slab:
        rows[:] = np.random.default_rng(0).integers(0, 256, rows.shape, dtype=np.uint8)
        results = [one_round(work, chunk, num_chunks, rows) for _ in range(rounds)]
        # a live view would keep the mapping after close
        del rows
    best = {
        name: max(r[name] for r in results)
        for name in ("dd_write", "fill", "store", "dd_read", "load")
    }
    fill_ratio, store_ratio, load_ratio = (
        statistics.median(r[side] / r[base] for r in results)
        for side, base in (("fill", "dd_write"), ("store", "dd_write"), ("load", "dd_read"))
    )
    direct = (
        "O_DIRECT"
        if all(r["direct"] for r in results)
        else "page cache (NOT O_DIRECT: figures flattered)"
    )
    print(
        f"{chunk >> 20} MiB x {num_chunks}: dd write {best['dd_write']:.2f} GB/s, tier fill {best['fill']:.2f}"
        f" ({fill_ratio:.2f}x), tier store at capacity {best['store']:.2f} ({store_ratio:.2f}x) | dd read"
        f" {best['dd_read']:.2f}, tier load {best['load']:.2f} ({load_ratio:.2f}x) | tier I/O: {direct}"
    )
    return store_ratio, load_ratio


def index_bytes_per_chunk(num_keys: int) -> float:
    """Memory of the index (the LRU policy plus its key objects) per chunk, at num_keys chunks."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = make_policy("lru", num_keys)
    for i in range(num_keys):
        index.insert([bench_key(i)])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(index) == num_keys
    return used / num_keys


def scan_files_per_s(work: Path, num_files: int) -> float:
    """Start a DiskTier on a directory of `num_files` chunk files; files indexed per second."""
    root = work / "scan"
    ns = namespace(4096)
    directory = root / ns.id_hex
    for i in range(num_files):
        name = bench_key(i).hex()
        (directory / name[:2]).mkdir(parents=True, exist_ok=True)
        # the scan reads names, not contents
        (directory / name[:2] / f"{name}.kv").touch()
    start = time.perf_counter()
    with DiskTier(root, ns, capacity_bytes=2 * num_files * 8192) as tier:
        tier.wait_scanned(60)
        seconds = time.perf_counter() - start
        assert tier.stats().counters["scanned_files"] == num_files
    shutil.rmtree(root)
    return num_files / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB per chunk size, 3 rounds")
    parser.add_argument(
        "--dir", type=Path, default=Path("."), help="where to write (the filesystem measured)"
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--anon-rows",
        action="store_true",
        help="anonymous-memory rows instead of a host slab (the method before; loads run slower)",
    )
    args = parser.parse_args()
    total_bytes = (256 if args.quick else 2048) << 20
    rounds = args.rounds or (3 if args.quick else 5)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-disk-", dir=args.dir))
    try:
        print(
            f"writing under {work} ({total_bytes >> 20} MiB per chunk size and round, {rounds} rounds, "
            f"{os.cpu_count()} CPUs; tier: 4 read + 4 write threads, jobs of {KEYS_PER_JOB}, "
            f"{JOBS_IN_FLIGHT} in flight; rows: {'anonymous memory' if args.anon_rows else 'host slab'})"
        )
        ratios = [
            bench_chunk_size(work, chunk, total_bytes, rounds, args.anon_rows)
            for chunk in CHUNK_SIZES
        ]
        index_bytes = index_bytes_per_chunk(1_000_000)
        print(f"index: {index_bytes:.0f} bytes per chunk at 1,000,000 chunks (36-byte keys, LRU)")
        scan_rate = scan_files_per_s(work, 10_000)
        print(f"start-up scan: {scan_rate:,.0f} files/s over 10,000 files (dentries cached)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    store_ratio = min(r[0] for r in ratios)
    load_ratio = min(r[1] for r in ratios)
    print(
        f"RESULT disk_store_ratio={store_ratio:.2f} disk_load_ratio={load_ratio:.2f} "
        f"index_bytes_per_chunk={index_bytes:.0f} scan_files_per_s={scan_rate:.0f}"
    )


if __name__ == "__main__":
    main()
