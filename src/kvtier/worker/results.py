"""How the parts of one submitted `TransferJob` fold into its one `JobResult`.

A job's parts (one per KV-cache group) end separately, as copy tasks (one per part, or one per
slice of its layers: `kvtier.worker.layered`) or as parts that failed validation and never
became one (`EndedPart`); `OpenJob` adds up their outcomes in job-wide chunk indices, counts
the tasks still copying each layer (`copying`), and makes the result once the last has ended.
A cancelled job (past its deadline) fails whole, also a part that ended in time.

Thread-safety: none; `kvtier.worker.transfer.TransferEngine` calls it under its lock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvtier.jobs import JobResult
from kvtier.worker.tasks import TaskOutcome

__all__ = ["ALL_LAYERS", "CANCELLED", "EndedPart", "OpenJob"]

CANCELLED = "cancelled: past its deadline"
# `OpenJob.copying`'s key for a task of every layer (no layer is named "")
ALL_LAYERS = ""


@dataclass(frozen=True, slots=True)
class EndedPart:
    """Names a part that failed validation and so never became a task."""

    job_id: int
    part: int


@dataclass(slots=True)
class OpenJob:
    """A submitted job whose parts have not all ended; folded into one `JobResult`."""

    # job-wide index of each part's first chunk
    offsets: list[int]
    # tasks and failed parts not ended yet
    parts_left: int
    num_chunks: int
    failed_chunks: set[int] = field(default_factory=set)
    num_bytes: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    # every chunk fails, whatever its parts report
    is_cancelled: bool = False
    # a job copied by slices: layer (ALL_LAYERS: a task of every layer) -> its tasks not ended; else None
    copying: Counter[str] | None = None

    def add(self, part: int, outcome: TaskOutcome, layers: frozenset[str] | None = None) -> None:
        """A task of `part` ended (`layers`: the layers it counted in `copying`; None: a failed part)."""
        if self.copying is not None and layers is not None:
            self.copying.subtract(layers)
        self.failed_chunks.update(self.offsets[part] + c for c in outcome.failed_chunks)
        self.num_bytes += outcome.num_bytes
        self.seconds += outcome.seconds
        if outcome.error is not None:
            self.errors.append(outcome.error)
        self.parts_left -= 1

    def result(self, job_id: int) -> JobResult:
        # past its deadline: all of it fails, also a part that ended in time
        if self.is_cancelled:
            self.failed_chunks.update(range(self.num_chunks))
            if CANCELLED not in self.errors:
                self.errors.insert(0, CANCELLED)
        error = "; ".join(self.errors) if self.errors else None
        return JobResult(
            job_id=job_id,
            failed_chunks=tuple(sorted(self.failed_chunks)),
            num_bytes=self.num_bytes,
            seconds=self.seconds,
            error=error,
        )
