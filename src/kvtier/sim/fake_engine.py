"""A small engine that plays vLLM's scheduler protocol, step by step, for tests and
the simulator.

It has a block pool with a local prefix cache, admits waiting requests (asking the
`OffloadScheduler` for external hits after its own), schedules prefill chunks and
decodes, supports preemption and `reset_prefix_cache`, and runs each step's
`StepPlan` on a `FakeWorker`. Every block it computes gets a content token derived
from the block's hash; before computing a token it checks that every block the token
attends to holds the right content — so a wrong load, a missing fence or a stale
completion shows up as `ContentMismatch`, not as a silently wrong number.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvtier.keys import BlockHasher
from kvtier.scheduler.config import GroupKind, GroupSpec
from kvtier.scheduler.core import OffloadScheduler
from kvtier.scheduler.types import RequestView, ScheduledRequest, StepPlan, StepView
from kvtier.sim.fake_worker import FakeWorker

__all__ = ["ContentMismatch", "FakeEngine", "SimRequest"]


class ContentMismatch(AssertionError):
    """A block held other KV than the tokens it stands for (a correctness bug)."""


@dataclass
class SimRequest:
    req_id: str
    prompt: list[int]
    max_new_tokens: int
    cache_salt: str | None = None
    kv_transfer_params: Any = None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[list[int]] = field(default_factory=list)  # per group
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None  # local + external at first scheduling
    num_external_tokens: int = 0
    num_lookups: int = 0
    is_finished: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class FakeEngine:
    """Drives an `OffloadScheduler` (or none: the no-offload baseline) like vLLM does."""

    def __init__(self, scheduler: OffloadScheduler | None, *, num_blocks: int = 64, block_size: int = 4,
                 groups: tuple[GroupSpec, ...] | None = None, max_tokens_per_step: int = 64):
        self.scheduler = scheduler
        self.block_size = block_size
        self.groups = groups or (scheduler.config.groups if scheduler else (GroupSpec(tokens_per_block=block_size),))
        self.max_tokens_per_step = max_tokens_per_step
        self.hasher = BlockHasher(block_size)
        self.worker = FakeWorker([None] * num_blocks)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.refs = [0] * num_blocks
        self.cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # hash -> block per group (LRU order)
        self.requests: dict[str, SimRequest] = {}
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self._preempted: set[str] = set()
        self._finished: set[str] = set()
        self.num_steps = 0

    # -- public API -------------------------------------------------------------------

    def add_request(self, req_id: str, prompt: list[int], max_new_tokens: int = 1, **kw: Any) -> SimRequest:
        req = SimRequest(req_id, list(prompt), max_new_tokens, **kw)
        req.block_hashes = self.hasher.hash_blocks(req.prompt, cache_salt=req.cache_salt)
        self.requests[req_id] = req
        self.waiting.append(req)
        return req

    def abort(self, req_id: str) -> None:
        req = self.requests[req_id]
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req)

    def preempt(self, req_id: str) -> None:
        req = self.requests[req_id]
        self.running.remove(req)
        self._release_blocks(req)
        req.num_computed = 0
        self.waiting.insert(0, req)
        self._preempted.add(req_id)

    def reset_prefix_cache(self) -> None:
        """Drop every unused cached block (vLLM's reset_prefix_cache(reset_connector=False))."""
        for blocks in self.cache.values():
            self.free_blocks.extend(b for b in blocks if self.refs[b] == 0)
        self.cache = OrderedDict((h, bs) for h, bs in self.cache.items() if any(self.refs[b] for b in bs))

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not (self.waiting or self.running):
                return
            self.step()
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")

    # -- one step ---------------------------------------------------------------------

    def step(self) -> None:
        budget = self.max_tokens_per_step
        scheduled: list[tuple[SimRequest, int, ScheduledRequest]] = []
        for req in list(self.running):
            n = min(req.num_tokens - req.num_computed, budget)
            new = self._grow(req, req.num_computed + n) if n > 0 else None
            if n > 0 and new is not None:
                budget -= n
                scheduled.append((req, n, ScheduledRequest(req.req_id, new, False, req.num_computed, n)))
        for req in list(self.waiting):
            if budget <= 0:
                break
            admitted = self._admit(req, budget)
            if admitted is not None:
                budget -= admitted[1]
                scheduled.append(admitted)
        self._execute(scheduled)
        self.num_steps += 1

    def _admit(self, req: SimRequest, budget: int) -> tuple[SimRequest, int, ScheduledRequest] | None:
        local = self._local_hit(req)
        num_local = len(local) * self.block_size
        req.num_lookups += 1
        ext, _ = (self.scheduler.get_num_new_matched_tokens(self._view(req), num_local)
                  if self.scheduler else (0, False))
        if ext is None:
            return None
        n = min(req.num_tokens - num_local - ext, budget)
        needed = -(-(num_local + ext + n) // self.block_size) - len(local)
        new = self._allocate_groups(needed)
        if new is None:
            return None
        for blocks in local:
            for b in blocks:
                self.refs[b] += 1
        req.block_ids = [[bs[g] for bs in local] + new[g] for g in range(len(self.groups))]
        if self.scheduler:
            self.scheduler.update_state_after_alloc(req.req_id, tuple(list(ids) for ids in req.block_ids), ext)
        req.num_computed = num_local + ext
        if req.num_cached_tokens is None:
            req.num_cached_tokens, req.num_external_tokens = num_local + ext, ext
        self.waiting.remove(req)
        self.running.append(req)
        ids = tuple(list(ids) for ids in req.block_ids)
        return req, n, ScheduledRequest(req.req_id, ids, True, req.num_computed, n)

    def _execute(self, scheduled: list[tuple[SimRequest, int, ScheduledRequest]]) -> None:
        step = StepView([s for _, _, s in scheduled], self._preempted, self._finished)
        self._preempted, self._finished = set(), set()
        if self.scheduler is None:
            for req, n, _ in scheduled:
                self._forward(req, n)
            return
        plan = self.scheduler.build_connector_meta(step)
        _check_plan(plan)
        invalid = self.scheduler.update_connector_output(self.worker.before_forward(plan))
        invalid |= plan.failed_load_block_ids
        for req, n, _ in scheduled:
            if not self._rewind_if_invalid(req, invalid):
                self._forward(req, n)
        self.scheduler.update_connector_output(self.worker.after_forward(plan))

    # -- the "model" ------------------------------------------------------------------

    def expected(self, req: SimRequest, index: int, group: int) -> tuple:
        return ("kv", req.block_hashes[index], group)

    def _forward(self, req: SimRequest, n: int) -> None:
        start, end = req.num_computed, req.num_computed + n
        for g, spec in enumerate(self.groups):
            window = spec.sliding_window if spec.kind is GroupKind.SLIDING_WINDOW else None
            first = 0 if window is None else max(0, start - window + 1) // self.block_size
            for j in range(first, start // self.block_size):
                got = self.worker.blocks[req.block_ids[g][j]]
                if got != self.expected(req, j, g):
                    raise ContentMismatch(f"{req.req_id}: block {j} of group {g} holds {got!r}")
            for j in range(start // self.block_size, end // self.block_size):
                self.worker.blocks[req.block_ids[g][j]] = self.expected(req, j, g)
        req.num_computed = end
        self._cache_computed(req)
        if end == req.num_tokens:
            self._sample(req)

    def _sample(self, req: SimRequest) -> None:
        req.output.append((sum(req.tokens[-8:]) * 31 + req.num_tokens) % 997)
        full = req.num_tokens // self.block_size
        if full > len(req.block_hashes):
            parent = req.block_hashes[-1] if req.block_hashes else None
            tail = req.tokens[len(req.block_hashes) * self.block_size : full * self.block_size]
            salt = req.cache_salt if not req.block_hashes else None
            req.block_hashes.extend(self.hasher.hash_blocks(tail, cache_salt=salt, parent=parent))
        if len(req.output) >= req.max_new_tokens:
            self.running.remove(req)
            self._finish(req)

    def _rewind_if_invalid(self, req: SimRequest, invalid: set[int]) -> bool:
        """vLLM's "recompute" policy: a request with a failed block recomputes from it."""
        for g in range(len(self.groups)):
            for j, b in enumerate(req.block_ids[g]):
                if b in invalid and j * self.block_size < req.num_computed:
                    req.num_computed = j * self.block_size
                    return True
        return False

    # -- blocks -----------------------------------------------------------------------

    def _local_hit(self, req: SimRequest) -> list[tuple[int, ...]]:
        hits = []
        for h in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hits.append(self.cache[h])
        return hits

    def _allocate(self, n: int) -> list[int] | None:
        while len(self.free_blocks) < n:
            victim = next((h for h, bs in self.cache.items() if not any(self.refs[b] for b in bs)), None)
            if victim is None:
                return None
            self.free_blocks.extend(self.cache.pop(victim))
        return [self.free_blocks.pop() for _ in range(n)]

    def _grow(self, req: SimRequest, num_tokens: int) -> tuple[list[int], ...] | None:
        needed = -(-num_tokens // self.block_size) - len(req.block_ids[0])
        if needed <= 0:
            return tuple([] for _ in self.groups)
        new = self._allocate_groups(needed)
        if new is None:
            self.preempt(req.req_id)
            return None
        for g, blocks in enumerate(new):
            req.block_ids[g].extend(blocks)
        return tuple(new)

    def _allocate_groups(self, n: int) -> list[list[int]] | None:
        """`n` referenced blocks for every group, or None (and nothing taken)."""
        new = [self._allocate(n) for _ in self.groups]
        if any(blocks is None for blocks in new):
            for blocks in new:
                self.free_blocks.extend(blocks or [])
            return None
        for blocks in new:
            for b in blocks:
                self.refs[b] += 1
        return new

    def _cache_computed(self, req: SimRequest) -> None:
        """Like vLLM: full, computed blocks enter the prefix cache as soon as they exist."""
        for j in range(min(req.num_computed // self.block_size, len(req.block_hashes))):
            self.cache.setdefault(req.block_hashes[j], tuple(ids[j] for ids in req.block_ids))

    def _release_blocks(self, req: SimRequest) -> None:
        """Unreference the request's blocks; cached ones stay cached, the rest are freed."""
        cached = {b for bs in self.cache.values() for b in bs}
        for ids in req.block_ids:
            for b in ids:
                self.refs[b] -= 1
                if self.refs[b] == 0 and b not in cached:
                    self.free_blocks.append(b)
        req.block_ids = []

    def _finish(self, req: SimRequest) -> None:
        req.is_finished = True
        if self.scheduler:
            self.scheduler.request_finished(self._view(req))
        self._release_blocks(req)
        self._finished.add(req.req_id)

    def _view(self, req: SimRequest) -> RequestView:
        return RequestView(req.req_id, req.block_hashes, req.num_tokens, len(req.prompt),
                           req.num_computed, req.kv_transfer_params)


def _check_plan(plan: StepPlan) -> None:
    """One load job XOR any number of store jobs per request, in every step."""
    loading = [j.req_id for j in plan.load_jobs]
    if len(loading) != len(set(loading)) or set(loading) & {j.req_id for j in plan.store_jobs}:
        raise AssertionError(f"a request got a load and another job in one step: {plan}")
