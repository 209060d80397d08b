"""`TransferEngine`: moves chunks between the engine's KV tensors and the host slab.

The worker side of kvtier. It makes no policy decision: it runs `kvtier.jobs.TransferJob`s
(engine blocks -> slab slots, or back) and reports each one exactly once, as a
`kvtier.jobs.JobResult` with per-chunk success. The primitives, in call order:

1. `submit(job)`: start a job (one part per KV-cache group), asynchronously.
2. `get_finished()`: the results since the last call, each job exactly once.
3. `wait(job_ids, timeout)`: block until those jobs finished (e.g. loads before a forward);
   `wait_layer(job_ids, layer, timeout)`: until their copies of one layer did (on CUDA, the
   compute stream waits for them instead of the caller).
4. `cancel(job_ids)`: jobs past their deadline fail whole; it returns once none of them copies.
5. `shutdown()`.

Chunk i of a part is `block_ids[i*bpc:(i+1)*bpc]` <-> `slot_ids[i]` (bpc = blocks_per_chunk).
Nothing here raises on a transfer failure: bad ids, a shape mismatch, an exception in a
copy, a job submitted after shutdown all become failed chunks of a `JobResult`.

Thread-safety: `submit`, `get_finished`, `wait`, `cancel` and `shutdown` are meant to be
called from the engine's worker thread; on CPU the copies run on threads of their own.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from kvtier.errors import ConfigError
from kvtier.jobs import JobResult, TransferJob
from kvtier.slab import HostSlab
from kvtier.worker.cpu_copy import CpuBackend
from kvtier.worker.cuda import CudaBackend, cuda_usable
from kvtier.worker.layered import slice_task
from kvtier.worker.layouts import build_group_layouts, slot_bytes_of
from kvtier.worker.results import ALL_LAYERS, CANCELLED, EndedPart, OpenJob
from kvtier.worker.tasks import CopyTask, TaskOutcome, make_task

__all__ = ["TransferEngine"]

# CUDA completions are polled: events cannot wake a Condition
_CUDA_POLL_S = 0.0005
# A cancelled job's running copy stops within a MiB on CPU (a CUDA copy ends with its stream's
# work): milliseconds. A cancel still waiting after this long logs an error, then waits on.
_CANCEL_WAIT_S = 5.0
# a zero timeout must not spin
_CANCEL_MIN_SLICE_S = 0.001

logger = logging.getLogger(__name__)


class TransferEngine:
    """Asynchronous copies between engine KV tensors and one host slab of slots.

    Args:
        kv_caches: layer name -> KV tensor as the engine registers them (all on one device).
        blocks_per_chunk: engine blocks per chunk (per slot).
        num_slots: slots in the host slab.
        layer_groups: the layers of each KV-cache group; None puts every layer in group 0.
            A slot holds one chunk of one group; `slot_bytes` is the largest group's chunk.
        kv_layout: "auto", "blocks_first" or "kv_first" (see `layouts.kv_planes`).
        num_copy_threads: CPU only: threads sharing each job's bytes (default min(2, cores)).
        slab: the host slab, borrowed (the caller closes it after `shutdown`): a `HostSlab`
            (shared memory, pinned here when the KV caches are on CUDA) or an int8 CPU tensor
            `(num_slots, slot_bytes)`. None: a private one (unit tests, benchmarks).
    Raises:
        ConfigError: bad sizes, a slab of another shape than these KV caches need, or KV
            tensors whose layout cannot be viewed as byte pages.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        blocks_per_chunk: int,
        num_slots: int,
        layer_groups: Sequence[Sequence[str]] | None = None,
        kv_layout: str = "auto",
        num_copy_threads: int | None = None,
        slab: HostSlab | torch.Tensor | None = None,
    ) -> None:
        if blocks_per_chunk < 1 or num_slots < 1:
            raise ConfigError(
                f"blocks_per_chunk and num_slots must be >= 1, got {blocks_per_chunk}, {num_slots}"
            )
        self._layouts = build_group_layouts(kv_caches, blocks_per_chunk, layer_groups, kv_layout)
        # keeps the engine tensors alive while we hold addresses
        self._kv_caches = dict(kv_caches)
        self.blocks_per_chunk = blocks_per_chunk
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes_of(self._layouts)
        device = next(iter(kv_caches.values())).device
        self.device = device
        self._cond = threading.Condition()
        self._open: dict[int, OpenJob] = {}
        self._finished: list[JobResult] = []
        self._closed = False
        self.slab = self._adopt_slab(slab, device)
        self._backend = self._make_backend(device, num_copy_threads)

    def _adopt_slab(
        self, slab: HostSlab | torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        """The caller's slab, checked against these KV caches' slot size; a private one if none."""
        shape = (self.num_slots, self.slot_bytes)
        if slab is None:
            # Zero-filled so its pages are committed now rather than faulted in by the first
            # stores (a first touch copies at a third of the warm rate here).
            return torch.zeros(shape, dtype=torch.int8, pin_memory=cuda_usable(device))
        if isinstance(slab, HostSlab):
            if cuda_usable(device):
                slab.pin_for_cuda()
            slab = slab.tensor
        if (
            slab.dtype != torch.int8
            or slab.device.type != "cpu"
            or tuple(slab.shape) != shape
            or not slab.is_contiguous()
        ):
            raise ConfigError(
                f"the host slab must be a contiguous int8 CPU tensor of {shape[0]} slots x "
                f"{shape[1]} bytes (these KV caches' slot size), got {slab.dtype} "
                f"{tuple(slab.shape)} on {slab.device}"
            )
        if cuda_usable(device) and not slab.is_pinned():
            logger.warning(
                "kvtier: the host slab is not pinned; CUDA copies will be synchronous and slower"
            )
        return slab

    def _make_backend(
        self, device: torch.device, num_copy_threads: int | None
    ) -> CpuBackend | CudaBackend:
        if device.type == "cpu":
            threads = num_copy_threads or min(2, os.cpu_count() or 1)
            return CpuBackend(self._layouts, self.slab, self._on_done, threads)
        if cuda_usable(device):
            return CudaBackend(self._layouts, self.slab, self._on_done, device)
        raise ConfigError(
            f"KV caches on {device} are not supported; kvtier moves KV on cpu or cuda devices"
        )

    @property
    def can_slice(self) -> bool:
        """Whether `submit` copies a job slice by slice of layers: both backends do (CUDA's by
        per-slice events, unverified on a GPU)."""
        return isinstance(self._backend, (CpuBackend, CudaBackend))

    def submit(self, job: TransferJob, slices: Sequence[frozenset[str]] | None = None) -> None:
        """Start `job` asynchronously; its result comes back once, from `get_finished`.

        Bad parts or chunks fail alone (see `kvtier.worker.tasks`); a job id that is still
        in flight, a direction other than engine <-> slab or a closed engine fail the job.
        `slices` (where `can_slice`): copied slice after slice of layers, each seen by `wait_layer`.
        Raises:
            ConfigError: `job.job_id` is not an integer (a caller bug: there is no id to report).
        """
        job_id = _checked_job_id(job)
        if not (job.is_load or job.is_store):
            self._report(job.failed(f"cannot move {job.src.value} -> {job.dst.value}"))
            return
        items = self._tasks_of(job, job_id, slices)
        refusal = self._open_job(job, job_id, items, slices)
        if refusal is not None:
            self._report(job.failed(refusal))
            return
        # moves nothing: done now
        if not job.parts:
            self._report(JobResult(job_id=job_id))
            return
        for item in items:
            if isinstance(item, CopyTask):
                self._start_task(item)
            else:
                self._on_done([item])

    def _tasks_of(
        self, job: TransferJob, job_id: int, slices: Sequence[frozenset[str]] | None
    ) -> list[CopyTask | tuple[EndedPart, TaskOutcome]]:
        """A copy task per part of `job` (per slice of layers, with `slices` where `can_slice`),
        or the outcome of a part that fails before it copies."""
        items: list[CopyTask | tuple[EndedPart, TaskOutcome]] = []
        for index, part in enumerate(job.parts):
            task = make_task(
                job_id,
                index,
                job.is_store,
                part,
                self._layouts,
                self.blocks_per_chunk,
                self.num_slots,
            )
            if isinstance(task, TaskOutcome):
                items.append((EndedPart(job_id, index), task))
            elif slices and self.can_slice:
                items += slice_task(task, slices, self._layouts[task.group], self.blocks_per_chunk)
            else:
                items.append(task)
        return items

    def _open_job(
        self,
        job: TransferJob,
        job_id: int,
        items: list[CopyTask | tuple[EndedPart, TaskOutcome]],
        slices: Sequence[frozenset[str]] | None,
    ) -> str | None:
        """Open `job` to collect its parts' outcomes (a job without parts opens nothing);
        why it cannot be (shut down, its id in flight), or None."""
        with self._cond:
            if self._closed:
                return "engine is shut down"
            if job_id in self._open:
                return f"job id {job_id} is already in flight"
            if not job.parts:
                return None
            opened = OpenJob(
                [offset for offset, _ in job.chunk_offsets()], len(items), job.num_chunks
            )
            if slices:
                opened.copying = Counter(
                    layer
                    for item in items
                    if isinstance(item, CopyTask)
                    for layer in _layers_of(item)
                )
            self._open[job_id] = opened
        return None

    def _start_task(self, task: CopyTask) -> None:
        error = "engine is shut down"
        try:
            accepted = self._backend.submit(task)
        # the CUDA path enqueues in this thread
        except Exception as e:
            accepted = False
            error = f"submit failed: {e!r}"
        if not accepted:
            self._on_done([(task, task.outcome(0, 0.0, error=error))])

    def _report(self, result: JobResult) -> None:
        with self._cond:
            self._finished.append(result)
            self._cond.notify_all()

    def _on_done(self, done: list[tuple[CopyTask | EndedPart, TaskOutcome]]) -> None:
        with self._cond:
            for task, outcome in done:
                job = self._open.get(task.job_id)
                if job is None:
                    # defensive: every task belongs to a job opened by `submit`
                    continue
                job.add(
                    task.part, outcome, _layers_of(task) if isinstance(task, CopyTask) else None
                )
                if job.parts_left == 0:
                    del self._open[task.job_id]
                    self._finished.append(job.result(task.job_id))
            self._cond.notify_all()

    def get_finished(self) -> list[JobResult]:
        """Results of the jobs finished since the last call (each job exactly once); never blocks."""
        self._backend.poll()
        with self._cond:
            results, self._finished = self._finished, []
        return results

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until every job in `job_ids` finished (ids not in flight count as finished).

        Their results stay for `get_finished`.
        Returns:
            True if all finished, False if `timeout` seconds passed first.
        """
        wanted = set(job_ids)
        return self._wait_until(lambda: wanted.isdisjoint(self._open), timeout)

    def wait_layer(self, job_ids: Iterable[int], layer: str, timeout: float | None = None) -> bool:
        """As `wait`, for the tasks of `job_ids` that copy `layer` (a slice holding it, or all
        layers) only: True once none of them copies any more, False if `timeout` passed first.
        On CUDA it does not block: the current (compute) stream waits for those copies, True."""
        wanted = set(job_ids)
        if isinstance(self._backend, CudaBackend):
            # the compute stream waits for those copies' events; the caller does not (unverified)
            self._backend.wait_layer_on_stream(wanted, layer)
            return True

        def is_layer_copied() -> bool:
            # (a job that ended, no longer open, is done with every layer)
            open_jobs = [job for job in map(self._open.get, wanted) if job is not None]
            return not any(_copies_layer(job, layer) for job in open_jobs)

        return self._wait_until(is_layer_copied, timeout)

    def _wait_until(self, is_done: Callable[[], bool], timeout: float | None) -> bool:
        """Block until `is_done()` (called under the lock) or `timeout` seconds passed (False)."""
        deadline = None
        if timeout is not None:
            deadline = time.monotonic() + min(timeout, threading.TIMEOUT_MAX)
        poll_s = _CUDA_POLL_S if isinstance(self._backend, CudaBackend) else None
        while True:
            self._backend.poll()
            with self._cond:
                if is_done():
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if poll_s is not None:
                    left = poll_s if left is None else min(poll_s, left)
                self._cond.wait(left)

    def cancel(self, job_ids: Iterable[int], timeout: float = _CANCEL_WAIT_S) -> bool:
        """Give up on jobs (past their deadline); return only once none of them copies any more.

        Tasks not started never start; running copies are cut short (CPU: within a MiB; a CUDA
        copy cannot be interrupted and ends with its stream's work). Every chunk of a job still
        in flight here is reported failed, once, by `get_finished` — also a part whose copy
        ended meanwhile; jobs that already ended keep their result.

        Why it never returns early (issue #20): next, the forward pass rewrites the blocks and the
        scheduler frees the slots; a copy still running would silently mix another owner's data
        in. Copying always terminates, so taking longer than `timeout` means a failing host:
        logged as an error every `timeout` seconds while it waits on.

        Returns:
            True if they stopped within `timeout`, False if it took longer (logged).
        """
        with self._cond:
            wanted = set(job_ids) & self._open.keys()
            for job_id in wanted:
                self._open[job_id].is_cancelled = True
        if not wanted:
            return True
        never_run = self._backend.cancel(wanted)
        self._on_done([(task, task.outcome(0, 0.0, error=CANCELLED)) for task in never_run])
        slice_s = max(timeout, _CANCEL_MIN_SLICE_S)
        waited = 0.0
        while not self.wait(wanted, slice_s):
            waited += slice_s
            logger.error(
                "kvtier: cancelled transfer(s) %s still copying after %.3g s; waiting for them to stop "
                "(their blocks and slots must not be reused before)",
                sorted(wanted),
                waited,
            )
        return waited == 0.0

    @property
    def num_cut_tasks(self) -> int:
        """Tasks failed because a cancel of another job cut their batch short (since start)."""
        return self._backend.num_cut_tasks

    def shutdown(self) -> None:
        """Stop accepting jobs, let the running ones finish, fail the queued ones (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        never_run = self._backend.shutdown()
        self._on_done(
            [
                (task, task.outcome(0, 0.0, error="engine shut down before the job ran"))
                for task in never_run
            ]
        )

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _checked_job_id(job: TransferJob) -> int:
    """`job.job_id` as an int; raises ConfigError if it is not one (no id to report a failure by)."""
    try:
        return operator.index(job.job_id)
    except TypeError:
        raise ConfigError(f"job_id must be an int, got {type(job.job_id).__name__}") from None


def _copies_layer(job: OpenJob, layer: str) -> bool:
    """Whether a task of `job` still copies `layer`: a slice holding it or a task of all layers
    (any task at all, for a job not copied by slices)."""
    if job.copying is None:
        return job.parts_left != 0
    return job.copying[layer] > 0 or job.copying[ALL_LAYERS] > 0


def _layers_of(task: CopyTask) -> frozenset[str]:
    """The keys a task counts under in `OpenJob.copying`."""
    return task.layers if task.layers is not None else frozenset((ALL_LAYERS,))
