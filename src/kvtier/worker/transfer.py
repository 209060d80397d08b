"""`TransferEngine`: moves chunks between the engine's KV tensors and the host slab.

The worker side of kvtier. It makes no policy decision: the scheduler side says which
blocks go to (or come from) which slots, names each job with an integer id, and later
reads back exactly what succeeded. The primitives, in call order:

1. `submit_store(job_id, block_ids, slot_ids, group)`: copy chunks engine -> slab.
2. `submit_load(job_id, slot_ids, block_ids, group)`: copy chunks slab -> engine.
3. `get_finished()`: the results since the last call, each job exactly once.
4. `wait(job_ids, timeout)`: block until those jobs finished (e.g. loads before a forward).
5. `shutdown()`.

Chunk i of a job is `block_ids[i*bpc:(i+1)*bpc]` <-> `slot_ids[i]` (bpc = blocks_per_chunk).
Nothing here raises on a transfer failure: bad ids, a shape mismatch, an exception in a
copy, a job submitted after shutdown all become failed `TransferResult`s.

Thread-safety: the submit methods, `get_finished`, `wait` and `shutdown` are meant to be
called from the engine's worker thread; on CPU the copies run on the engine's own threads.
"""

from __future__ import annotations

import operator
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.worker.cpu_copy import CpuBackend
from kvtier.worker.cuda import CudaBackend, cuda_usable
from kvtier.worker.jobs import TransferJob, TransferResult, failed_result, make_job
from kvtier.worker.layouts import build_group_layouts, slot_bytes_of

__all__ = ["TransferEngine"]

_CUDA_POLL_S = 0.0005  # CUDA completions are polled: events cannot wake a Condition


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
    Raises:
        ConfigError: bad sizes, or KV tensors whose layout cannot be viewed as byte pages.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        blocks_per_chunk: int,
        num_slots: int,
        layer_groups: Sequence[Sequence[str]] | None = None,
        kv_layout: str = "auto",
        num_copy_threads: int | None = None,
    ) -> None:
        if blocks_per_chunk < 1 or num_slots < 1:
            raise ConfigError(f"blocks_per_chunk and num_slots must be >= 1, got {blocks_per_chunk}, {num_slots}")
        self._layouts = build_group_layouts(kv_caches, blocks_per_chunk, layer_groups, kv_layout)
        self._kv_caches = dict(kv_caches)  # keeps the engine tensors alive while we hold addresses
        self.blocks_per_chunk = blocks_per_chunk
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes_of(self._layouts)
        device = next(iter(kv_caches.values())).device
        self.device = device
        self._cond = threading.Condition()
        self._in_flight: set[int] = set()
        self._finished: list[TransferResult] = []
        self._closed = False
        self.slab = self._allocate_slab(device)
        self._backend = self._make_backend(device, num_copy_threads)

    def _allocate_slab(self, device: torch.device) -> torch.Tensor:
        # Allocated once, zero-filled so its pages are committed now rather than faulted in
        # by the first stores (a first touch copies at a third of the warm rate here).
        return torch.zeros((self.num_slots, self.slot_bytes), dtype=torch.int8, pin_memory=cuda_usable(device))

    def _make_backend(self, device: torch.device, num_copy_threads: int | None) -> CpuBackend | CudaBackend:
        if device.type == "cpu":
            threads = num_copy_threads or min(2, os.cpu_count() or 1)
            return CpuBackend(self._layouts, self.slab, self._on_done, threads)
        if cuda_usable(device):
            return CudaBackend(self._layouts, self.slab, self._on_done, device)
        raise ConfigError(f"KV caches on {device} are not supported; kvtier moves KV on cpu or cuda devices")

    def submit_store(
        self, job_id: int, block_ids: Sequence[int] | np.ndarray, slot_ids: Sequence[int] | np.ndarray, group: int = 0
    ) -> None:
        """Copy chunks from engine blocks into slots, asynchronously.

        Args:
            job_id: a unique id; a duplicate of a job still in flight fails the new job.
            block_ids: `len(slot_ids) * blocks_per_chunk` engine block ids, chunk by chunk.
            slot_ids: one destination slot per chunk.
            group: the KV-cache group the blocks belong to.
        Raises:
            ConfigError: `job_id` is not an integer (a caller bug: there is no id to report).
        """
        self._submit(job_id, True, block_ids, slot_ids, group)

    def submit_load(
        self,
        job_id: int,
        slot_ids: Sequence[int] | np.ndarray,
        block_ids: Sequence[int] | np.ndarray,
        group: int = 0,
        skip_blocks: int = 0,
    ) -> None:
        """Copy chunks from slots into engine blocks, asynchronously; same arguments as
        `submit_store`, plus `skip_blocks`: leading blocks of the first chunk not to write
        (the engine's own prefix cache already holds them)."""
        self._submit(job_id, False, block_ids, slot_ids, group, skip_blocks)

    def _submit(self, job_id: int, is_store: bool, block_ids, slot_ids, group: int, skip_blocks: int = 0) -> None:
        try:
            job_id = operator.index(job_id)
        except TypeError:
            raise ConfigError(f"job_id must be an int, got {type(job_id).__name__}") from None
        job = make_job(
            job_id, is_store, block_ids, slot_ids, group, self._layouts, self.blocks_per_chunk, self.num_slots,
            skip_blocks,
        )
        if isinstance(job, TransferResult):
            return self._report(job)
        with self._cond:
            refusal = "engine is shut down" if self._closed else None
            if job_id in self._in_flight:
                refusal = f"job id {job_id} is already in flight"
            if refusal is None:
                self._in_flight.add(job_id)
        if refusal is not None:
            return self._report(failed_result(job_id, is_store, job.num_chunks, refusal))
        try:
            accepted = self._backend.submit(job)
        except Exception as e:  # the CUDA path enqueues in this thread
            accepted, refusal = False, f"submit failed: {e!r}"
        if not accepted:
            self._on_done([(job, job.result(0, 0.0, error=refusal or "engine is shut down"))])
        return None

    def _report(self, result: TransferResult) -> None:
        with self._cond:
            self._finished.append(result)
            self._cond.notify_all()

    def _on_done(self, done: list[tuple[TransferJob, TransferResult]]) -> None:
        with self._cond:
            for job, result in done:
                self._in_flight.discard(job.job_id)
                self._finished.append(result)
            self._cond.notify_all()

    def get_finished(self) -> list[TransferResult]:
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
        deadline = None if timeout is None else time.monotonic() + timeout
        poll_s = _CUDA_POLL_S if isinstance(self._backend, CudaBackend) else None
        while True:
            self._backend.poll()
            with self._cond:
                if self._in_flight.isdisjoint(wanted):
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if poll_s is not None:
                    left = poll_s if left is None else min(poll_s, left)
                self._cond.wait(left)

    def shutdown(self) -> None:
        """Stop accepting jobs, let the running ones finish, fail the queued ones (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        never_run = self._backend.shutdown()
        self._on_done([(job, job.result(0, 0.0, error="engine shut down before the job ran")) for job in never_run])

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
