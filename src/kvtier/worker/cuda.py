"""The CUDA path: vLLM's batched copy kernels, pinned host slab, one stream per direction.

UNVERIFIED: written for a GPU and never run on one yet (the development machines have
none); the CPU-only test suite covers the shared planning (`kvtier.worker.pointers`: the same
address arrays the C copier consumes, checked byte-exactly there) and the choice of copy path.
Importing this module needs no GPU: CUDA is touched only when a backend is built.

How a task copies (`CopyPaths`, chosen once when the backend is built, logged at INFO):
- `swap_blocks_batch`: the task's runs as three int64 CPU tensors (`copy_pointers`) in ONE call
  to `vllm._custom_ops.swap_blocks_batch` (`cuMemcpyBatchAsync` on CUDA >= 12.8), as vLLM's own
  offloading worker (`vllm/v1/kv_offload/cpu/gpu_worker.py`) does;
- Triton, for loads only, where vLLM's `_select_swap_blocks_fn` picks it (pinned slab, Triton
  usable, not ROCm, every page under `THRESHOLD_BYTES` and 8-byte aligned) and the task's
  largest run is under that threshold too (kvtier merges consecutive blocks into one run);
- per run `copy_` (one Python call per run): only where the installed vLLM lacks the batched
  op (no vLLM, or `torch.ops._C_cache_ops` without it, i.e. no compiled CUDA extension).

How ordering is kept without a task thread:
- every task first waits for the engine's current (compute) stream: a store reads KV the
  forward pass wrote, a load overwrites blocks the compute stream may still read or zero;
- each direction has its own stream, so tasks of one direction run first-in first-out;
- a task whose slots or blocks conflict with an unfinished task of the other direction
  (see `CopyTask.conflicts_with`) waits for that task's end event; only a load that waits for
  no such task lets the DMA engine read its source out of stream order (as vLLM's loads do).
Completion is seen by polling end events, never by blocking the caller.

Layer by layer (`kvtier.worker.layered`): a synchronous load cut into slices of layers is one
task per slice, enqueued in the forward pass's order on the load stream, each with its own end
event; `wait_layer_on_stream(layer)` makes the compute stream wait for the events of the slices
holding that layer only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.worker.layouts import GroupLayout
from kvtier.worker.pointers import CopyPointers, copy_pointers, plane_pointers
from kvtier.worker.tasks import CopyTask, DoneCallback, plan_copies

__all__ = ["CopyPaths", "CudaBackend", "cuda_usable", "holding_layer", "select_copy_paths"]

logger = logging.getLogger(__name__)

# (src_ptrs, dst_ptrs, sizes, is_src_access_order_any=...): vLLM's swap_blocks_batch signature
BatchCopy = Callable[..., None]


def cuda_usable(device: torch.device) -> bool:
    """True when `device` is a CUDA device this process can drive."""
    return device.type == "cuda" and torch.cuda.is_available()


@dataclass(frozen=True, slots=True)
class CopyPaths:
    """How each direction's tasks copy; a None function means per-run `copy_`.

    small_load / small_max_bytes: vLLM's Triton copy, for loads whose largest run is under
        `small_max_bytes` (None: never).
    """

    store: BatchCopy | None
    load: BatchCopy | None
    small_load: BatchCopy | None = None
    small_max_bytes: int = 0

    @property
    def description(self) -> str:
        """One line for the start-up log."""
        if self.store is None:
            return "per-run copy_ (this vLLM has no compiled swap_blocks_batch)"
        small = ""
        if self.small_load is not None:
            small = f", loads with runs under {self.small_max_bytes} bytes via vLLM's Triton kernel"
        return f"vLLM swap_blocks_batch, one call per task{small}"

    def for_load(self, max_run_bytes: int) -> BatchCopy | None:
        """The function a load whose largest run has `max_run_bytes` copies with."""
        if self.small_load is not None and max_run_bytes < self.small_max_bytes:
            return self.small_load
        return self.load


def _batch_op() -> BatchCopy | None:
    """`vllm._custom_ops.swap_blocks_batch` when vLLM has it AND its compiled op is registered
    (vLLM's Python wrapper imports without its CUDA extension, then fails at the first call)."""
    try:
        ops = importlib.import_module("vllm._custom_ops")
    # no vLLM, or one that cannot import here: per-run copies (logged by the caller)
    except Exception:
        return None
    batch = getattr(ops, "swap_blocks_batch", None)
    if batch is None or not hasattr(torch.ops._C_cache_ops, "swap_blocks_batch"):
        return None
    return batch


def _triton_op(page_sizes: Sequence[int], is_aligned: bool) -> tuple[BatchCopy, int] | None:
    """vLLM's Triton copy and its size threshold, where vLLM's rule for host -> GPU picks it
    (`_select_swap_blocks_fn` in vLLM's gpu_worker.py; the caller checked the slab is pinned)."""
    if torch.version.hip is not None or not page_sizes or not is_aligned:
        return None
    try:
        utils = importlib.import_module("vllm.triton_utils")
        kernel = importlib.import_module("vllm.v1.kv_offload.cpu.swap_blocks_triton")
    except Exception:
        return None
    threshold = kernel.THRESHOLD_BYTES
    if not utils.HAS_TRITON or max(page_sizes) >= threshold or any(s % 8 for s in page_sizes):
        return None
    chunk = min(utils.triton.next_power_of_2(max(page_sizes)), 8192)
    return functools.partial(kernel.swap_blocks_batch, bytes_per_chunk=chunk), threshold


def select_copy_paths(layouts: Sequence[GroupLayout], host_is_pinned: bool) -> CopyPaths:
    """Which of vLLM's kernels copy stores and loads, by import and attribute checks only.

    Args:
        layouts: the engine's group layouts (their page sizes and offsets decide Triton).
        host_is_pinned: whether the slab is page-locked (Triton reads host memory directly).
    """
    batch = _batch_op()
    if batch is None:
        return CopyPaths(None, None)
    if not host_is_pinned:
        return CopyPaths(batch, batch)
    page_sizes = [int(plane.nbytes) for layout in layouts for plane in layout.planes]
    # Triton moves 8-byte words: every address must be a multiple of 8. Slab addresses are sums of
    # page-size multiples (checked by the rule); engine rows start at offset + block * stride.
    starts = [(plane.offset, plane.block_stride) for layout in layouts for plane in layout.planes]
    is_aligned = all(offset % 8 == 0 and stride % 8 == 0 for offset, stride in starts)
    triton = _triton_op(page_sizes, is_aligned)
    if triton is None:
        return CopyPaths(batch, batch)
    return CopyPaths(batch, batch, triton[0], triton[1])


@dataclass(slots=True)
class _InFlight:
    task: CopyTask
    start: torch.cuda.Event
    end: torch.cuda.Event
    num_bytes: int
    # the pointer tensors, alive until the copy ended (a Triton copy reads them asynchronously)
    pointers: tuple[torch.Tensor, ...] = ()


def holding_layer(
    flights: Sequence[_InFlight], job_ids: Container[int], layer: str
) -> list[_InFlight]:
    """The tasks in flight of `job_ids` that copy `layer`: a slice holding it, or all layers."""
    return [
        flight
        for flight in flights
        if flight.task.job_id in job_ids
        and (flight.task.layers is None or layer in flight.task.layers)
    ]


class CudaBackend:
    """Enqueues each task's copies on a dedicated stream at submit time (unverified on GPU).

    Thread-safety: call `submit`, `poll` and `shutdown` from one thread (the engine's worker
    thread, whose current stream is the compute stream).
    """

    def __init__(
        self,
        layouts: Sequence[GroupLayout],
        slab: torch.Tensor,
        on_done: DoneCallback,
        device: torch.device,
    ) -> None:
        self._layouts = layouts
        self._slab_bytes = slab.view(-1)
        self._slab_ptr = slab.data_ptr()
        self._slot_bytes = slab.shape[1]
        self._plane_ptrs = plane_pointers(layouts)
        self._on_done = on_done
        self._device = device
        self._store_stream = torch.cuda.Stream(device=device)
        self._load_stream = torch.cuda.Stream(device=device)
        self._in_flight: list[_InFlight] = []
        self._closed = False
        # a CUDA copy is never cut short (see `cancel`)
        self.num_cut_tasks = 0
        self.is_pinned = slab.is_pinned()
        self.paths = select_copy_paths(layouts, self.is_pinned)
        logger.info(
            "kvtier: CUDA copies on %s: %s; host slab pinned=%d",
            device,
            self.paths.description,
            int(self.is_pinned),
        )

    def submit(self, task: CopyTask) -> bool:
        """Enqueue `task`'s copies; False once shut down. Raises on a CUDA error (the task fails)."""
        if self._closed:
            return False
        stream = self._store_stream if task.is_store else self._load_stream
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        # taken before entering the copy stream's context, inside which it is the copy stream
        compute = torch.cuda.current_stream(self._device)
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            # see the module docstring
            stream.wait_stream(compute)
            waited = False
            for other in self._in_flight:
                if other.task.conflicts_with(task):
                    stream.wait_event(other.end)
                    waited = True
            start.record(stream)
            if self.paths.store is None:
                num_bytes = self._copy_per_run(task)
                kept: tuple[torch.Tensor, ...] = ()
            else:
                pointers = copy_pointers(
                    [task], self._layouts, self._plane_ptrs, self._slab_ptr, self._slot_bytes
                )
                num_bytes = int(pointers.nbytes.sum())
                kept = self._copy_batch(task, pointers, is_src_order_any=not waited)
            end.record(stream)
        self._in_flight.append(_InFlight(task, start, end, num_bytes, kept))
        return True

    def _copy_batch(
        self, task: CopyTask, pointers: CopyPointers, is_src_order_any: bool
    ) -> tuple[torch.Tensor, ...]:
        """All of the task's runs in one call on the current stream; returns the pointer tensors.

        A store's source is the engine's KV, which the compute stream writes: stream order only.
        """
        if len(pointers.nbytes) == 0:
            return ()
        src = torch.from_numpy(np.ascontiguousarray(pointers.src, dtype=np.int64))
        dst = torch.from_numpy(np.ascontiguousarray(pointers.dst, dtype=np.int64))
        sizes = torch.from_numpy(np.ascontiguousarray(pointers.nbytes, dtype=np.int64))
        if task.is_store:
            # not None: checked by the caller
            copy = self.paths.store
            is_src_order_any = False
        else:
            copy = self.paths.for_load(int(pointers.nbytes.max()))
        if copy is self.paths.small_load:
            # vLLM's Triton copy moves them to the GPU asynchronously: from pinned memory, as vLLM's
            # own descriptor buffers (from pageable memory the driver may wait for the stream)
            src = src.pin_memory()
            dst = dst.pin_memory()
            sizes = sizes.pin_memory()
        copy(src, dst, sizes, is_src_access_order_any=is_src_order_any)  # type: ignore[misc]
        return (src, dst, sizes)

    def _copy_per_run(self, task: CopyTask) -> int:
        """The fallback: one `copy_` per run (no batched op in this vLLM); returns the bytes."""
        layout = self._layouts[task.group]
        runs = plan_copies(
            task.block_ids,
            task.slot_ids,
            layout,
            self._slot_bytes,
            task.first_pages(),
            task.planes,
        )
        planes = layout.planes
        columns = [runs.plane, runs.engine_offset, runs.slab_offset, runs.nbytes]
        for p, engine_at, slab_at, n in zip(*(c.tolist() for c in columns), strict=True):
            engine = planes[p].storage[engine_at : engine_at + n]
            slab = self._slab_bytes[slab_at : slab_at + n]
            dst, src = (slab, engine) if task.is_store else (engine, slab)
            dst.copy_(src, non_blocking=True)
        return int(runs.nbytes.sum())

    def wait_layer_on_stream(self, job_ids: Container[int], layer: str) -> None:
        """Make the current (compute) stream wait for the copies of `layer` of `job_ids` only
        (their end events), without blocking the caller: a load sliced by layers
        (`kvtier.worker.layered`) then lets the forward pass run layer `L`'s attention as soon as
        the slice holding `L` is in, while the later slices still copy on the load stream.
        Unverified on a GPU."""
        stream = torch.cuda.current_stream(self._device)
        for flight in holding_layer(self._in_flight, job_ids, layer):
            stream.wait_event(flight.end)

    def poll(self) -> None:
        """Report every task whose end event has completed."""
        still = []
        done = []
        for flight in self._in_flight:
            try:
                if not flight.end.query():
                    still.append(flight)
                    continue
                # elapsed_time is in ms
                seconds = flight.start.elapsed_time(flight.end) / 1000.0
                done.append((flight.task, flight.task.outcome(flight.num_bytes, seconds)))
            # a sticky CUDA error: the task failed, the engine goes on
            except Exception as e:
                done.append(
                    (flight.task, flight.task.outcome(0, 0.0, error=f"CUDA copy failed: {e!r}"))
                )
        self._in_flight = still
        if done:
            self._on_done(done)

    def cancel(self, job_ids: Container[int]) -> list[CopyTask]:
        """Nothing waits in a queue here (tasks go to their stream at submit): returns [].

        A copy enqueued on a stream cannot be interrupted, nor taken back once enqueued:
        `TransferEngine.cancel` waits (polling end events) until the stream has run it, i.e.
        until everything enqueued on that stream before it ran too, and fails its chunks.
        Only then may the forward pass rewrite its blocks or the scheduler free its slots.
        Unverified on a GPU, like the rest of this module.
        """
        return []

    def shutdown(self) -> list[CopyTask]:
        """Wait for in-flight tasks (reporting them) and refuse new ones; nothing is left unstarted."""
        self._closed = True
        for flight in self._in_flight:
            # poll() below reports it as a failed task
            with contextlib.suppress(Exception):
                flight.end.synchronize()
        self.poll()
        # only after a CUDA error that query() did not raise
        if self._in_flight:
            error = "did not complete before shutdown"
            self._on_done(
                [
                    (flight.task, flight.task.outcome(0, 0.0, error=error))
                    for flight in self._in_flight
                ]
            )
        self._in_flight = []
        return []
