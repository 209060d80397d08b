"""A small engine that plays vLLM's scheduler protocol, step by step, for tests and
the simulator.

It has a block pool with a local prefix cache, admits waiting requests (asking the
`OffloadScheduler` for external hits after its own), schedules prefill chunks and
decodes, supports preemption and `reset_prefix_cache`, parks a request whose load is
asynchronous until the worker reports it (vLLM's WAITING_FOR_REMOTE_KVS: a request
aborted meanwhile keeps its blocks until then), and runs each step's `StepPlan` on the
real worker — `kvtier.worker.WorkerSide` and a `TransferEngine` over small CPU tensors
(`KVCache`) and a shared-memory host slab — in vLLM's order: flushes and loads, the forward
pass, stores, then the finished requests, then the workers' results. Its "model" checks
every block a token attends to (`kvtier.sim.model`: a wrong load, a missing fence or a
stale completion is a `ContentMismatch`); sliding-window groups follow vLLM's rule (the
null block, block 0, is never written: checked after every step). Stores start at step
boundaries (`SimTransferEngine`), so runs are repeatable.
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
from kvtier.sim.model import FakeModel
from kvtier.sim.request import SimRequest
from kvtier.slab import HostSlab, slab_name
from kvtier.worker.layouts import build_group_layouts, slot_bytes_of
from kvtier.worker.side import WorkerSide

__all__ = ["ContentMismatch", "FakeEngine", "SimRequest", "make_slab"]


class FakeEngine(FakeModel):
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
        self.groups = groups or (
            scheduler.config.groups if scheduler else (GroupSpec(tokens_per_block=block_size),)
        )
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
            bpc, num_slots = self.groups[0].blocks_per_chunk, scheduler.manager.stats().num_slots
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
        self.parked: dict[str, SimRequest] = {}  # loading asynchronously (not scheduled)
        self._late_invalid: set[int] = set()  # load errors reported after the forward pass
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
        self._finish(
            req, keep_blocks=req_id in self.parked
        )  # a load still writes them: freed when it ends

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
            new = self._grow(req, req.num_computed + n) if n > 0 else None
            if n > 0 and new is not None:
                budget -= n
                is_first = (
                    req.awaits_first_schedule
                )  # vLLM: a new request, with every block it holds
                req.awaits_first_schedule = False
                new = tuple(list(ids) for ids in req.block_ids) if is_first else new
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
        ext, load_async = (
            self.scheduler.get_num_new_matched_tokens(req.view(), num_local)
            if self.scheduler
            else (0, False)
        )
        if ext is None:
            return None
        n = 0 if load_async else min(req.num_tokens - num_local - ext, budget)
        needed = -(-(num_local + ext + n) // self.block_size) - len(local)
        local_ids = [[bs[g] for bs in local] for g in range(len(self.groups))]
        for (
            blocks
        ) in local:  # first: making room for the new blocks must not evict the hits (as in vLLM)
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
            req.num_cached_tokens, req.num_external_tokens = num_local + ext, ext
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
        self._preempted, self._finished = set(), set()
        if self.scheduler is None or self.worker is None or self.transfer is None:
            self._finish_all([req for req, n, _ in scheduled if self._forward(req, n)])
            return
        plan = self.scheduler.build_connector_meta(step)
        _check_plan(plan)
        self.worker.handle_preemptions(plan)
        self.worker.start_load_kv(plan)
        for layer in self.kv.tensors:  # as vLLM's forward pass asks before each attention
            self.worker.wait_for_layer_load(layer)
        self.worker.finish_layered_loads()  # vLLM: in wait_for_save; it drops outputs on load errors (here: no forward)
        invalid, self._late_invalid = self.worker.take_load_errors() | self._late_invalid, set()
        done = [
            req
            for req, n, _ in scheduled
            if not self._rewind_if_invalid(req, invalid) and self._forward(req, n)
        ]
        self.worker.wait_for_save(plan)
        self.transfer.end_step()
        loaded, failed = self.worker.take_finished_loads()
        results = self.worker.take_results()
        self._finish_all(done)
        self.scheduler.update_connector_output(results)
        if self._lazy:
            self.scheduler.plan_evictions(self.pool.evictable(self._lookahead()))
        self._late_invalid = (
            self.worker.take_load_errors()
        )  # reported with the loads that just ended
        self._unpark(loaded, failed, invalid | self._late_invalid)
        if self.pool.null_block is not None:
            self.kv.check_unwritten(self.pool.null_block, f"step {self.num_steps}: the null block")

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
            self.scheduler.request_finished(req.view())
        if not keep_blocks:
            self._release_blocks(req)
        self._finished.add(req.req_id)


def make_slab(kv: KVCache, blocks_per_chunk: int, num_slots: int) -> HostSlab:
    """The engine's host slab, made by its scheduler part before its worker maps it by name.

    A test that gives the scheduler a `TieredManager` makes it first (over a `KVCache` of the
    engine's shape) and passes it as `FakeEngine(slab=...)`: the manager needs its rows."""
    slot_bytes = slot_bytes_of(build_group_layouts(kv.tensors, blocks_per_chunk, kv.layer_groups))
    name = slab_name(f"sim{os.getpid()}-{time.time_ns()}", 0, 0)
    return HostSlab(
        name, num_slots, slot_bytes, owner=True, populate=False
    )  # the worker populates its mapping


def _check_plan(plan: StepPlan) -> None:
    """One load job XOR any number of store jobs per request, in every step."""
    loading = [j.req_id for j in plan.load_jobs + plan.async_load_jobs]
    if len(loading) != len(set(loading)) or set(loading) & {j.req_id for j in plan.store_jobs}:
        raise AssertionError(f"a request got a load and another job in one step: {plan}")
