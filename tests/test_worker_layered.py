"""Synchronous loads copied layer by layer (`kvtier.worker.layered`), on the real CPU copy path.

A sliced load writes exactly the bytes a whole one writes; `wait_layer` returns once its layer
is copied, not before and not only once all are; slices keep the submission order wherever two
tasks touch the same bytes; and `WorkerSide` slices only after a forward pass asked for every
layer, failing whole the loads of a pass that skipped one.

Where a test must see a later slice *not yet* copied, `held` holds the copy threads (ctypes path)
after a given number of batches: a gate in front of the real copy, which still runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvtier.worker.memmove as memmove
from helpers import HANG_S, load_job, store_job
from kvtier.jobs import Endpoint, StepPlan, TransferJob, TransferPart
from kvtier.worker import TransferEngine, WorkerSide
from kvtier.worker.cuda import holding_layer
from kvtier.worker.layered import layer_slices, slice_task
from kvtier.worker.layouts import build_group_layouts
from kvtier.worker.pointers import copy_pointers, plane_pointers
from kvtier.worker.queue import TaskQueue
from kvtier.worker.tasks import make_task
from sched_helpers import FakeClock, close_after_test

LAYERS = [f"layer.{i}" for i in range(4)]
KV = dict[str, torch.Tensor]


def kv_cache(layout: str, num_layers: int, num_blocks: int, content: int) -> KV:
    """Zeroed int32 KV tensors: one per layer, or views of one buffer ("strided": blocks outside layers)."""
    if layout == "strided":
        buffer = torch.zeros(num_blocks, num_layers, 2, 4, content, dtype=torch.int32)
        return {f"layer.{i}": buffer[:, i] for i in range(num_layers)}
    shape = (
        (num_blocks, 2, 4, content) if layout == "blocks_first" else (2, num_blocks, 4, 2, content)
    )
    return {f"layer.{i}": torch.zeros(shape, dtype=torch.int32) for i in range(num_layers)}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal takes ~8 ms per 128 KiB on this host
    return np.array_equal(a.numpy(), b.numpy())


def randomize(kv: KV, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in kv.values():
        t.random_(generator=gen)


def fill_slots(engine: TransferEngine, kv: KV, ids: list[int]) -> list[torch.Tensor]:
    """Store random blocks `ids` into slots `ids` (blocks_first), then zero every block; returns
    each layer's stored blocks."""
    randomize(kv, seed=1000)
    engine.submit(store_job(1000, ids, ids))
    assert engine.wait([1000], timeout=HANG_S) and engine.get_finished()[0].success
    stored = [t[ids].clone() for t in kv.values()]
    for t in kv.values():
        t.zero_()
    return stored


class HeldCopies:
    """Once `hold_after(n)`: the copy threads copy n more batches, then hold each later one until
    `release()`, its cancel, or 10 s (so that a failing test ends)."""

    def __init__(self) -> None:
        self.budget, self.passed, self.released, self.lock = (
            math.inf,
            set(),
            threading.Event(),
            threading.Lock(),
        )

    def hold_after(self, num_batches: int) -> None:
        self.budget = num_batches
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    def copy_part(self, copy_part, dst, src, nbytes, handle: memmove.CopyHandle) -> bool:
        with self.lock:
            if handle not in self.passed and self.budget > 0:
                self.passed.add(handle)
                self.budget -= 1
        end = time.monotonic() + HANG_S
        while handle not in self.passed and not (
            self.released.is_set() or handle.is_cancelled or time.monotonic() > end
        ):
            time.sleep(0.0005)
        return copy_part(dst, src, nbytes, handle)


@pytest.fixture
def held(monkeypatch):
    monkeypatch.setattr(memmove, "_copyruns", None)
    copies = HeldCopies()
    monkeypatch.setattr(
        memmove, "_copy_part", functools.partial(copies.copy_part, memmove._copy_part)
    )
    yield copies
    copies.release()


@pytest.mark.parametrize("num_layers", [1, 2, 3, 8, 9, 40])
def test_layer_slices_put_the_first_layer_alone_and_keep_every_layer_once_in_order(num_layers):
    # the forward's order, not the names'
    order = [f"l{i}" for i in reversed(range(num_layers))]
    slices = layer_slices(order)
    assert slices[0] == {order[0]} and len(slices) == min(num_layers, 8)
    # each slice a run of consecutive layers, the runs in order: every layer once
    assert [layer for run in slices for layer in sorted(run, key=order.index)] == order
    sizes = [len(run) for run in slices[1:]]
    assert not sizes or max(sizes) - min(sizes) <= 1, sizes
    assert layer_slices([]) == []


CASES = [
    ("blocks_first", 1, 0),
    ("blocks_first", 2, 1),
    ("kv_first", 2, 0),
    ("kv_first", 2, 1),
    ("strided", 2, 1),
]


@pytest.mark.parametrize("bad_chunk", [False, True])
@pytest.mark.parametrize("layout, bpc, skip", CASES)
def test_a_sliced_load_writes_exactly_the_bytes_of_a_whole_load(layout, bpc, skip, bad_chunk):
    kv = kv_cache(layout, num_layers=5, num_blocks=16, content=8)
    names = list(kv)
    # slot 99 is out of range: that chunk fails alone
    slot_ids = [3, 0, 5] + ([99] if bad_chunk else [])
    block_ids = np.random.default_rng(bpc).permutation(16)[: len(slot_ids) * bpc]
    # not runs of the names
    odd = [
        frozenset(names[3:4]),
        frozenset(names[0:5:4]),
        frozenset(names[1:3]),
    ]
    outcomes = []
    with TransferEngine(kv, bpc, num_slots=6) as engine:
        engine.slab.copy_(torch.randint(-128, 127, engine.slab.shape, dtype=torch.int8))
        for job_id, slices in enumerate([None, layer_slices(names[::-1]), odd]):
            # the same background each time: a stray write shows
            randomize(kv, seed=7)
            engine.submit(load_job(job_id, slot_ids, block_ids, skip_blocks=skip), slices)
            assert engine.wait([job_id], timeout=HANG_S)
            (result,) = engine.get_finished()
            outcomes.append((result, [t.clone() for t in kv.values()]))
    (whole, want), *sliced = outcomes
    assert whole.success != bad_chunk and whole.num_bytes > 0
    for result, got in sliced:
        assert (result.failed_chunks, result.num_bytes) == (whole.failed_chunks, whole.num_bytes)
        for name, w, g in zip(names, want, got, strict=True):
            assert same(w, g), f"{name} differs from the whole load's"


def test_wait_layer_returns_once_its_slice_is_copied_while_later_slices_are_held(held):
    kv = kv_cache("blocks_first", num_layers=4, num_blocks=8, content=8)
    with TransferEngine(kv, 1, num_slots=8) as engine:
        stored = fill_slots(engine, kv, [0, 1, 2, 3])
        # the first slice (layer.0) copies; the later ones are held
        held.hold_after(1)
        engine.submit(load_job(1, [0, 1, 2, 3], [4, 5, 6, 7]), layer_slices(LAYERS))
        assert engine.wait_layer(
            [1], "layer.0", timeout=HANG_S
        ), "layer.0 was copied, yet wait_layer waits"
        assert same(kv["layer.0"][4:], stored[0])
        assert not engine.wait_layer(
            [1], "layer.1", timeout=0.05
        ), "layer.1 is held, yet wait_layer returned"
        assert not engine.wait([1], timeout=0)
        assert not any(
            kv[layer][4:].any() for layer in LAYERS[1:]
        ), "a later layer was copied with the first"
        held.release()
        assert engine.wait([1], timeout=HANG_S) and engine.get_finished()[0].success
    assert all(same(t[4:], want) for t, want in zip(kv.values(), stored, strict=True))


def test_a_slice_waits_for_a_running_slice_of_its_layers_into_its_blocks_only():
    layouts = build_group_layouts(
        kv_cache("blocks_first", num_layers=4, num_blocks=8, content=8), 1
    )

    def sliced(job_id: int, block_ids: list[int]) -> list:
        part = TransferPart(group=0, slot_ids=np.array([0, 1]), block_ids=np.array(block_ids))
        return slice_task(
            make_task(job_id, 0, False, part, layouts, 1, 4), layer_slices(LAYERS), layouts[0], 1
        )

    # both write block 5, a first
    a, b = sliced(1, [4, 5]), sliced(2, [5, 6])
    queue = TaskQueue()
    for task in a + b:
        queue.push(task)
    # while a's layer.0 slice copies, a's other slices may run beside it, but not b's layer.0 slice
    assert queue.pop_batch(64, 1 << 30) == a[:1]
    assert [queue.pop_batch(64, 1 << 30, a[:1]) for _ in range(4)] == [a[1:2], a[2:3], a[3:4], []]
    # once it ended, b's layer.0 slice runs beside a's others; b's layer.1 slice waits for a's
    assert queue.pop_batch(64, 1 << 30, a[1:]) == b[:1]
    assert queue.pop_batch(64, 1 << 30, a[1:] + b[:1]) == []


# a model tag: what a failed (maybe half-done) copy left; nothing to check
POISON = -1


class Model:
    """What blocks and slots hold if the jobs ran one by one in submission order: a tag per block
    (one content of all its layers) and per slot page; a failed job leaves its targets POISON."""

    def __init__(self, num_blocks: int, num_slots: int, bpc: int) -> None:
        # tag 0: zeros, the slab's first content
        self.block_tag = list(range(1, num_blocks + 1))
        self.slot_tags = [[0] * bpc for _ in range(num_slots)]

    def apply(self, job: TransferJob, ok: bool) -> None:
        part = job.parts[0]
        for c, (slot, chunk) in enumerate(
            zip(part.slot_ids, part.block_ids.reshape(len(part.slot_ids), -1), strict=True)
        ):
            if job.is_store:
                self.slot_tags[slot] = [self.block_tag[b] if ok else POISON for b in chunk]
                continue
            # a load's first chunk may skip
            for page in range(part.skip_blocks if c == 0 else 0, len(chunk)):
                self.block_tag[chunk[page]] = self.slot_tags[slot][page] if ok else POISON


class _Blocks:
    """The engine's KV blocks as the model tracks them: each block holds the bytes of one tag."""

    def __init__(self, kv: KV, model: Model, shape: tuple[int, ...]):
        self.kv = kv
        self.model = model
        self.base = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32)

    def content(self, tag: int) -> torch.Tensor:
        """A block's bytes (all layers) that carry `tag`."""
        return self.base * 0 if tag == 0 else self.base + tag

    def holds(self, block: int, tag: int) -> bool:
        return same(torch.stack([self.kv[layer][block] for layer in LAYERS]), self.content(tag))

    def write(self, block: int, tag: int) -> None:
        """The forward pass (re)computes a block."""
        for layer, t in zip(LAYERS, self.content(tag), strict=True):
            self.kv[layer][block] = t
        self.model.block_tag[block] = tag


def _random_job(rng, job_id: int, num_blocks: int, bpc: int) -> TransferJob:
    """A store or a load of 1-6 chunks anywhere: jobs of one step overlap."""
    n = int(rng.integers(1, 7))
    slots = rng.choice(8, n, replace=False)
    blocks = rng.choice(num_blocks, n * bpc, replace=False)
    if rng.random() < 0.4:
        return store_job(job_id, blocks, slots)
    return load_job(job_id, slots, blocks, skip_blocks=int(rng.integers(bpc)))


@pytest.mark.parametrize("seed", range(30))
def test_random_stores_and_sliced_loads_end_as_if_run_one_by_one_in_submission_order(seed):
    rng = np.random.default_rng(seed)
    bpc = 1 + seed % 2
    num_blocks = 24
    # 32 KiB pages
    kv = kv_cache("blocks_first", num_layers=4, num_blocks=num_blocks + bpc, content=1024)
    model = Model(num_blocks, num_slots=8, bpc=bpc)
    next_tag = num_blocks + 1
    blocks = _Blocks(kv, model, (4, *kv["layer.0"].shape[1:]))
    # the forward's order (not the names')
    order = list(rng.permutation(LAYERS))
    for block, tag in enumerate(model.block_tag):
        blocks.write(block, tag)
    job_id = 0
    with TransferEngine(kv, bpc, num_slots=8) as engine:
        for _step in range(6):
            jobs = []
            cancelled = set()
            for _ in range(int(rng.integers(2, 6))):
                job_id += 1
                jobs.append(_random_job(rng, job_id, num_blocks, bpc))
                sliced = jobs[-1].is_load and rng.random() < 0.7
                engine.submit(jobs[-1], layer_slices(order) if sliced else None)
                # past its deadline: a job of this step, maybe ended already
                if rng.random() < 0.15:
                    victim = int(rng.choice([job.job_id for job in jobs]))
                    cancelled.add(victim)
                    engine.cancel([victim])
            assert engine.wait([job.job_id for job in jobs], timeout=HANG_S)
            results = {r.job_id: r for r in engine.get_finished()}
            # all or nothing; failed only if cancelled, or cut short with one that was
            for job in jobs:
                result = results[job.job_id]
                assert result.failed_chunks in ((), tuple(range(job.num_chunks))), result
                assert (
                    result.success or job.job_id in cancelled or "cut short" in result.error
                ), result
                model.apply(job, result.success)
            for block, tag in enumerate(model.block_tag):
                assert tag == POISON or blocks.holds(block, tag), f"block {block} is not tag {tag}"
                # the engine recomputes it
                if tag == POISON:
                    next_tag += 1
                    blocks.write(block, next_tag)
        spare = list(range(num_blocks, num_blocks + bpc))
        # every slot, read back whole into the spare blocks
        for slot, tags in enumerate(model.slot_tags):
            job_id += 1
            engine.submit(load_job(job_id, [slot], spare))
            assert engine.wait([job_id], timeout=HANG_S) and engine.get_finished()[0].success
            held = [
                tag == POISON or blocks.holds(b, tag) for b, tag in zip(spare, tags, strict=True)
            ]
            assert all(held), slot


def layered_worker(clock=time.monotonic) -> tuple[WorkerSide, KV, list[torch.Tensor]]:
    """A worker whose slots 0-3 hold blocks 0-3 (returned per layer); every block zeroed."""
    kv = kv_cache("blocks_first", num_layers=4, num_blocks=8, content=8)
    worker = close_after_test(WorkerSide(num_slots=8, blocks_per_chunk=1, clock=clock))
    worker.register_kv_caches(kv)
    return worker, kv, fill_slots(worker.transfer, kv, [0, 1, 2, 3])


def start_load(
    worker: WorkerSide, job_id: int, deadline: float | None = None, layer_waits: bool = True
) -> StepPlan:
    """A step loading slots 0-3 into blocks 4-7, up to the forward pass."""
    part = TransferPart(group=0, slot_ids=np.arange(4), block_ids=np.arange(4, 8))
    deadline = time.monotonic() + 60 if deadline is None else deadline
    plan = StepPlan(
        load_jobs=[
            TransferJob(
                job_id=job_id,
                req_id="r",
                src=Endpoint.SLAB,
                dst=Endpoint.ENGINE,
                parts=(part,),
                deadline=deadline,
            )
        ]
    )
    worker.handle_preemptions(plan)
    worker.start_load_kv(plan, layer_waits=layer_waits)
    return plan


def forward(worker: WorkerSide, plan: StepPlan, asked: list[str]) -> None:
    """The rest of the step: a forward pass asking for the layers `asked`, in that order."""
    for layer in asked:
        worker.wait_for_layer_load(layer)
    worker.wait_for_save(plan)


def loaded(kv: KV, stored: list[torch.Tensor], layers: list[str] = LAYERS) -> bool:
    return all(same(kv[layer][4:], stored[LAYERS.index(layer)]) for layer in layers)


def load_whole(
    worker: WorkerSide,
    kv: KV,
    stored: list[torch.Tensor],
    held: HeldCopies,
    job_id: int,
    asked: list[str],
) -> None:
    """A step whose load must have ended when `start_load_kv` returned (held lets one batch copy:
    a whole load, not a sliced one), and whose pass asks for `asked`."""
    for t in kv.values():
        t[4:].zero_()
    held.hold_after(1)
    plan = start_load(worker, job_id)
    assert worker.transfer.wait([job_id], timeout=0) and loaded(
        kv, stored
    ), "start_load_kv did not wait for it"
    forward(worker, plan, asked)
    assert [r.success for r in worker.take_results()] == [True] and not worker.take_load_errors()


def test_loads_are_waited_for_whole_until_a_forward_pass_asked_for_every_layer(held):
    worker, kv, stored = layered_worker()
    # no forward pass seen yet
    load_whole(worker, kv, stored, held, 1, asked=[])
    # a pass that skipped layer.3 (no slices)
    load_whole(worker, kv, stored, held, 2, asked=LAYERS[:-1])
    # only from the next step on
    load_whole(worker, kv, stored, held, 3, asked=LAYERS)


def test_a_pass_that_will_not_ask_for_layers_loads_whole_and_slicing_goes_on(held):
    """vLLM replays a step as one FULL CUDA graph: no `wait_for_layer_load` comes, so the load is
    waited for whole inside `start_load_kv`, and the pass asking for no layer fails nothing."""
    worker, kv, stored = layered_worker()
    forward(worker, StepPlan(), asked=LAYERS)
    for t in kv.values():
        t[4:].zero_()
    held.hold_after(1)
    plan = start_load(worker, 1, layer_waits=False)
    assert worker.transfer.wait([1], timeout=0) and loaded(kv, stored), "not waited for whole"
    forward(worker, plan, asked=[])
    assert [r.success for r in worker.take_results()] == [True] and not worker.take_load_errors()
    # the next pass that asks for its layers is sliced again
    held.release()
    held.hold_after(1)
    plan = start_load(worker, 2)
    assert not worker.transfer.wait([2], timeout=0), "slicing stopped"
    held.release()
    forward(worker, plan, asked=LAYERS)
    assert [r.success for r in worker.take_results()] == [True] and not worker.take_load_errors()


def test_after_a_pass_that_asked_for_every_layer_each_layer_is_waited_for_alone(held):
    worker, kv, stored = layered_worker()
    # the engine's order: slices follow it
    order = ["layer.2", "layer.0", "layer.3", "layer.1"]
    forward(worker, StepPlan(), asked=order)
    # the first slice (layer.2) copies; the later ones are held
    held.hold_after(1)
    plan = start_load(worker, 2)
    assert not worker.transfer.wait([2], timeout=0), "start_load_kv waited for the whole load"
    worker.wait_for_layer_load("layer.2")
    assert loaded(kv, stored, ["layer.2"]) and not any(kv[layer][4:].any() for layer in order[1:])
    held.release()
    for layer in order[1:]:
        worker.wait_for_layer_load(layer)
        assert loaded(kv, stored, [layer]), f"{layer} not loaded when its attention may read it"
    worker.wait_for_save(plan)
    (result,) = worker.take_results()
    assert result.success and result.num_bytes == 4 * worker.transfer.slot_bytes
    assert not worker.take_load_errors()


def test_a_pass_that_skipped_a_layer_fails_its_layered_loads_whole_and_slicing_stops(held):
    worker, kv, stored = layered_worker()
    forward(worker, StepPlan(), asked=LAYERS)
    # layered; the pass read layer.2 without asking: maybe before its copy
    forward(worker, start_load(worker, 2), asked=["layer.0", "layer.1", "layer.3"])
    assert worker.take_load_errors() == {4, 5, 6, 7}
    (result,) = worker.take_results()
    assert result.failed_chunks == (0, 1, 2, 3) and "did not ask" in result.error
    # from now on loads are waited for whole, also after passes that ask for every layer
    load_whole(worker, kv, stored, held, 3, asked=LAYERS)
    load_whole(worker, kv, stored, held, 4, asked=LAYERS)


def test_a_layered_load_past_its_deadline_is_cancelled_while_its_layer_is_awaited(held):
    clock = FakeClock(now=0.0)
    worker, kv, _ = layered_worker(clock)
    forward(worker, StepPlan(), asked=LAYERS)
    # no slice copies, until cancelled
    held.hold_after(0)
    plan = start_load(worker, 2, deadline=1.0)
    clock.now = 2.0
    worker.wait_for_layer_load("layer.0")
    assert worker.transfer.wait([2], timeout=0), "the load still runs past its deadline"
    forward(worker, plan, asked=LAYERS[1:])
    assert worker.take_load_errors() == {4, 5, 6, 7}
    (result,) = worker.take_results()
    assert result.failed_chunks == (0, 1, 2, 3) and "cancelled" in result.error
    assert worker.take_stats()["cancelled_jobs"] == 1 and not any(t[4:].any() for t in kv.values())


def test_results_taken_before_wait_for_save_end_the_pass_first(held):
    # vLLM with speculative decoding (defer_finalize) takes the connector's results after the
    # target model's pass and before wait_for_save: a layered load whose pass skipped a layer
    # must already be reported failed there, never as loaded (helper-24's reproduction)
    worker, kv, stored = layered_worker()
    forward(worker, StepPlan(), asked=LAYERS)
    plan = start_load(worker, 2)
    # the pass read layer.2 without asking
    for layer in ["layer.0", "layer.1", "layer.3"]:
        worker.wait_for_layer_load(layer)
    assert worker.take_finished_loads() == (set(), set())
    assert worker.take_load_errors() == {4, 5, 6, 7}
    (result,) = worker.take_results()
    assert result.failed_chunks == (0, 1, 2, 3) and "did not ask" in result.error
    worker.wait_for_save(plan)
    assert not worker.take_results() and not worker.take_load_errors()
    load_whole(worker, kv, stored, held, 3, asked=LAYERS)


def test_a_load_cancelled_in_one_layers_wait_is_counted_once_while_another_still_copies(held):
    # two loads of one step with different deadlines: the one past it is cancelled in layer.0's
    # wait; in the later layers' waits it comes first again while the other still copies
    clock = FakeClock(now=0.0)
    kv = kv_cache("blocks_first", num_layers=4, num_blocks=8, content=8)
    # batches copy in queue order
    one_thread = functools.partial(TransferEngine, num_copy_threads=1)
    worker = close_after_test(
        WorkerSide(num_slots=8, blocks_per_chunk=1, clock=clock, transfer_factory=one_thread)
    )
    worker.register_kv_caches(kv)
    stored = fill_slots(worker.transfer, kv, [0, 1, 2, 3])
    forward(worker, StepPlan(), asked=LAYERS)

    def load(job_id: int, slots: list[int], deadline: float) -> TransferJob:
        part = TransferPart(group=0, slot_ids=np.array(slots), block_ids=np.array(slots) + 4)
        return TransferJob(
            job_id=job_id,
            req_id=f"r{job_id}",
            src=Endpoint.SLAB,
            dst=Endpoint.ENGINE,
            parts=(part,),
            deadline=deadline,
        )

    plan = StepPlan(load_jobs=[load(3, [0, 1], deadline=60.0), load(2, [2, 3], deadline=1.0)])
    # job 3's first slice (layer.0) copies; every later batch waits
    held.hold_after(1)
    worker.handle_preemptions(plan)
    worker.start_load_kv(plan)
    assert worker.transfer.wait_layer([3], "layer.0", timeout=HANG_S)
    # job 2 is past its deadline, job 3 is not
    clock.now = 2.0
    worker.wait_for_layer_load("layer.0")
    # job 3's later slices copy only after layer.1's wait began
    threading.Timer(0.2, held.release).start()
    forward(worker, plan, asked=LAYERS[1:])
    assert worker.take_load_errors() == {6, 7}
    results = {result.job_id: result for result in worker.take_results()}
    assert results[3].success and "cancelled" in results[2].error
    assert all(same(kv[layer][4:6], stored[i][:2]) for i, layer in enumerate(LAYERS))
    assert worker.take_stats()["cancelled_jobs"] == 1


# -- on CUDA: a slice per task, the compute stream waits for a layer's slices only ---------------
# (the CUDA backend itself is unverified: no GPU here; what it hands the GPU is checked on CPU)


def sliced_load(layout: str, slices: list[frozenset[str]]):
    """A load of chunks [3, 0] <- blocks (skipping the first), whole and cut into `slices`."""
    kv = kv_cache(layout, num_layers=4, num_blocks=8, content=8)
    layouts = build_group_layouts(kv, 2)
    part = TransferPart(
        group=0, slot_ids=np.array([3, 0]), block_ids=np.array([5, 6, 1, 2]), skip_blocks=1
    )
    whole = make_task(7, 0, False, part, layouts, 2, 4)
    return layouts, whole, slice_task(whole, slices, layouts[0], 2)


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first", "strided"])
def test_the_slices_address_arrays_are_the_whole_loads_cut_by_layer(layout):
    slices = layer_slices(LAYERS)
    layouts, whole, tasks = sliced_load(layout, slices)
    ptrs = plane_pointers(layouts)

    def runs(batch):
        pointers = copy_pointers(batch, layouts, ptrs, 1 << 40, layouts[0].chunk_bytes)
        return sorted(zip(*(column.tolist() for column in pointers), strict=True))

    # one task per slice, as the CUDA backend enqueues them; together exactly the whole load
    assert len(tasks) == len(slices)
    assert sorted(run for task in tasks for run in runs([task])) == runs([whole])
    assert sum(task.num_bytes for task in tasks) == whole.num_bytes


def test_a_layers_stream_wait_takes_only_the_slices_holding_it():
    slices = layer_slices(LAYERS)
    _, whole, tasks = sliced_load("kv_first", slices)
    # in flight: job 7's slices, a whole (unsliced) load of job 8, and another job's slice
    other = dataclasses.replace(tasks[1], job_id=9)
    unsliced = dataclasses.replace(whole, job_id=8)
    flights = [SimpleNamespace(task=task) for task in [*tasks, unsliced, other]]
    # layer.0 is the first slice alone: only it, for job 7
    assert [f.task for f in holding_layer(flights, {7}, "layer.0")] == [tasks[0]]
    # a later layer: its slice only, never another job's
    (holder,) = [t for t in tasks if "layer.2" in t.layers]
    assert [f.task for f in holding_layer(flights, {7}, "layer.2")] == [holder]
    # an unsliced load holds every layer
    (holder,) = [t for t in tasks if "layer.3" in t.layers]
    assert [f.task for f in holding_layer(flights, {7, 8}, "layer.3")] == [holder, unsliced]
