"""GPU check of kvtier's CUDA copy path: byte-exact round trips engine <-> slab, and store/load
GB/s against one pinned `copy_(non_blocking=True)` of the same bytes, measured in the same run.

It drives kvtier's real worker, `kvtier.worker.TransferEngine`, over KV tensors on the GPU and a
shared-memory `HostSlab` as kvtier's workers use (a private pinned slab where /dev/shm has no room,
said in its output), as tests/test_transfer_engine.py and bench_transfer.py do on CPU; nothing
here copies KV itself.

Round trips (each must return every byte; compared as int16 bit patterns, NaNs included): for
each layout, dtype and block size, chunks at random blocks are stored into the slab by many jobs
submitted at once (one chunk per job), the KV is zeroed, and the chunks are loaded back the same
way; blocks that were not loaded must still be zero. Layouts: K/V-first per layer
`(2, num_blocks, block_size, heads, head_dim)` (vLLM's CUDA FlashAttention), block-first per layer
`(num_blocks, 2, block_size, heads, head_dim)`, cross-layer (one buffer
`(num_blocks, layers, 2, block_size, heads, head_dim)`, each layer a view); bf16 and fp16; 16- and
256-token blocks; 32 layers. A failed copy: one store job also names a block past the end; that
chunk must fail alone (the job's other chunk is part of the round trip).

Throughput: K/V-first bf16, one chunk per job at random blocks, every job submitted at once; the
wall time from the first submit to the last result, per direction, against one
`copy_(non_blocking=True)` of the same number of bytes between a GPU tensor and a pinned host
tensor in the same direction, in the same round. Ratios are the median of per-round ratios.
16-token blocks: 2 MiB jobs (64 runs of 32 KiB); 256-token blocks: 32 MiB jobs (64 runs of 512 KiB).
The RESULT ratios are the 16-token row's (issue 36's goal: >= 0.9 both ways for >= 1 MiB jobs).

Two copy paths, compared in one run:
- as built: the backend `TransferEngine` makes in this process, with vLLM's kernels importable
  when they load here (`vllm._custom_ops` imports and `torch.ops._C_cache_ops.swap_blocks_batch`
  exists): the `swap_blocks_batch` path where the backend uses them (store_ratio, load_ratio);
- per-run: the same steps in a child process where `vllm._custom_ops` and vLLM's Triton swap module
  cannot be imported, so the backend takes its fallback, one `copy_` per byte run
  (per_run_store_ratio, per_run_load_ratio).
Which path each process took is what kvtier logs when it makes the backend (printed as `kvtier
said:`; a line "kvtier: CUDA copies on cuda:N: <path>; host slab pinned=<0|1>"). The per-run child
relies on the backend's fallback rule (`select_copy_paths`: vLLM's kernels found by importing
`vllm._custom_ops`); the backend has no switch of its own between the two paths.
Where vLLM's kernels do not load (vLLM absent, or its CUDA extension not built for this torch),
the as-built path is the per-run one: measured once, store_ratio and load_ratio print `na`.

Last line:
    RESULT roundtrip_ok=<0|1> store_ratio=<x> load_ratio=<x> per_run_store_ratio=<x> per_run_load_ratio=<x>
Without a CUDA GPU it says so, measures nothing and exits 0; its last line is
`RESULT skipped=no-gpu`. `--cpu-dry-run` runs every step on small tensors through kvtier's CPU
backend (the suite's check that this script works) and claims no figure either:
`RESULT skipped=cpu-dry-run roundtrip_ok=<0|1>`.

Usage: PYTHONPATH=src python benchmarks/gpu_check.py [--quick] [--total-mib 1024] [--rounds 5]
It needs kvtier's dependencies (numpy, cbor2, xxhash, blake3, built for that Python) beside
torch; without them it says which is missing, exits 1, last line `RESULT skipped=kvtier-not-importable`.
vLLM's kernels: a vLLM package built for that torch, importable (e.g. on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

LAYOUTS = ("kv_first", "block_first", "cross_layer")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BLOCK_SIZES = (16, 256)
# blocks per chunk: a chunk of ~2 MiB (16 tokens) or ~32 MiB (256 tokens) per 32-layer block
ROUND_TRIP_BPC = {16: 2, 256: 1}
# vLLM's modules that hold its copy kernels: hidden in the per-run child
VLLM_KERNEL_MODULES = ("vllm._custom_ops", "vllm.v1.kv_offload.cpu.swap_blocks_triton")
CHILD_MARK = "GPU_CHECK_CHILD "
# a hang, not slowness: jobs of a few hundred MiB take milliseconds on a GPU
WAIT_S = 120.0


@dataclass(frozen=True, slots=True)
class Model:
    """The KV shape measured (default: Llama-3-8B's, 32 layers of 8 KV heads of 128)."""

    num_layers: int
    num_heads: int
    head_dim: int


class KvtierLog(logging.Handler):
    """kvtier's INFO and above, kept to say which copy path and slab the backend chose."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if line not in self.lines:
            self.lines.append(line)


def vllm_kernels_load() -> bool:
    """Whether vLLM's batched copy kernel can run here (its Python op and its CUDA extension)."""
    try:
        import vllm._custom_ops  # noqa: F401

        return hasattr(torch.ops._C_cache_ops, "swap_blocks_batch")
    except Exception:
        return False


def kvtier_missing() -> str | None:
    """Why kvtier's worker cannot be imported (a GPU machine with torch alone lacks kvtier's
    other dependencies: cbor2, xxhash, blake3), or None."""
    try:
        import kvtier.worker  # noqa: F401
    except ImportError as e:
        return f"{e.name or e}: {e}"
    return None


def make_kv(
    layout: str, model: Model, block_size: int, num_blocks: int, dtype: torch.dtype, device
) -> dict[str, torch.Tensor]:
    """KV tensors of random bit patterns in `layout`, as an engine registers them."""
    page = (block_size, model.num_heads, model.head_dim)
    if layout == "cross_layer":
        shape = (num_blocks, model.num_layers, 2, *page)
    else:
        shape = (model.num_layers, 2, num_blocks, *page)
    bits = torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16, device=device)
    buffer = bits.view(dtype)
    if layout == "kv_first":
        tensors = [buffer[i] for i in range(model.num_layers)]
    elif layout == "block_first":
        tensors = [buffer[i].transpose(0, 1).contiguous() for i in range(model.num_layers)]
    else:
        tensors = [buffer[:, i] for i in range(model.num_layers)]
    return {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(tensors)}


def kv_layout_of(layout: str) -> str:
    """`TransferEngine`'s kv_layout for a layout here."""
    return "kv_first" if layout == "kv_first" else "blocks_first"


def block_bytes(kv: dict[str, torch.Tensor], layout: str, block_ids: np.ndarray) -> list:
    """Copies of the blocks' bytes, as int16, one per layer."""
    index = torch.from_numpy(block_ids).to(next(iter(kv.values())).device)
    block_dim = 1 if layout == "kv_first" else 0
    return [t.index_select(block_dim, index).view(torch.int16).clone() for t in kv.values()]


_slab_names = itertools.count()


@contextlib.contextmanager
def engine_over(kv: dict[str, torch.Tensor], bpc: int, num_slots: int, layout: str):
    """A `TransferEngine` over a shared-memory `HostSlab` as kvtier's workers use (pinned through
    the engine's own registration on CUDA); over a private pinned slab where /dev/shm has no room
    (a container's default 64 MiB), said in its output."""
    from kvtier.errors import ConfigError
    from kvtier.slab import HostSlab
    from kvtier.worker import TransferEngine

    num_blocks = next(iter(kv.values())).shape[1 if layout == "kv_first" else 0]
    slot_bytes = bpc * sum(t.numel() * t.element_size() for t in kv.values()) // num_blocks
    name = f"kvtier-gpu-check-{os.getpid()}-{next(_slab_names)}"
    with contextlib.ExitStack() as stack:
        try:
            slab = stack.enter_context(HostSlab(name, num_slots, slot_bytes, owner=True))
        except (ConfigError, OSError) as e:
            print(
                f"  (private pinned slab: no shared-memory slab of {num_slots * slot_bytes >> 20} MiB: {e})"
            )
            slab = None
        engine = TransferEngine(kv, bpc, num_slots, kv_layout=kv_layout_of(layout), slab=slab)
        # the engine ends before its slab closes
        with engine:
            yield engine


def make_job(job_id: int, is_store: bool, slot_ids, block_ids):
    from kvtier.jobs import Endpoint, TransferJob, TransferPart

    part = TransferPart(group=0, slot_ids=np.asarray(slot_ids), block_ids=np.asarray(block_ids))
    ends = (Endpoint.ENGINE, Endpoint.SLAB)
    return TransferJob(
        job_id=job_id,
        req_id="gpu-check",
        src=ends[0] if is_store else ends[1],
        dst=ends[1] if is_store else ends[0],
        deadline=math.inf,
        parts=(part,),
    )


def run_jobs(engine, jobs: list) -> dict:
    """Submit every job at once, wait for all; their results by job id."""
    for job in jobs:
        engine.submit(job)
    if not engine.wait([job.job_id for job in jobs], timeout=WAIT_S):
        raise RuntimeError(f"jobs did not finish in {WAIT_S} s")
    return {result.job_id: result for result in engine.get_finished()}


def chunk_jobs(first_id: int, is_store: bool, blocks: np.ndarray, slots: np.ndarray) -> list:
    """One job per chunk: chunk i is `blocks[i]` <-> `slots[i]`."""
    return [
        make_job(first_id + i, is_store, [slot], chunk)
        for i, (chunk, slot) in enumerate(zip(blocks, slots, strict=True))
    ]


def check_round_trip(layout: str, dtype_name: str, block_size: int, args, device) -> bool:
    """Store chunks (and one bad chunk), zero the KV, load them back: True if every byte returns."""
    bpc = ROUND_TRIP_BPC[block_size]
    num_blocks = args.round_trip_blocks[block_size]
    num_chunks = num_blocks // (2 * bpc)
    kv = make_kv(layout, args.model, block_size, num_blocks, DTYPES[dtype_name], device)
    rng = np.random.default_rng(block_size)
    blocks = rng.permutation(num_blocks)[: num_chunks * bpc].reshape(num_chunks, bpc)
    slots = rng.permutation(num_chunks)
    expected = block_bytes(kv, layout, blocks.ravel())
    # one slot more than chunks: the bad chunk's, never written
    with engine_over(kv, bpc, num_chunks + 1, layout) as engine:
        stores = chunk_jobs(0, True, blocks[:-1], slots[:-1])
        # the last chunk goes with a chunk naming a block past the end: that one fails alone
        bad = np.concatenate([blocks[-1], np.full(bpc, num_blocks)])
        stores.append(make_job(len(stores), True, [slots[-1], num_chunks], bad))
        stored = run_jobs(engine, stores)
        for t in kv.values():
            t.zero_()
        loaded = run_jobs(engine, chunk_jobs(len(stores), False, blocks, slots))
    bad_alone = stored.pop(len(stores) - 1).failed_chunks == (1,)
    all_ok = all(r.success for r in [*stored.values(), *loaded.values()])
    got = block_bytes(kv, layout, blocks.ravel())
    exact = all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    others = np.setdiff1d(np.arange(num_blocks), blocks.ravel())
    untouched = all(not t.any() for t in block_bytes(kv, layout, others))
    ok = bad_alone and all_ok and exact and untouched
    print(f"round trip {layout:>11} {dtype_name} {block_size:>3}-token blocks, {num_chunks} jobs: "
          f"{'ok' if ok else 'FAILED'} (bytes exact {exact}, others untouched {untouched}, "
          f"jobs ok {all_ok}, bad chunk failed alone {bad_alone})")  # fmt: skip
    return ok


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, action) -> float:
    sync(device)
    start = time.perf_counter()
    action()
    sync(device)
    return time.perf_counter() - start


def bench(block_size: int, args, device: torch.device) -> tuple[float, ...]:
    """(store, load, copy-out, copy-in) GB/s, best round; (store, load) ratios, median of rounds."""
    model = args.model
    block_bytes_ = 2 * model.num_layers * block_size * model.num_heads * model.head_dim * 2
    num_chunks = max(4, args.total_mib * (1 << 20) // block_bytes_)
    total = num_chunks * block_bytes_
    kv = make_kv("kv_first", model, block_size, 2 * num_chunks, torch.bfloat16, device)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(2 * num_chunks)[:num_chunks].reshape(num_chunks, 1)
    slots = rng.permutation(num_chunks)
    on_gpu = torch.empty(total, dtype=torch.int8, device=device)
    pinned = torch.empty(total, dtype=torch.int8, pin_memory=device.type == "cuda")
    rounds = []
    with engine_over(kv, 1, num_chunks, "kv_first") as engine:
        job_id = 0
        # round 0 warms up (allocations, first launches) and is not counted
        for _ in range(args.rounds + 1):
            times = []
            for is_store in (True, False):
                jobs = chunk_jobs(job_id, is_store, blocks, slots)
                job_id += len(jobs)
                times.append(timed(device, lambda jobs=jobs: check_all(run_jobs(engine, jobs))))
            times.append(timed(device, lambda: pinned.copy_(on_gpu, non_blocking=True)))
            times.append(timed(device, lambda: on_gpu.copy_(pinned, non_blocking=True)))
            rounds.append(times)
    rounds = rounds[1:]
    best = [total / min(r[i] for r in rounds) / 1e9 for i in range(4)]
    ratios = [float(np.median([r[i + 2] / r[i] for r in rounds])) for i in range(2)]
    return (*best, *ratios)


def check_all(results: dict) -> None:
    failed = [r for r in results.values() if not r.success]
    if failed:
        raise RuntimeError(f"failed jobs: {failed[:3]}")


def measure(args, device: torch.device) -> dict:
    """Round trips and throughput on the path this process's backend takes."""
    log = KvtierLog()
    logging.getLogger("kvtier").addHandler(log)
    logging.getLogger("kvtier").setLevel(logging.INFO)
    roundtrip_ok = True
    for layout in LAYOUTS:
        for dtype_name in DTYPES:
            for block_size in BLOCK_SIZES:
                ok = check_round_trip(layout, dtype_name, block_size, args, device)
                roundtrip_ok = roundtrip_ok and ok
    print(f"{'block':>12} {'store GB/s':>11} {'load GB/s':>10} {'pinned out':>11} "
          f"{'pinned in':>10} {'store/pinned':>12} {'load/pinned':>11}")  # fmt: skip
    rows = {}
    for block_size in BLOCK_SIZES:
        row = bench(block_size, args, device)
        rows[block_size] = row
        print(f"{block_size:>5} tokens {row[0]:>11.2f} {row[1]:>10.2f} {row[2]:>11.2f} "
              f"{row[3]:>10.2f} {row[4]:>12.2f} {row[5]:>11.2f}")  # fmt: skip
    for line in log.lines:
        print(f"kvtier said: {line}")
    store_ratio, load_ratio = rows[BLOCK_SIZES[0]][4:]
    return {"roundtrip_ok": roundtrip_ok, "store_ratio": store_ratio, "load_ratio": load_ratio}


def measure_per_run(argv: list[str]) -> dict:
    """`measure` in a child process whose backend cannot import vLLM's copy kernels."""
    hide = "; ".join(f"sys.modules[{name!r}] = None" for name in VLLM_KERNEL_MODULES)
    code = f"import runpy, sys; {hide}; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    child = [sys.executable, "-c", code, __file__, *argv, "--per-run-child"]
    # bounded: a hung child must not spend the GPU machine's whole budget
    try:
        done = subprocess.run(child, capture_output=True, text=True, check=False, timeout=300)
    except subprocess.TimeoutExpired:
        print("per-run child did not end in 300 s")
        return {"roundtrip_ok": False, "store_ratio": math.nan, "load_ratio": math.nan}
    for line in done.stdout.splitlines():
        if not line.startswith(CHILD_MARK):
            print(f"  [per-run] {line}")
    if done.returncode != 0:
        print(f"per-run child failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return {"roundtrip_ok": False, "store_ratio": math.nan, "load_ratio": math.nan}
    (last,) = [line for line in done.stdout.splitlines() if line.startswith(CHILD_MARK)]
    return json.loads(last.removeprefix(CHILD_MARK))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB per direction, 3 rounds")
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per direction per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu-dry-run", action="store_true", help="small tensors, CPU backend")
    parser.add_argument("--per-run-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = Model(num_layers=32, num_heads=8, head_dim=128)
    # 16-token blocks of 2 MiB, 256-token blocks of 32 MiB: 128 MiB and 256 MiB per round trip
    args.round_trip_blocks = {16: 64, 256: 8}
    if args.quick:
        args.total_mib = 256
        args.rounds = 3
    if args.cpu_dry_run:
        args.model = Model(num_layers=4, num_heads=2, head_dim=16)
        args.round_trip_blocks = {16: 16, 256: 4}
        args.total_mib = 1
        args.rounds = 1
    return args


def ratio(value: float) -> str:
    return "na" if math.isnan(value) else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU found (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}): nothing measured, no figure claimed")  # fmt: skip
        print("RESULT skipped=no-gpu")
        return 0
    missing = kvtier_missing()
    if missing:
        print(f"gpu_check: kvtier cannot be imported here ({missing}): put kvtier (src/) and its "
              "dependencies, built for this Python, on PYTHONPATH")  # fmt: skip
        print("RESULT skipped=kvtier-not-importable")
        return 1
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    if args.per_run_child:
        print(CHILD_MARK + json.dumps(measure(args, device)))
        return 0
    has_kernels = vllm_kernels_load()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    print(f"gpu_check on {name}, torch {torch.__version__}; vLLM's swap_blocks_batch loads here: "
          f"{'yes' if has_kernels else 'no'}")  # fmt: skip
    print("as-built path" + (" (vLLM's kernels importable)" if has_kernels else " (= per-run)"))
    as_built = measure(args, device)
    nan = {"store_ratio": math.nan, "load_ratio": math.nan}
    batch = as_built if has_kernels else {**as_built, **nan}
    # without vLLM's kernels the as-built path is the per-run one; the dry run checks the child too
    per_run = as_built
    if has_kernels or args.cpu_dry_run:
        print("per-run path (vLLM's kernels hidden from kvtier, in a child process)")
        per_run = measure_per_run(raw)
    roundtrip_ok = int(as_built["roundtrip_ok"] and per_run["roundtrip_ok"])
    if args.cpu_dry_run:
        print(f"RESULT skipped=cpu-dry-run roundtrip_ok={roundtrip_ok}")
        return 0
    print(f"RESULT roundtrip_ok={roundtrip_ok} store_ratio={ratio(batch['store_ratio'])} "
          f"load_ratio={ratio(batch['load_ratio'])} per_run_store_ratio={ratio(per_run['store_ratio'])} "
          f"per_run_load_ratio={ratio(per_run['load_ratio'])}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
