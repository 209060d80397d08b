"""The small types that cross between an engine adapter, the scheduler and the worker.

Engine-facing views (`RequestView`, `ScheduledRequest`, `StepView`) are what an adapter
builds from its engine's objects; `TransferJob` / `StepPlan` go from the scheduler to
the workers; `JobReport` comes back. None of them holds an engine object or a tensor.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.keys import BlockHash

__all__ = [
    "JobKind",
    "JobReport",
    "RequestView",
    "ScheduledRequest",
    "StepPlan",
    "StepView",
    "TransferJob",
    "TransferPart",
    "BlockIds",
]

BlockIds = tuple[list[int], ...]  # one list of engine block ids per KV-cache group


@dataclass(slots=True)
class RequestView:
    """What the scheduler reads of one engine request.

    `block_hashes` may be the engine's own list (vLLM extends it in place as blocks
    fill); the scheduler only reads it.
    """

    req_id: str
    block_hashes: Sequence[BlockHash]
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    kv_transfer_params: Any = None  # untrusted: validated by kvtier.scheduler.params


@dataclass(slots=True)
class ScheduledRequest:
    """One request in an engine step.

    new_block_ids: blocks allocated this step per group (None: none). They replace the
        request's block list when `is_new_or_resumed`, else they are appended.
    num_computed_tokens: tokens whose KV existed before this step.
    num_scheduled_tokens: tokens computed by this step.
    """

    req_id: str
    new_block_ids: BlockIds | None
    is_new_or_resumed: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(slots=True)
class StepView:
    """One engine step: the scheduled requests, and the ids preempted or finished."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)


class JobKind(enum.Enum):
    LOAD = "load"  # tier slots -> engine blocks, before the forward pass
    STORE = "store"  # engine blocks -> tier slots, after the forward pass


@dataclass(frozen=True, slots=True)
class TransferPart:
    """The chunks of one KV-cache group moved by a job.

    Chunk i moves between `slot_ids[i]` and `block_ids[i*bpc:(i+1)*bpc]`. For a load,
    the first `skip_blocks` blocks of the first chunk are already valid in the engine
    (its own prefix cache) and must not be written.
    """

    group: int
    slot_ids: np.ndarray
    block_ids: np.ndarray
    skip_blocks: int = 0

    def chunk_pages(self, chunk: int) -> list[tuple[int, int]]:
        """(page in the slot, engine block) of every block chunk `chunk` moves."""
        bpc = len(self.block_ids) // max(len(self.slot_ids), 1)
        first = self.skip_blocks if chunk == 0 else 0
        return [(page, int(self.block_ids[chunk * bpc + page])) for page in range(first, bpc)]


@dataclass(frozen=True, slots=True)
class TransferJob:
    """One asynchronous transfer, named by `job_id`, for one request."""

    job_id: int
    req_id: str
    kind: JobKind
    parts: tuple[TransferPart, ...]

    @property
    def num_chunks(self) -> int:
        return sum(len(p.slot_ids) for p in self.parts)

    def load_targets(self, chunks: set[int]) -> set[int]:
        """Engine blocks a load writes for these chunk indices (never the skipped ones)."""
        blocks: set[int] = set()
        index = 0
        for part in self.parts:
            for c in range(len(part.slot_ids)):
                if index + c in chunks:
                    blocks.update(block for _, block in part.chunk_pages(c))
            index += len(part.slot_ids)
        return blocks


@dataclass(slots=True)
class StepPlan:
    """What the workers do this step (kvtier's connector metadata).

    At most one load job per request, or any number of store jobs. `flush_job_ids`
    are earlier jobs the worker must finish before this step's forward pass (a
    preempted request's stores, or stores that still read a block that is now
    reallocated to another request).
    """

    load_jobs: list[TransferJob] = field(default_factory=list)
    store_jobs: list[TransferJob] = field(default_factory=list)
    flush_job_ids: set[int] = field(default_factory=set)
    failed_load_block_ids: set[int] = field(default_factory=set)  # report as load errors at once

    def is_empty(self) -> bool:
        return not (self.load_jobs or self.store_jobs or self.flush_job_ids or self.failed_load_block_ids)


@dataclass(frozen=True, slots=True)
class JobReport:
    """One worker's outcome of one job; `failed_chunks` index the job's chunks in part order."""

    job_id: int
    success: bool
    failed_chunks: tuple[int, ...] = ()
    num_bytes: int = 0
    seconds: float = 0.0
