"""Per-request scheduler state: one dataclass per request, one per (request, group).

`RequestOffloadState` holds everything the scheduler knows about a request: its view,
its `ReqContext` (built from its `req_id`), per-group keys, blocks and store cursors,
the load it is about to start, the jobs it has in flight, and its deferral budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.base import ReqContext
from kvtier.costmodel.decision import LoadChoice
from kvtier.jobs import TransferJob
from kvtier.keys import OffloadKey, make_offload_key
from kvtier.scheduler.config import GroupKind, GroupSpec, SchedulerOffloadConfig
from kvtier.scheduler.params import OffloadParams, for_role, parse_kv_transfer_params
from kvtier.scheduler.types import RequestView

__all__ = [
    "DecidedLoad",
    "JobRecord",
    "LookupAnswer",
    "PendingLoad",
    "RequestGroupState",
    "RequestOffloadState",
]


@dataclass(slots=True)
class RequestGroupState:
    """One KV-cache group of one request.

    offload_keys: keys of the chunks hashed so far (computed lazily, cached).
    block_ids: the engine blocks of this group, in token order.
    next_store_chunk: the store cursor; chunks before it were offered to the tier.
    num_hit_chunks: chunks loaded from kvtier for this request (for stats and tests).
    """

    group: int
    spec: GroupSpec
    offload_keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    next_store_chunk: int = 0
    num_hit_chunks: int = 0

    def chunk_blocks(self, chunk: int) -> list[int]:
        bpc = self.spec.blocks_per_chunk
        return self.block_ids[chunk * bpc : (chunk + 1) * bpc]

    def num_allocated_chunks(self) -> int:
        return len(self.block_ids) // self.spec.blocks_per_chunk


@dataclass(frozen=True, slots=True)
class DecidedLoad:
    """A request's load-or-recompute decision (`kvtier.scheduler.load_cost`)."""

    # the first chunk after the engine's own hits when it was made
    start_chunk: int
    choice: LoadChoice
    decided_at: float


@dataclass(frozen=True, slots=True)
class PendingLoad:
    """A hit found by a lookup, to become a load job once blocks are allocated."""

    start_chunk: int
    end_chunk: int
    num_local_tokens: int
    # the load-or-recompute decision behind it
    decided: DecidedLoad | None = None


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    """The scheduler's latest answer to "how many tokens can kvtier add?" for a request.

    Counted in the stats once, when the engine admits the request with it (an engine
    re-asks a waiting request every step it cannot schedule it).
    """

    num_local_tokens: int
    # tokens after the engine's own hits that kvtier was asked for
    num_query_tokens: int


@dataclass(slots=True)
class JobRecord:
    """Scheduler-side bookkeeping of one in-flight job."""

    job: TransferJob
    # one per chunk, in the job's part order
    keys: list[OffloadKey]
    # the reset_cache() generation it was created in
    generation: int
    # the scheduler fails the job if not every worker reported it by then
    expires_at: float
    num_acks: int = 0
    failed_chunks: set[int] = field(default_factory=set)
    # an asynchronous load's: the end of its request's waiting budget
    deadline_cap: float = math.inf
    # a load its request is parked for (nobody waits for it in a step)
    is_async: bool = False
    # a store's engine blocks (its fences), kept to lift them when it ends
    read_blocks: set[int] = field(default_factory=set)

    @property
    def is_store(self) -> bool:
        """The job's direction (`TransferJob.is_store`): engine -> slab; else a load."""
        return self.job.is_store


@dataclass(slots=True)
class RequestOffloadState:
    """Everything the scheduler tracks for one request."""

    config: SchedulerOffloadConfig
    req: RequestView
    group_states: list[RequestGroupState] = field(init=False)
    req_context: ReqContext = field(init=False)
    params: OffloadParams = field(init=False)
    num_locally_computed_tokens: int = 0
    # in-flight job ids
    transfer_jobs: set[int] = field(default_factory=set)
    # the in-flight load, if any
    load_job_id: int | None = None
    pending_load: PendingLoad | None = None
    # kept while the request is asked again, dropped at an answer
    decided_load: DecidedLoad | None = None
    # the load in flight's decision, seconds waited for it
    timed_load: tuple[DecidedLoad, float] | None = None
    # the latest lookup answer, not counted yet
    answer: LookupAnswer | None = None
    num_deferrals: int = 0
    first_deferred_at: float | None = None
    deferral_expired: bool = False
    # a load of it failed: it recomputes, kvtier offers it nothing more
    had_failed_load: bool = False
    is_finished: bool = False
    # the scheduler step in which request_finished came
    finished_at_step: int | None = None
    # a hand-off it was promised (`kvtier.scheduler.handoff`): the chunks it waits for (0: none),
    # until when, and whether the wait is over
    handoff_chunks: int = 0
    handoff_deadline: float | None = None
    handoff_over: bool = False

    def __post_init__(self) -> None:
        self.group_states = [
            RequestGroupState(g, spec) for g, spec in enumerate(self.config.groups)
        ]
        raw = self.req.kv_transfer_params
        params = parse_kv_transfer_params(raw, self.req.req_id)
        self.params = for_role(params, self.config.role, self.config.consumer_stores)
        self.req_context = ReqContext(
            self.req.req_id,
            raw if isinstance(raw, dict) else None,
            self.params.hints,
            self.req.tenant,
            hands_off=self.params.remote_decode,
        )

    @property
    def req_id(self) -> str:
        return self.req.req_id

    def num_hashed_chunks(self) -> int:
        return len(self.req.block_hashes) // self.config.hashes_per_chunk

    def chain_keys(self, end: int) -> list[OffloadKey]:
        """Keys of the chunks before `end` the request needs, head first (see `chunk_major`).

        Sliding-window groups contribute only the chunks inside their window before `end`;
        unsupported groups none.
        """
        firsts = {
            gs.group: gs.spec.first_needed_chunk(end)
            for gs in self.group_states
            if gs.spec.kind is not GroupKind.UNSUPPORTED
        }
        if len(firsts) == 1:
            # one group: its keys in order, without a (group, chunk) per chunk (a lookup touches
            # the whole prefix: 8,192 chunks of a 128k prompt)
            ((group, first),) = firsts.items()
            return self.keys(group, first, end) if first < end else []
        return self.chunk_major(firsts, end)[0]

    def chunk_major(
        self, firsts: dict[int, int], end: int
    ) -> tuple[list[OffloadKey], list[tuple[int, int]]]:
        """Keys of chunks [firsts[g], end) of each group g, with their (group, chunk), chunk by chunk
        across groups: head first across groups too, so a policy that ranks a chain "tails before
        heads" never keeps one group's tail longer than another group's head."""
        firsts = {g: first for g, first in firsts.items() if first < end}
        if not firsts:
            return [], []
        group_keys = {g: self.keys(g, first, end) for g, first in firsts.items()}
        chunks = [
            (g, c) for c in range(min(firsts.values()), end) for g in firsts if c >= firsts[g]
        ]
        return [group_keys[g][c - firsts[g]] for g, c in chunks], chunks

    def keys(self, group: int, start: int, end: int) -> list[OffloadKey]:
        """Offload keys of chunks [start, end) of `group` (end <= num_hashed_chunks())."""
        keys = self.group_states[group].offload_keys
        if len(keys) < end:
            hashes = self.req.block_hashes
            per_chunk = self.config.hashes_per_chunk
            # `make_offload_key(h, group)` is h + this suffix: built once, not per key
            suffix = make_offload_key(b"", group)
            keys += [
                bytes(h) + suffix
                for h in hashes[(len(keys) + 1) * per_chunk - 1 : end * per_chunk : per_chunk]
            ]
            if len(keys) < end:
                raise IndexError(f"request {self.req_id}: chunk {end - 1} is not hashed yet")
        return keys[start:end]

    def set_block_ids(self, block_ids: tuple[list[int], ...], replace: bool) -> list[int]:
        """Record blocks allocated to the request (copied: `block_ids` may be the engine's own lists,
        which it goes on changing).

        Returns:
            The ids the engine may write next: new blocks, never the leading blocks its
            own prefix cache served (those are shared and read-only).
        """
        written: list[int] = []
        for state, ids in zip(self.group_states, block_ids, strict=False):
            if replace:
                state.block_ids = list(ids)
                written.extend(
                    ids[self.num_locally_computed_tokens // state.spec.tokens_per_block :]
                )
            else:
                state.block_ids.extend(ids)
                written.extend(ids)
        return written

    def held_block_ids(self) -> set[int]:
        return {b for gs in self.group_states for b in gs.block_ids}

    def blocks_between(self, first_token: int, end_chunk: int) -> set[int]:
        """Every group's blocks from the one holding `first_token` to the end of chunk `end_chunk - 1`
        (never a window group's blocks before its window: they are the engine's null block)."""
        blocks: set[int] = set()
        for gs in self.group_states:
            spec = gs.spec
            skipped = spec.num_skipped_blocks(end_chunk * spec.tokens_per_chunk)
            first = max(first_token // spec.tokens_per_block, skipped)
            blocks.update(gs.block_ids[first : end_chunk * spec.blocks_per_chunk])
        return blocks

    def clear_block_ids(self) -> None:
        for state in self.group_states:
            state.block_ids = []

    def reset_store_cursors(self) -> None:
        for state in self.group_states:
            state.next_store_chunk = 0
