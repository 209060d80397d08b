"""Transfer-job bookkeeping: ids, the chunks and blocks each job moves, acknowledgements,
reset generations, and the fences that keep a freed block from being overwritten while
a store still reads it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvtier.base import PrepareStoreOutput
from kvtier.keys import OffloadKey
from kvtier.scheduler.config import GroupKind
from kvtier.scheduler.state import JobRecord, PendingLoad, RequestOffloadState
from kvtier.scheduler.types import JobKind, JobReport, TransferJob, TransferPart

__all__ = ["JobBook"]

_Parts = list[tuple[int, list[int], int]]  # (group, block ids, skip_blocks) per part


class JobBook:
    """All in-flight jobs of one scheduler. Not thread-safe."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.generation = 0
        self._records: dict[int, JobRecord] = {}
        self._next_id = 1
        self._stores_by_block: dict[int, set[int]] = {}  # engine block -> store jobs reading it

    def __getitem__(self, job_id: int) -> JobRecord:
        return self._records[job_id]

    def __len__(self) -> int:
        return len(self._records)

    # -- building jobs ----------------------------------------------------------------

    def load_parts_for(self, state: RequestOffloadState, pending: PendingLoad) -> tuple[list[list[OffloadKey]], _Parts]:
        """Keys and blocks of a load, per group (a sliding-window group loads only its window)."""
        keys, parts = [], []
        for gs in state.group_states:
            first = pending.start_chunk
            if gs.spec.kind is GroupKind.SLIDING_WINDOW:
                first = max(first, gs.spec.first_needed_chunk(pending.end_chunk))
            bpc = gs.spec.blocks_per_chunk
            skip = max(0, pending.num_local_tokens // gs.spec.tokens_per_block - first * bpc)
            keys.append(state.keys(gs.group, first, pending.end_chunk))
            parts.append((gs.group, gs.block_ids[first * bpc : pending.end_chunk * bpc], skip))
        return keys, parts

    def new_load(self, state: RequestOffloadState, keys: list[list[OffloadKey]], parts: _Parts,
                 slot_ids: np.ndarray) -> TransferJob:
        built, offset = [], 0
        for part_keys, (group, blocks, skip) in zip(keys, parts, strict=True):
            slots = slot_ids[offset : offset + len(part_keys)]
            offset += len(part_keys)
            if len(part_keys):
                built.append(TransferPart(group, np.asarray(slots, np.int64), np.asarray(blocks, np.int64), skip))
        return self._register(state, JobKind.LOAD, built, [k for part in keys for k in part])

    def store_candidates(self, state: RequestOffloadState, end: int, window_from: int
                         ) -> tuple[list[OffloadKey], list[tuple[int, int]]]:
        """Keys of chunks after each group's cursor up to `end`, with their (group, chunk).

        A sliding-window group skips chunks that left the window before `window_from`:
        the engine may already have freed their blocks.
        """
        keys, chunks = [], []
        for gs in state.group_states:
            first = gs.next_store_chunk
            if gs.spec.kind is GroupKind.SLIDING_WINDOW:
                first = max(first, gs.spec.first_needed_chunk(window_from // gs.spec.tokens_per_chunk))
            if first < end:
                keys.extend(state.keys(gs.group, first, end))
                chunks.extend((gs.group, c) for c in range(first, end))
        return keys, chunks

    def new_store(self, state: RequestOffloadState, keys: list[OffloadKey], chunks: list[tuple[int, int]],
                  out: PrepareStoreOutput) -> TransferJob:
        slot_of = dict(zip(out.keys_to_store, out.store_spec.slot_ids.tolist(), strict=True))
        per_group: dict[int, tuple[list[OffloadKey], list[int], list[int]]] = {}
        for key, (group, chunk) in zip(keys, chunks, strict=True):
            if key in slot_of:
                part_keys, slots, blocks = per_group.setdefault(group, ([], [], []))
                part_keys.append(key)
                slots.append(slot_of[key])
                blocks.extend(state.group_states[group].chunk_blocks(chunk))
        parts = [
            TransferPart(group, np.asarray(slots, np.int64), np.asarray(blocks, np.int64))
            for group, (_, slots, blocks) in per_group.items()
        ]
        job = self._register(state, JobKind.STORE, parts, [k for ks, _, _ in per_group.values() for k in ks])
        for part in parts:
            for block in part.block_ids.tolist():
                self._stores_by_block.setdefault(block, set()).add(job.job_id)
        return job

    def _register(self, state: RequestOffloadState, kind: JobKind, parts: list[TransferPart],
                  keys: list[OffloadKey]) -> TransferJob:
        job = TransferJob(self._next_id, state.req_id, kind, tuple(parts))
        self._next_id += 1
        self._records[job.job_id] = JobRecord(job, keys, self.generation)
        state.transfer_jobs.add(job.job_id)
        return job

    # -- fences, generations ----------------------------------------------------------

    def stores_reading(self, block_ids: Iterable[int]) -> set[int]:
        """In-flight store jobs that still read any of `block_ids`."""
        found: set[int] = set()
        for block in block_ids:
            found |= self._stores_by_block.get(block, set())
        return found

    def start_new_generation(self) -> set[int]:
        """After a reset: every in-flight job becomes stale; returns their ids (to flush)."""
        self.generation += 1
        return set(self._records)

    # -- completion -------------------------------------------------------------------

    def acknowledge(self, reports: Iterable[JobReport]) -> list[JobRecord]:
        """Count reports; returns the jobs every worker has now acknowledged (forgotten here)."""
        done = []
        for report in reports:
            record = self._records.get(report.job_id)
            if record is None:
                continue  # unknown or already complete: a duplicate report
            record.num_acks += 1
            if not report.success:
                record.failed_chunks |= set(report.failed_chunks) or set(range(len(record.keys)))
            if record.num_acks >= self.num_workers:
                done.append(self._forget(record))
        return done

    def _forget(self, record: JobRecord) -> JobRecord:
        del self._records[record.job.job_id]
        if not record.is_load:
            for part in record.job.parts:
                for block in part.block_ids.tolist():
                    jobs = self._stores_by_block.get(block)
                    if jobs is not None:
                        jobs.discard(record.job.job_id)
                        if not jobs:
                            del self._stores_by_block[block]
        return record

    @staticmethod
    def split_keys(record: JobRecord) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """(succeeded, failed) keys of a completed job."""
        failed = record.failed_chunks
        return ([k for i, k in enumerate(record.keys) if i not in failed],
                [k for i, k in enumerate(record.keys) if i in failed])

    @staticmethod
    def failed_load_blocks(record: JobRecord) -> set[int]:
        """Engine blocks a failed load left invalid (never the blocks it had to skip)."""
        return record.job.load_targets(record.failed_chunks)
