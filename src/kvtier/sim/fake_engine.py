"""A small engine that plays vLLM's scheduler protocol, step by step, for tests and
the simulator.

It has a block pool with a local prefix cache, admits waiting requests (asking the
`OffloadScheduler` for external hits after its own), schedules prefill chunks and
decodes, supports preemption and `reset_prefix_cache`, parks a request whose load is
asynchronous until the worker reports it (vLLM's WAITING_FOR_REMOTE_KVS: a request
aborted meanwhile keeps its blocks until then), and runs each step's `StepPlan` on the
real worker — `kvtier.worker.WorkerSide` and a `TransferEngine` over small CPU tensors
(`KVCache`) and a shared-memory host slab — in vLLM's order: flushes and loads, the forward
pass, stores, then the finished requests, then the workers' results. Stores start at step
boundaries (`SimTransferEngine`), so runs are repeatable.

Its "model" is part of the engine (it reads and changes the engine's block pool, KV cache and
requests): what a forward pass computes and checks, the sampled token, vLLM's recompute rule, and
how a request's blocks grow, leave a sliding window, enter the prefix cache and are freed. Every
block computed gets a value derived from the block's hash; before computing a token the model
checks that every block the token attends to holds the right value, so a wrong load, a missing
fence or a stale completion shows up as `ContentMismatch`. Sliding-window groups follow vLLM's
rule (the null block, block 0, is never written: checked after every step).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from kvtier.jobs import StepPlan
from kvtier.keys import BlockHasher
from kvtier.scheduler.config import GroupKind, GroupSpec
from kvtier.scheduler.core import OffloadScheduler
from kvtier.scheduler.types import ScheduledRequest, StepView
from kvtier.sim.block_pool import BlockPool
from kvtier.sim.faults import Faults, SimTransferEngine
from kvtier.sim.kv_cache import ContentMismatch, KVCache
from kvtier.sim.request import SimRequest
from kvtier.slab import HostSlab, slab_name
from kvtier.worker.layouts import build_group_layouts, slot_bytes_of
from kvtier.worker.side import WorkerSide

__all__ = ["ContentMismatch", "FakeEngine", "SimRequest", "make_slab"]


class FakeEngine:
    """Drives an `OffloadScheduler` (or none: the no-offload baseline) like vLLM does.

    Args:
        scheduler: the scheduler under test (None: no offloading).
        num_blocks, block_size: the engine's own KV cache.
        groups: KV-cache groups (default: the scheduler's).
        max_tokens_per_step: the step's token budget.
        faults: injected into the worker's transfer engine (see `kvtier.sim.faults`).
        clock: the clock the scheduler writes job deadlines in (the worker reads the same).
        slab: the host slab, if the caller made it (see `make_slab`); owned (unlinked) here.
        check_content: write each computed block's value and check every block a token
            attends to (default). Off, the KV tensors are neither written nor read by the
            "model" — the simulator's fast path; the transfers still copy them.
        evict_lookahead: how many block allocations ahead a lazy store mode learns which
            cached blocks they will evict (`OffloadScheduler.plan_evictions`). Default: two
            steps' worth, as vLLM's lazy offloading looks ahead — twice the most blocks one
            step has allocated so far (a step's token budget bounds it in vLLM; here a replay
            may admit many whole prompts in one step).

    Like vLLM, its "scheduler" owns the host slab, in shared memory (`slabs`: one rank), and
    its worker maps the same segment by name: both roles in one process. `close` unlinks it.
    """

    def __init__(
        self,
        scheduler: OffloadScheduler | None,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        groups: tuple[GroupSpec, ...] | None = None,
        max_tokens_per_step: int = 64,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.monotonic,
        slab: HostSlab | None = None,
        check_content: bool = True,
        evict_lookahead: int | None = None,
    ):
        self.scheduler = scheduler
        self.check_content = check_content
        self.block_size = block_size
        if not groups and scheduler is not None:
            groups = scheduler.config.groups
        self.groups = groups or (GroupSpec(tokens_per_block=block_size),)
        self.max_tokens_per_step = max_tokens_per_step
        self.evict_lookahead = evict_lookahead
        self._max_step_allocations = 1
        self._allocations_before_step = 0
        self._lazy = scheduler is not None and scheduler.config.store_mode == "lazy"
        self.hasher = BlockHasher(block_size)
        self.kv = KVCache(len(self.groups), num_blocks, block_size)
        self.faults = faults or Faults()
        self.worker: WorkerSide | None = None
        self.transfer: SimTransferEngine | None = None
        self.slabs: list[HostSlab] = []
        if scheduler is not None:
            bpc = self.groups[0].blocks_per_chunk
            num_slots = scheduler.manager.stats().num_slots
            self.slabs = [slab or make_slab(self.kv, bpc, num_slots)]
            self.worker = WorkerSide(
                num_slots=num_slots,
                blocks_per_chunk=bpc,
                layer_groups=self.kv.layer_groups,
                clock=clock,
                slab_name=self.slabs[0].name,
                transfer_factory=functools.partial(SimTransferEngine, faults=self.faults),
            )
            self.worker.register_kv_caches(self.kv.tensors)
            self.transfer = self.worker.transfer  # type: ignore[assignment]
        self._has_windows = any(g.kind is GroupKind.SLIDING_WINDOW for g in self.groups)
        self.pool = BlockPool(num_blocks, len(self.groups), reserve_null=self._has_windows)
        self.requests: dict[str, SimRequest] = {}
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        # loading asynchronously (not scheduled)
        self.parked: dict[str, SimRequest] = {}
        # load errors reported after the forward pass
        self._late_invalid: set[int] = set()
        self._preempted: set[str] = set()
        self._finished: set[str] = set()
        self.num_steps = 0

    # -- public API -------------------------------------------------------------------

    def add_request(
        self, req_id: str, prompt: list[int], max_new_tokens: int = 1, **kw: Any
    ) -> SimRequest:
        req = SimRequest(req_id, list(prompt), max_new_tokens, **kw)
        req.block_hashes = self.hasher.hash_blocks(req.prompt, cache_salt=req.cache_salt)
        self.requests[req_id] = req
        self.waiting.append(req)
        return req

    def abort(self, req_id: str) -> None:
        req = self.requests[req_id]
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        # a parked request's load still writes its blocks: freed when it ends
        self._finish(req, keep_blocks=req_id in self.parked)

    def preempt(self, req_id: str) -> None:
        req = self.requests[req_id]
        self.running.remove(req)
        self._release_blocks(req)
        req.num_computed = 0
        self.waiting.insert(0, req)
        self._preempted.add(req_id)

    def reset_prefix_cache(self) -> None:
        """Drop every unused cached block (vLLM's reset_prefix_cache(reset_connector=False))."""
        self.pool.reset_prefix_cache()

    def check_blocks(self) -> None:
        """Cross-check the block pool against the blocks the requests hold (tests, the stack fuzzer)."""
        holders = [*self.running, *self.parked.values(), *(r for r in self.waiting if r.block_ids)]
        self.pool.check([b for req in holders for ids in req.block_ids for b in ids])

    def close(self) -> None:
        """Stop the worker's copy threads and unlink the host slab (idempotent)."""
        if self.worker is not None:
            self.worker.shutdown()
        for slab in self.slabs:
            slab.close()

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not (self.waiting or self.running or self.parked):
                return
            self.step()
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")

    # -- one step ---------------------------------------------------------------------

    def step(self) -> None:
        self._allocations_before_step = self.pool.num_allocations
        budget = self.max_tokens_per_step
        scheduled: list[tuple[SimRequest, int, ScheduledRequest]] = []
        for req in list(self.running):
            self._skip_window_blocks(req, req.num_computed)
            n = min(req.num_tokens - req.num_computed, budget)
            if n <= 0:
                continue
            new = self._grow(req, req.num_computed + n)
            if new is None:
                continue
            budget -= n
            # vLLM: a new request, with every block it holds
            is_first = req.awaits_first_schedule
            req.awaits_first_schedule = False
            if is_first:
                new = tuple(list(ids) for ids in req.block_ids)
            scheduled.append((req, n, req.as_scheduled(new, is_first, n)))
        for req in list(self.waiting):
            if budget <= 0:
                break
            admitted = self._admit(req, budget)
            if admitted is not None:
                budget -= admitted[1]
                scheduled.append(admitted)
        self._execute(scheduled)
        self.num_steps += 1

    def _admit(
        self, req: SimRequest, budget: int
    ) -> tuple[SimRequest, int, ScheduledRequest] | None:
        local = self.pool.cached_prefix(req.block_hashes[: (req.num_tokens - 1) // self.block_size])
        num_local = len(local) * self.block_size
        req.num_lookups += 1
        ext: int | None = 0
        load_async = False
        if self.scheduler:
            ext, load_async = self.scheduler.get_num_new_matched_tokens(req.view(), num_local)
        if ext is None:
            return None
        n = 0 if load_async else min(req.num_tokens - num_local - ext, budget)
        needed = -(-(num_local + ext + n) // self.block_size) - len(local)
        local_ids = [[bs[g] for bs in local] for g in range(len(self.groups))]
        # first: making room for the new blocks must not evict the hits (as in vLLM)
        for blocks in local:
            self.pool.reference(blocks)
        new = self.pool.allocate(needed)
        if new is None:
            self.pool.release(local_ids)
            return None
        req.block_ids = [local_ids[g] + new[g] for g in range(len(self.groups))]
        self._skip_window_blocks(req, num_local + ext)
        if self.scheduler:
            self.scheduler.update_state_after_alloc(
                req.req_id, tuple(list(ids) for ids in req.block_ids), ext
            )
        req.num_computed = num_local + ext
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_local + ext
            req.num_external_tokens = ext
        self.waiting.remove(req)
        if load_async:
            self.parked[req.req_id] = req
            return None
        self.running.append(req)
        ids = tuple(list(ids) for ids in req.block_ids)
        return req, n, req.as_scheduled(ids, True, n)

    def _execute(self, scheduled: list[tuple[SimRequest, int, ScheduledRequest]]) -> None:
        """One step in vLLM's order: plan; worker before the forward pass; the forward pass;
        worker after it; then the finished requests; then the workers' job results."""
        # vLLM's SchedulerOutput lists the requests scheduled for the first time (or resumed) before
        # the running ones, although it scheduled the running ones first (and freed their blocks
        # outside a window, which a new request may get in the same step)
        order = [s for _, _, s in scheduled if s.is_new_or_resumed] + [
            s for _, _, s in scheduled if not s.is_new_or_resumed
        ]
        step = StepView(order, self._preempted, self._finished)
        self._preempted = set()
        self._finished = set()
        if self.scheduler is None or self.worker is None or self.transfer is None:
            self._finish_all(self._forward_pass(scheduled, invalid=set()))
            return
        plan = self.scheduler.build_connector_meta(step)
        _check_plan(plan)
        self.worker.handle_preemptions(plan)
        self.worker.start_load_kv(plan)
        # as vLLM's forward pass asks before each attention
        for layer in self.kv.tensors:
            self.worker.wait_for_layer_load(layer)
        # vLLM: in wait_for_save; it drops outputs on load errors (here: no forward)
        self.worker.finish_layered_loads()
        invalid = self.worker.take_load_errors() | self._late_invalid
        self._late_invalid = set()
        done = self._forward_pass(scheduled, invalid)
        self.worker.wait_for_save(plan)
        self.transfer.end_step()
        loaded, failed = self.worker.take_finished_loads()
        results = self.worker.take_results()
        self._finish_all(done)
        self.scheduler.update_connector_output(results)
        if self._lazy:
            self.scheduler.plan_evictions(self.pool.evictable(self._lookahead()))
        # reported with the loads that just ended
        self._late_invalid = self.worker.take_load_errors()
        self._unpark(loaded, failed, invalid | self._late_invalid)
        if self.pool.null_block is not None:
            self.kv.check_unwritten(self.pool.null_block, f"step {self.num_steps}: the null block")

    def _forward_pass(
        self, scheduled: list[tuple[SimRequest, int, ScheduledRequest]], invalid: set[int]
    ) -> list[SimRequest]:
        """The forward pass of one step: each scheduled request computes its tokens, unless one
        of its blocks failed to load (`invalid`: it rewinds to recompute from there). Returns the
        requests that now have all their output tokens."""
        done: list[SimRequest] = []
        for req, n, _ in scheduled:
            if self._rewind_if_invalid(req, invalid):
                continue
            is_complete = self._forward(req, n)
            if is_complete:
                done.append(req)
        return done

    def _unpark(self, loaded: set[str], failed: set[str], invalid: set[int]) -> None:
        """Requests whose asynchronous load ended run from the next step (as vLLM promotes them);
        a failed one recomputes from its first invalid block, or whole; an aborted one frees its blocks."""
        for req_id in loaded:
            req = self.parked.pop(req_id)
            if req.is_finished:
                self._release_blocks(req)
                continue
            self._rewind_if_invalid(req, invalid)
            if req_id in failed:
                req.num_computed = 0
                self._release_blocks(req)
                self.waiting.insert(0, req)
            else:
                req.awaits_first_schedule = True
                self.running.append(req)

    # -- the "model" ------------------------------------------------------------------

    def _forward(self, req: SimRequest, n: int) -> bool:
        """Compute `n` tokens of `req` after checking every block they attend to; True when
        the request then has all its output tokens."""
        start = req.num_computed
        end = start + n
        if self.check_content:
            for g, spec in enumerate(self.groups):
                first = 0
                if spec.kind is GroupKind.SLIDING_WINDOW:
                    first = max(0, start - spec.sliding_window + 1) // self.block_size
                attended = range(first, start // self.block_size)
                self.kv.check(req.req_id, g, *self._blocks(req, g, attended))
                computed = range(start // self.block_size, end // self.block_size)
                self.kv.write(g, *self._blocks(req, g, computed)[1:])
        req.num_computed = end
        self._cache_computed(req)
        if end != req.num_tokens:
            return False
        return self._sample(req)

    def _blocks(
        self, req: SimRequest, group: int, positions: range
    ) -> tuple[list[int], list[int], list[int]]:
        """(positions, engine blocks, expected contents) of the request's blocks at `positions`."""
        ids = req.block_ids[group]
        return (
            list(positions),
            [ids[j] for j in positions],
            [self.kv.content(req.block_hashes[j], group) for j in positions],
        )

    def _sample(self, req: SimRequest) -> bool:
        req.output.append((sum(req.tokens[-8:]) * 31 + req.num_tokens) % 997)
        full = req.num_tokens // self.block_size
        if full > len(req.block_hashes):
            parent = req.block_hashes[-1] if req.block_hashes else None
            tail = req.tokens[len(req.block_hashes) * self.block_size : full * self.block_size]
            salt = req.cache_salt if not req.block_hashes else None
            req.block_hashes.extend(self.hasher.hash_blocks(tail, cache_salt=salt, parent=parent))
        return len(req.output) >= req.max_new_tokens

    def _rewind_if_invalid(self, req: SimRequest, invalid: set[int]) -> bool:
        """vLLM's "recompute" policy: a request with a failed block recomputes from it."""
        if not invalid:
            return False
        for g in range(len(self.groups)):
            for j, b in enumerate(req.block_ids[g]):
                if b in invalid and j * self.block_size < req.num_computed:
                    req.num_computed = j * self.block_size
                    return True
        return False

    # -- blocks -----------------------------------------------------------------------

    def _grow(self, req: SimRequest, num_tokens: int) -> tuple[list[int], ...] | None:
        needed = -(-num_tokens // self.block_size) - len(req.block_ids[0])
        if needed <= 0:
            return tuple([] for _ in self.groups)
        new = self.pool.allocate(needed)
        if new is None:
            self.preempt(req.req_id)
            return None
        for g, blocks in enumerate(new):
            req.block_ids[g].extend(blocks)
        return tuple(new)

    def _skip_window_blocks(self, req: SimRequest, num_tokens: int) -> None:
        """vLLM's sliding-window rule (`SlidingWindowManager.get_num_skipped_tokens`): once
        `num_tokens` are computed, the blocks wholly before the next token's window are freed
        and point at the null block; nobody tells the connector."""
        for g, spec in enumerate(self.groups):
            if spec.kind is not GroupKind.SLIDING_WINDOW:
                continue
            ids = req.block_ids[g]
            kept = spec.sliding_window + spec.extra_retained_tokens
            skipped = min(len(ids), max(0, num_tokens - kept + 1) // self.block_size)
            # the null block among them is not counted
            self.pool.release_now(ids[:skipped])
            ids[:skipped] = [self.pool.null_block] * skipped

    def _cache_computed(self, req: SimRequest) -> None:
        self.pool.cache_blocks(req.block_hashes, req.block_ids, req.num_computed // self.block_size)

    def _release_blocks(self, req: SimRequest) -> None:
        self.pool.release(req.block_ids)
        req.block_ids = []

    # -- after the step ----------------------------------------------------------------

    def _lookahead(self) -> int:
        if self.evict_lookahead is not None:
            return self.evict_lookahead
        allocated = self.pool.num_allocations - self._allocations_before_step
        self._max_step_allocations = max(self._max_step_allocations, allocated)
        return 2 * self._max_step_allocations

    def _finish_all(self, reqs: list[SimRequest]) -> None:
        for req in reqs:
            self.running.remove(req)
            self._finish(req)

    def _finish(self, req: SimRequest, keep_blocks: bool = False) -> None:
        req.is_finished = True
        if self.scheduler:
            # a hand-off's promise, for the decode engine (`kvtier.scheduler.handoff`)
            req.returned_params = self.scheduler.request_finished(req.view())
        if not keep_blocks:
            self._release_blocks(req)
        self._finished.add(req.req_id)


def make_slab(kv: KVCache, blocks_per_chunk: int, num_slots: int) -> HostSlab:
    """The engine's host slab, made by its scheduler part before its worker maps it by name.

    A test that gives the scheduler a `TieredManager` makes it first (over a `KVCache` of the
    engine's shape) and passes it as `FakeEngine(slab=...)`: the manager needs its rows."""
    slot_bytes = slot_bytes_of(build_group_layouts(kv.tensors, blocks_per_chunk, kv.layer_groups))
    name = slab_name(f"sim{os.getpid()}-{time.time_ns()}", 0, 0)
    # the worker populates its mapping
    return HostSlab(name, num_slots, slot_bytes, owner=True, populate=False)


def _check_plan(plan: StepPlan) -> None:
    """One load job XOR any number of store jobs per request, in every step."""
    loading = [j.req_id for j in plan.load_jobs + plan.async_load_jobs]
    if len(loading) != len(set(loading)) or set(loading) & {j.req_id for j in plan.store_jobs}:
        raise AssertionError(f"a request got a load and another job in one step: {plan}")
