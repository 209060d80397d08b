"""Transfer-job bookkeeping: ids, the chunks and blocks each job moves, acknowledgements,
deadlines, reset generations, and the fences that keep a freed block from being
overwritten while a store still reads it.

Deadlines: a job's deadline is stamped when its plan goes to the workers (`dispatch`:
then + `job_timeout_s`; a job waiting for the next step, e.g. the last store of a request,
does not age while the engine idles). Workers abandon a job at its deadline
(`kvtier.worker.side`). The book expires a job that not every worker reported by
`deadline + job_timeout_s`; the scheduler fails it then, and frees what it held once the
workers have run the step it was expired in (a worker cancels every job past its deadline
before that step's forward pass and waits until its copies stop). A report that still
comes later is ignored.

`NextPlan` is the plan new jobs join between two engine steps (a load planned at allocation, a
finished request's last stores), handed out by the next `build_connector_meta`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvtier.base import PrepareStoreOutput
from kvtier.jobs import Endpoint, JobResult, StepPlan, TransferJob, TransferPart
from kvtier.keys import OffloadKey
from kvtier.scheduler.config import GroupKind
from kvtier.scheduler.state import JobRecord, PendingLoad, RequestOffloadState

__all__ = ["NextPlan", "TransferJobBook"]

# (group, block ids, skip_blocks) per part
_Parts = list[tuple[int, list[int], int]]


@dataclass(slots=True)
class NextPlan:
    """The plan jobs created between two `build_connector_meta` calls join, and the number of
    the step planned last."""

    plan: StepPlan = field(default_factory=StepPlan)
    # `build_connector_meta` calls so far: a request that ends now ends in this step
    step: int = 0

    def take(self) -> StepPlan:
        """A step is planned: hand out the plan built so far, and start the next one."""
        self.step += 1
        plan = self.plan
        self.plan = StepPlan()
        return plan


class TransferJobBook:
    """All in-flight jobs of one scheduler. Not thread-safe."""

    def __init__(self, num_workers: int, job_timeout_s: float):
        self.num_workers = num_workers
        self.job_timeout_s = job_timeout_s
        self.generation = 0
        self._records: dict[int, JobRecord] = {}
        self._next_id = 1
        # engine block -> store jobs reading it
        self._stores_by_block: dict[int, set[int]] = {}
        # keys of in-flight loads
        self.loading_keys: Counter[OffloadKey] = Counter()

    def __getitem__(self, job_id: int) -> JobRecord:
        return self._records[job_id]

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    # -- building jobs ----------------------------------------------------------------

    def load_parts_for(
        self, state: RequestOffloadState, pending: PendingLoad
    ) -> tuple[list[list[OffloadKey]], _Parts]:
        """Keys and blocks of a load, per group (a sliding-window group loads only its window).

        The first chunk's leading blocks are skipped where the engine holds them already (its
        prefix cache) or holds none (a window group's blocks before the window point at the
        engine's null block: a chunk that straddles the window's start is loaded in part)."""
        keys = []
        parts = []
        for gs in state.group_states:
            first = pending.start_chunk
            if gs.spec.kind is GroupKind.SLIDING_WINDOW:
                first = max(first, gs.spec.first_needed_chunk(pending.end_chunk))
            bpc = gs.spec.blocks_per_chunk
            valid_from = max(
                pending.num_local_tokens // gs.spec.tokens_per_block,
                gs.spec.num_skipped_blocks(pending.end_chunk * gs.spec.tokens_per_chunk),
            )
            skip = max(0, valid_from - first * bpc)
            keys.append(state.keys(gs.group, first, pending.end_chunk))
            parts.append((gs.group, gs.block_ids[first * bpc : pending.end_chunk * bpc], skip))
        return keys, parts

    def new_load(
        self,
        state: RequestOffloadState,
        keys: list[list[OffloadKey]],
        parts: _Parts,
        slot_ids: np.ndarray,
    ) -> TransferJob:
        built = []
        offset = 0
        for part_keys, (group, blocks, skip) in zip(keys, parts, strict=True):
            slots = slot_ids[offset : offset + len(part_keys)]
            offset += len(part_keys)
            if len(part_keys):
                built.append(
                    TransferPart(
                        group=group,
                        slot_ids=np.asarray(slots, np.int64),
                        block_ids=np.asarray(blocks, np.int64),
                        skip_blocks=skip,
                    )
                )
        job = self._register(
            state, Endpoint.SLAB, Endpoint.ENGINE, built, [k for part in keys for k in part]
        )
        self.loading_keys.update(self._records[job.job_id].keys)
        return job

    def store_candidates(
        self, state: RequestOffloadState, end: int, window_from: int
    ) -> tuple[list[OffloadKey], list[tuple[int, int]]]:
        """Keys of chunks after each group's cursor up to `end`, with their (group, chunk),
        chunk by chunk across groups (`RequestOffloadState.chunk_major`).

        A sliding-window group skips every chunk with a block that left the window before
        `window_from` (the engine's computed tokens when it scheduled this step): the engine
        freed that block when it scheduled the step, and may have handed it to another request
        whose forward pass writes it before the store reads it.
        """
        firsts = {}
        for gs in state.group_states:
            bpc = gs.spec.blocks_per_chunk
            firsts[gs.group] = max(
                gs.next_store_chunk, -(-gs.spec.num_skipped_blocks(window_from) // bpc)
            )
        return state.chunk_major(firsts, end)

    def new_store(
        self,
        state: RequestOffloadState,
        keys: list[OffloadKey],
        groups: list[int],
        chunk_blocks: list[Sequence[int]],
        out: PrepareStoreOutput,
    ) -> TransferJob:
        """A store of the chunks `out` accepted: `keys[i]` of group `groups[i]` reads `chunk_blocks[i]`
        (a key listed twice is stored once).

        `state` owns the job: the request whose chunks these are, or the scheduler's owner of
        evict-time stores (`kvtier.scheduler.lazy`), which outlive their requests.
        """
        slot_of = dict(zip(out.keys_to_store, out.store_spec.slot_ids.tolist(), strict=True))
        per_group: dict[int, tuple[list[OffloadKey], list[int], list[int]]] = {}
        for key, group, chunk_ids in zip(keys, groups, chunk_blocks, strict=True):
            slot = slot_of.pop(key, None)
            if slot is not None:
                part_keys, slots, blocks = per_group.setdefault(group, ([], [], []))
                part_keys.append(key)
                slots.append(slot)
                blocks.extend(chunk_ids)
        parts = [
            TransferPart(
                group=group,
                slot_ids=np.asarray(slots, np.int64),
                block_ids=np.asarray(blocks, np.int64),
            )
            for group, (_, slots, blocks) in per_group.items()
        ]
        job = self._register(
            state,
            Endpoint.ENGINE,
            Endpoint.SLAB,
            parts,
            [k for ks, _, _ in per_group.values() for k in ks],
        )
        record = self._records[job.job_id]
        record.read_blocks = {b for _, _, blocks in per_group.values() for b in blocks}
        for block in record.read_blocks:
            self._stores_by_block.setdefault(block, set()).add(job.job_id)
        return job

    def _register(
        self,
        state: RequestOffloadState,
        src: Endpoint,
        dst: Endpoint,
        parts: list[TransferPart],
        keys: list[OffloadKey],
    ) -> TransferJob:
        # stamped by `dispatch`
        job = TransferJob(
            job_id=self._next_id,
            req_id=state.req_id,
            src=src,
            dst=dst,
            parts=tuple(parts),
            deadline=math.inf,
        )
        self._next_id += 1
        self._records[job.job_id] = JobRecord(job, keys, self.generation, expires_at=math.inf)
        state.transfer_jobs.add(job.job_id)
        return job

    def cap_deadline(self, job_id: int, latest: float) -> None:
        """An asynchronous load: its deadline is at most `latest` (its request's waiting budget)."""
        record = self._records[job_id]
        record.deadline_cap = latest
        record.is_async = True

    def dispatch(self, plan: StepPlan, now: float) -> None:
        """`plan` goes to the workers now: its jobs' deadlines count from now."""
        for jobs in (plan.load_jobs, plan.async_load_jobs, plan.store_jobs):
            for i, job in enumerate(jobs):
                record = self._records.get(job.job_id)
                deadline = min(
                    now + self.job_timeout_s, record.deadline_cap if record else math.inf
                )
                jobs[i] = replace(job, deadline=deadline)
                if record is not None:
                    record.job = jobs[i]
                    record.expires_at = deadline + self.job_timeout_s

    # -- fences, generations ----------------------------------------------------------

    def stores_reading(self, block_ids: Iterable[int]) -> set[int]:
        """In-flight store jobs that still read any of `block_ids`."""
        by_block = self._stores_by_block
        found: set[int] = set()
        # the blocks fenced among them, found in C: a request's admission writes every block of
        # its prompt (8,192 for 128k tokens)
        for block in by_block.keys() & block_ids:
            found |= by_block[block]
        return found

    def start_new_generation(self) -> set[int]:
        """After a reset: every in-flight job becomes stale; returns their ids (to flush)."""
        self.generation += 1
        return set(self._records)

    # -- completion -------------------------------------------------------------------

    def acknowledge(self, results: Iterable[JobResult]) -> list[JobRecord]:
        """Count results; returns the jobs every worker has now reported (forgotten here).

        A result for an unknown job (a duplicate, or one that expired) is ignored.
        """
        done = []
        for result in results:
            record = self._records.get(result.job_id)
            if record is None:
                continue
            record.num_acks += 1
            record.failed_chunks.update(
                c for c in result.failed_chunks if 0 <= c < len(record.keys)
            )
            if record.num_acks >= self.num_workers:
                done.append(self._forget(record))
        return done

    def expire(self, now: float) -> list[JobRecord]:
        """Jobs not every worker reported by their expiry: forgotten here, every chunk failed."""
        expired = [r for r in self._records.values() if r.expires_at <= now]
        for record in expired:
            record.failed_chunks = set(range(len(record.keys)))
            self._forget(record)
        return expired

    def _forget(self, record: JobRecord) -> JobRecord:
        del self._records[record.job.job_id]
        if record.is_store:
            for block in record.read_blocks:
                jobs = self._stores_by_block.get(block)
                if jobs is not None:
                    jobs.discard(record.job.job_id)
                    if not jobs:
                        del self._stores_by_block[block]
        else:
            for key in record.keys:
                self.loading_keys[key] -= 1
                if self.loading_keys[key] <= 0:
                    del self.loading_keys[key]
        return record

    @staticmethod
    def split_keys(record: JobRecord) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """(succeeded, failed) keys of a completed job."""
        failed = record.failed_chunks
        if not failed:
            return list(record.keys), []
        return (
            [k for i, k in enumerate(record.keys) if i not in failed],
            [k for i, k in enumerate(record.keys) if i in failed],
        )

    @staticmethod
    def failed_load_blocks(record: JobRecord) -> set[int]:
        """Engine blocks a failed load left invalid (never the blocks it had to skip)."""
        return record.job.written_blocks(record.failed_chunks)
