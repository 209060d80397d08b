"""Engine <-> slab jobs: what the scheduler asks the workers to copy, and `StepPlan`, the jobs of
one engine step.

kvtier has two kinds of job, as vLLM's offloading has: an engine <-> slab job (`TransferJob`,
here) is planned by the scheduler and run by the workers (`kvtier.worker`), between the
engine's KV blocks and the host slab's slots; a slab <-> tier job (`kvtier.tiers.secondary.
TierJob`) is submitted by the tiered manager and run by a secondary tier on its own threads,
between slab rows and the tier's storage. Both carry a deadline, both spell their direction
`is_store` (else a load), and each is reported exactly once, with per-chunk (per-key) success.

A `TransferJob` has an integer id, a source and a destination (`Endpoint`), one
`TransferPart` per KV-cache group, and a deadline. Whoever runs it reports it exactly
once, as one `JobResult` with per-chunk success. Nothing here does I/O.

Chunks are numbered across the job's parts in part order: chunk `i` of the job is chunk
`i - offset` of the part that holds it. Failures are reported by those job-wide indices.

Deadlines are `time.monotonic()` seconds. The scheduler and every worker of one engine
share a host (the host slab is shared memory), so they share that clock.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kvtier.errors import ConfigError

__all__ = [
    "BlockIds",
    "Endpoint",
    "JobResult",
    "StepPlan",
    "TransferJob",
    "TransferPart",
    "check_slab_slots",
]

# one list of engine block ids per KV-cache group
BlockIds = tuple[list[int], ...]


class Endpoint(enum.Enum):
    """Where a job's bytes come from or go to."""

    # the engine's KV-cache blocks, named by block id
    ENGINE = "engine"
    # the host slab's slots (the CPU tier), named by slot id
    SLAB = "slab"


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferPart:
    """The chunks of one KV-cache group that a job moves.

    Chunk i moves between `slot_ids[i]` and `block_ids[i*bpc:(i+1)*bpc]` (bpc = blocks
    per chunk). When the engine is the destination, the first `skip_blocks` blocks of the
    first chunk are already valid there (its own prefix cache, shared and read-only) and
    are never written.
    """

    group: int
    # int64 (num_chunks,)
    slot_ids: np.ndarray
    # int64 (num_chunks * blocks_per_chunk,)
    block_ids: np.ndarray
    skip_blocks: int = 0

    @property
    def num_chunks(self) -> int:
        return len(self.slot_ids)

    def __reduce__(self):
        """Pickled as raw int64 bytes: every step's plan crosses to the workers' processes, and
        numpy's own pickling of two small arrays costs several times more."""
        return (
            _part_from_bytes,
            (
                self.group,
                np.ascontiguousarray(self.slot_ids, np.int64).tobytes(),
                np.ascontiguousarray(self.block_ids, np.int64).tobytes(),
                self.skip_blocks,
            ),
        )

    def chunk_pages(self, chunk: int) -> list[tuple[int, int]]:
        """(page in the slot, engine block) of every block chunk `chunk` moves."""
        bpc = len(self.block_ids) // max(self.num_chunks, 1)
        first = self.skip_blocks if chunk == 0 else 0
        return [(page, int(self.block_ids[chunk * bpc + page])) for page in range(first, bpc)]


def _part_from_bytes(
    group: int, slot_ids: bytes, block_ids: bytes, skip_blocks: int
) -> TransferPart:
    return TransferPart(
        group=group,
        slot_ids=np.frombuffer(slot_ids, np.int64).copy(),
        block_ids=np.frombuffer(block_ids, np.int64).copy(),
        skip_blocks=skip_blocks,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferJob:
    """One engine <-> slab transfer for one request, run by the workers.

    Args:
        job_id: unique per scheduler; the name under which the job is reported.
        req_id: the request it serves.
        src, dst: where the bytes come from and go to.
        parts: one per KV-cache group that moves chunks.
        deadline: `time.monotonic()` after which the job is abandoned and failed.

    Its direction is `is_store` (engine -> slab), as for every job; `is_load` is not simply its
    negation because a job's endpoints may name neither direction (engine -> engine), which
    the workers refuse.
    """

    job_id: int
    req_id: str
    src: Endpoint
    dst: Endpoint
    parts: tuple[TransferPart, ...]
    deadline: float

    @property
    def is_load(self) -> bool:
        """Slab slots -> engine blocks: must finish before the forward pass reads them."""
        return self.src is Endpoint.SLAB and self.dst is Endpoint.ENGINE

    @property
    def is_store(self) -> bool:
        """Engine blocks -> slab slots."""
        return self.src is Endpoint.ENGINE and self.dst is Endpoint.SLAB

    @property
    def num_chunks(self) -> int:
        return sum(part.num_chunks for part in self.parts)

    def chunk_offsets(self) -> Iterator[tuple[int, TransferPart]]:
        """(job-wide index of the part's first chunk, part), in part order."""
        offset = 0
        for part in self.parts:
            yield offset, part
            offset += part.num_chunks

    def written_blocks(self, chunks: set[int]) -> set[int]:
        """Engine blocks a load writes for these job-wide chunk indices (never the skipped ones)."""
        blocks: set[int] = set()
        for offset, part in self.chunk_offsets():
            for c in range(part.num_chunks):
                if offset + c in chunks:
                    blocks.update(block for _, block in part.chunk_pages(c))
        return blocks

    def failed(self, error: str) -> JobResult:
        """The result of this job when none of its chunks moved."""
        return JobResult(
            job_id=self.job_id, failed_chunks=tuple(range(self.num_chunks)), error=error
        )

    def read_blocks(self) -> set[int]:
        """Engine blocks a store reads."""
        if not self.is_store:
            return set()
        return {int(b) for part in self.parts for b in part.block_ids.tolist()}


@dataclass(frozen=True, slots=True, kw_only=True)
class JobResult:
    """One runner's outcome of one job, reported once.

    failed_chunks: job-wide indices of the chunks that did not move (all of them when the
        whole job failed); empty on success.
    num_bytes: bytes actually moved; seconds: time spent copying (not queueing).
    error: why chunks failed, for logs.
    """

    job_id: int
    failed_chunks: tuple[int, ...] = ()
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    @property
    def success(self) -> bool:
        return not self.failed_chunks


@dataclass(slots=True)
class StepPlan:
    """What the workers do in one engine step (kvtier's connector metadata).

    Before the forward pass: the jobs in `flush_job_ids` end (earlier stores that still read
    blocks the step hands to a new owner, or stores of a preempted request; a store of this
    very plan that is flushed is started then, not after the forward), then `load_jobs` run
    and end. After the forward pass the other `store_jobs` start (they read KV this step
    wrote). At most one load job per request, or any number of store jobs.
    `async_load_jobs` start with the step and nobody waits for them: their requests are
    parked by the engine (vLLM's WAITING_FOR_REMOTE_KVS) until the workers report them.
    `failed_load_block_ids`: blocks the workers report as load errors at once (recomputed).
    `engine_idle`: no request computes in this step (every one is parked or waiting): the
    workers wait a little for the step's asynchronous loads, so that their requests are
    reported in this step instead of after more empty round trips of the engine.
    """

    load_jobs: list[TransferJob] = field(default_factory=list)
    async_load_jobs: list[TransferJob] = field(default_factory=list)
    store_jobs: list[TransferJob] = field(default_factory=list)
    flush_job_ids: set[int] = field(default_factory=set)
    failed_load_block_ids: set[int] = field(default_factory=set)
    engine_idle: bool = False

    def stores_to_flush(self) -> list[TransferJob]:
        """This plan's own store jobs that must end before its forward pass."""
        return [job for job in self.store_jobs if job.job_id in self.flush_job_ids]


def check_slab_slots(scheduler_slots: int, worker_slots: Iterable[int]) -> None:
    """Workers report their host slab's slot count once; every one must be the scheduler's.

    Raises:
        ConfigError: a mismatch — slot ids in jobs would not fit, or land in another chunk.
    """
    wrong = sorted({n for n in worker_slots if n != scheduler_slots})
    if wrong:
        raise ConfigError(
            f"kvtier: a worker's host slab has {wrong[0]} slots where the scheduler counts {scheduler_slots}: the "
            "slot ids in its jobs would not fit. Every worker must see the same KV-cache layout (pipeline-parallel "
            "stages with different layers are not supported)"
        )
