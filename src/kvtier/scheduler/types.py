"""The engine-facing views: what an adapter builds from its engine's objects for the scheduler.

`RequestView`, `ScheduledRequest`, `ScheduledBatch` and `StepView` hold no engine object and no
tensor (a batch's block id lists may be the engine's own lists of ints). (What goes from the
scheduler to the workers and back — jobs, plans, results — is in `kvtier.jobs`.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.jobs import BlockIds
from kvtier.keys import BlockHash

__all__ = ["BlockIds", "RequestView", "ScheduledBatch", "ScheduledRequest", "StepView"]


@dataclass(slots=True, kw_only=True)
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
    # untrusted: validated by kvtier.scheduler.params
    kv_transfer_params: Any = None
    # the engine's per-tenant cache salt (vLLM's cache_salt)
    tenant: str | None = None
    # the adapter's own handle on the request (its events read it); never read here
    engine_request: Any = None


@dataclass(slots=True, kw_only=True)
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


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """The requests of one engine step: one sequence per field of `ScheduledRequest`, all in one
    order (request i is `req_ids[i]`, `new_block_ids[i]`, ...).

    Columns, not an object per request: an adapter hands over its engine's own lists, and the
    scheduler reads every running request in every step (issue 37: a `ScheduledRequest` per
    request cost vLLM's adapter 22 µs a step at 64 decoding requests, 86 at 256; columns 4 and
    11). The block id lists may be the engine's own: the scheduler only reads them, and copies
    what it keeps before `OffloadScheduler.build_connector_meta` returns.
    """

    req_ids: Sequence[str] = ()
    new_block_ids: Sequence[BlockIds | None] = ()
    is_new_or_resumed: Sequence[bool] = ()
    num_computed_tokens: Sequence[int] = ()
    num_scheduled_tokens: Sequence[int] = ()

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        lengths = (
            len(self.new_block_ids),
            len(self.is_new_or_resumed),
            len(self.num_computed_tokens),
            len(self.num_scheduled_tokens),
        )
        if any(length != n for length in lengths):
            raise ValueError(f"a ScheduledBatch's columns differ in length: {n}, {lengths}")

    @classmethod
    def of(cls, scheduled: Iterable[ScheduledRequest]) -> ScheduledBatch:
        """The batch of `scheduled`, in its order."""
        rows = list(scheduled)
        return cls(
            [s.req_id for s in rows],
            [s.new_block_ids for s in rows],
            [s.is_new_or_resumed for s in rows],
            [s.num_computed_tokens for s in rows],
            [s.num_scheduled_tokens for s in rows],
        )

    def __len__(self) -> int:
        return len(self.req_ids)

    def __iter__(self) -> Iterator[ScheduledRequest]:
        """Each request as a `ScheduledRequest` (for tests and logs; the scheduler reads the
        columns)."""
        for req_id, new_ids, is_new, computed, num in self.rows():
            yield ScheduledRequest(
                req_id=req_id,
                new_block_ids=new_ids,
                is_new_or_resumed=is_new,
                num_computed_tokens=computed,
                num_scheduled_tokens=num,
            )

    def rows(self) -> Iterator[tuple[str, BlockIds | None, bool, int, int]]:
        """(req_id, new_block_ids, is_new_or_resumed, num_computed_tokens, num_scheduled_tokens)
        of each request, in order."""
        return zip(
            self.req_ids,
            self.new_block_ids,
            self.is_new_or_resumed,
            self.num_computed_tokens,
            self.num_scheduled_tokens,
            strict=True,
        )


@dataclass(slots=True)
class StepView:
    """One engine step: the scheduled requests, and the ids preempted or finished.

    `scheduled` may be given as `ScheduledRequest`s (a list, as the fake engine and the tests
    build it): it is made a `ScheduledBatch`.
    """

    scheduled: ScheduledBatch = field(default_factory=ScheduledBatch)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not isinstance(self.scheduled, ScheduledBatch):
            self.scheduled = ScheduledBatch.of(self.scheduled)
