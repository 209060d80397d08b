"""TransferEngine on CPU: byte-exact round trips, failures as results, ordering, shutdown."""

from __future__ import annotations

import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

import kvtier.worker.cpu_copy as cpu_copy
import kvtier.worker.memmove as memmove
from helpers import HANG_S, load_job, store_job
from kvtier.errors import ConfigError
from kvtier.worker import TransferEngine
from kvtier.worker.cuda import cuda_usable
from kvtier.worker.memmove import MemmoveCopier

HEADS, TOKENS = 2, 4


def random_kv(
    layout: str, num_layers: int, num_blocks: int, content: int
) -> dict[str, torch.Tensor]:
    """Float32 KV tensors full of random bit patterns (NaNs included: compare as int32)."""

    def bits(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32).view(torch.float32)

    # vLLM CPU
    if layout == "blocks_first":
        tensors = [bits(num_blocks, HEADS, TOKENS, content) for _ in range(num_layers)]
    elif layout == "kv_first":
        tensors = [bits(2, num_blocks, TOKENS, HEADS, content) for _ in range(num_layers)]
    # blocks outside layers: every layer's rows are strided
    else:
        buffer = bits(num_blocks, num_layers, HEADS, TOKENS, content)
        tensors = [buffer[:, i] for i in range(num_layers)]
    return {f"layer.{i}": t for i, t in enumerate(tensors)}


def block_bytes(
    kv: dict[str, torch.Tensor], layout: str, block_ids: list[int]
) -> list[torch.Tensor]:
    index = torch.tensor(block_ids)
    return [
        (t[:, index] if layout == "kv_first" else t[index]).view(torch.int32).clone()
        for t in kv.values()
    ]


def zero_all(kv: dict[str, torch.Tensor]) -> None:
    for t in kv.values():
        t.zero_()


@pytest.fixture(autouse=True, params=["native", "ctypes"])
def copy_path(request, monkeypatch):
    """Every test runs on both copy paths: the C helper, and the ctypes fallback used where
    it is not built."""
    if request.param == "native" and not memmove.native_copy_available():
        pytest.skip("C helper kvtier.worker._copyruns not built")
    if request.param == "ctypes":
        monkeypatch.setattr(memmove, "_copyruns", None)
    return request.param


class Gate(threading.Event):
    """Set to open; `reached` is set once a batch is held at it."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = threading.Event()


@pytest.fixture
def gate(monkeypatch):
    """Hold the copy path closed until `gate.set()`, so jobs pile up in the queue."""
    gate = Gate()
    original = MemmoveCopier.start

    def gated(self, *args):
        gate.reached.set()
        gate.wait(HANG_S)
        return original(self, *args)

    monkeypatch.setattr(MemmoveCopier, "start", gated)
    yield gate
    gate.set()


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first", "strided"])
@pytest.mark.parametrize("bpc", [1, 4])
# pages of 64 B, 1 KiB, 16 KiB
@pytest.mark.parametrize("content", [2, 32, 512])
def test_store_then_load_returns_every_byte(layout, bpc, content):
    kv = random_kv(layout, num_layers=3, num_blocks=48, content=content)
    rng = np.random.default_rng(content * bpc)
    # 5 chunks at random places; chunk 0 is a run of consecutive blocks, the rest scattered
    block_ids = np.concatenate([np.arange(bpc) + 40, rng.permutation(40)[: 4 * bpc]])
    slot_ids = np.array([4, 0, 6, 2, 5])
    expected = block_bytes(kv, layout, block_ids.tolist())
    with TransferEngine(kv, bpc, num_slots=8) as engine:
        engine.submit(store_job(1, block_ids, slot_ids))
        assert engine.wait([1], timeout=HANG_S)
        # zero the engine's KV, then load the chunks back into the same blocks
        zero_all(kv)
        engine.submit(load_job(2, slot_ids, block_ids))
        assert engine.wait([2], timeout=HANG_S)
        results = {r.job_id: r for r in engine.get_finished()}
    assert all(r.success and r.failed_chunks == () and r.error is None for r in results.values())
    chunk_bytes = bpc * sum(t.numel() * t.element_size() for t in kv.values()) // 48
    assert results[1].num_bytes == results[2].num_bytes == 5 * chunk_bytes
    assert results[1].seconds >= 0
    for want, got in zip(expected, block_bytes(kv, layout, block_ids.tolist()), strict=True):
        assert torch.equal(want, got)


def test_second_group_uses_its_own_layers():
    kv = random_kv("blocks_first", 3, 16, 8)
    groups = [["layer.0", "layer.1"], ["layer.2"]]
    expected = kv["layer.2"][[3, 4]].clone()
    with TransferEngine(kv, 2, 2, layer_groups=groups) as engine:
        engine.submit(store_job(1, [3, 4], [1], group=1))
        engine.wait([1], timeout=HANG_S)
        kv["layer.2"].zero_()
        engine.submit(load_job(2, [1], [9, 10], group=1))
        engine.wait([2], timeout=HANG_S)
        assert all(r.success for r in engine.get_finished())
    assert torch.equal(kv["layer.2"][[9, 10]].view(torch.int32), expected.view(torch.int32))


def test_out_of_range_ids_fail_their_chunk_and_the_engine_keeps_going():
    kv = random_kv("blocks_first", 2, 16, 8)
    expected = block_bytes(kv, "blocks_first", [0, 1, 4, 5])
    with TransferEngine(kv, 2, num_slots=4) as engine:
        # chunk 1 names block 99 (of 16), chunk 2 slot 7 (of 4), chunk 3 slot -1: only 0 and 4 copy
        engine.submit(store_job(1, [0, 1, 2, 99, 6, 7, 8, 9, 4, 5], [0, 1, 7, -1, 2]))
        # its only chunk is bad: the whole job fails
        engine.submit(store_job(2, [0, 1], [9]))
        engine.submit(load_job(3, [0, 2], [10, 11, 12, 13]))
        engine.wait([1, 2, 3], timeout=HANG_S)
        results = {r.job_id: r for r in engine.get_finished()}
    assert not results[1].success and results[1].failed_chunks == (1, 2, 3)
    assert "block id 99 out of range [0, 16)" in results[1].error
    assert "slot id 7 out of range [0, 4)" in results[1].error
    # the two good chunks
    assert results[1].num_bytes == 2 * 2 * 2 * HEADS * TOKENS * 8 * 4
    assert not results[2].success and results[2].failed_chunks == (0,) and results[2].num_bytes == 0
    # the later load finds both good chunks in their slots
    assert results[3].success
    got = block_bytes(kv, "blocks_first", [10, 11, 12, 13])
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


@pytest.mark.parametrize(
    ("block_ids", "slot_ids", "group", "message"),
    [
        ([0, 1, 2], [0, 1], 0, "3 block ids for 2 slots; need 2 per slot"),
        ([0, 1], [0], 5, "group 5 out of range"),
        ([0.5, 1.5], [0], 0, "must be a 1-D sequence of integers"),
        (None, [0], 0, "must be a 1-D sequence of integers"),
    ],
)
def test_malformed_jobs_fail_whole(block_ids, slot_ids, group, message):
    with TransferEngine(random_kv("blocks_first", 1, 8, 2), 2, 2) as engine:
        engine.submit(load_job(7, slot_ids, block_ids, group=group))
        (result,) = engine.get_finished()
    assert (result.job_id, result.success, result.num_bytes) == (7, False, 0)
    assert result.failed_chunks == tuple(range(len(slot_ids)))
    assert message in result.error


def test_writing_one_place_twice_fails_the_repeat_and_empty_jobs_succeed():
    with TransferEngine(random_kv("blocks_first", 1, 8, 2), 1, 4) as engine:
        # slot 3 written twice
        engine.submit(store_job(1, [0, 1, 2], [3, 3, 1]))
        # block 5 written twice
        engine.submit(load_job(2, [0, 1], [5, 5]))
        engine.submit(store_job(3, [], []))
        engine.wait([1, 2, 3], timeout=HANG_S)
        results = {r.job_id: r for r in engine.get_finished()}
    assert results[1].failed_chunks == (1,) and "written twice" in results[1].error
    assert results[2].failed_chunks == (1,)
    assert results[3].success and results[3].num_bytes == 0


def test_duplicate_job_id_in_flight_fails_the_new_job(gate):
    with TransferEngine(random_kv("blocks_first", 1, 8, 2), 1, 4) as engine:
        engine.submit(store_job(1, [0], [0]))
        # job 1 is still in flight
        engine.submit(store_job(1, [1], [1]))
        (refused,) = engine.get_finished()
        assert not refused.success and "already in flight" in refused.error
        gate.set()
        assert engine.wait([1], timeout=HANG_S)
        (done,) = engine.get_finished()
    assert done.success and done.job_id == 1


def test_wait_times_out_then_succeeds(gate):
    with TransferEngine(random_kv("blocks_first", 1, 8, 2), 1, 4) as engine:
        engine.submit(store_job(1, [0], [0]))
        assert engine.wait([1], timeout=0.05) is False
        gate.set()
        assert engine.wait([1], timeout=HANG_S) is True
        # unknown ids count as finished
        assert engine.wait([12345], timeout=0) is True


def test_an_exception_in_a_copy_fails_the_job_not_the_thread(monkeypatch):
    original = cpu_copy.copy_pointers
    calls = []

    def broken_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated shape mismatch")
        return original(*args)

    monkeypatch.setattr(cpu_copy, "copy_pointers", broken_once)
    with TransferEngine(random_kv("blocks_first", 1, 8, 2), 1, 4) as engine:
        engine.submit(store_job(1, [0, 1], [0, 1]))
        engine.wait([1], timeout=HANG_S)
        engine.submit(store_job(2, [2], [2]))
        engine.wait([2], timeout=HANG_S)
        results = {r.job_id: r for r in engine.get_finished()}
    assert not results[1].success and results[1].failed_chunks == (0, 1)
    assert "simulated shape mismatch" in results[1].error
    assert results[2].success


@pytest.mark.parametrize("held", [False, True])
def test_loads_see_the_store_they_depend_on_under_concurrency(held, gate):
    # store block i -> slot i % 2, then at once load slot i % 2 -> block 100 + i, 100 times:
    # each load must run after its store, and the store two steps later (same slot) after it
    kv = random_kv("blocks_first", 2, 200, 16)
    expected = block_bytes(kv, "blocks_first", list(range(100)))
    for t in kv.values():
        t[100:].zero_()
    if not held:
        gate.set()
    with TransferEngine(kv, 1, num_slots=2) as engine:
        for i in range(100):
            engine.submit(store_job(2 * i, [i], [i % 2]))
            engine.submit(load_job(2 * i + 1, [i % 2], [100 + i]))
        gate.set()
        assert engine.wait(range(200), timeout=HANG_S)
        assert all(r.success for r in engine.get_finished())
    got = block_bytes(kv, "blocks_first", list(range(100, 200)))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_a_load_into_a_block_waits_for_the_store_reading_it(gate):
    kv = random_kv("blocks_first", 1, 8, 16)
    old_block_5 = kv["layer.0"][5].view(torch.int32).clone()
    with TransferEngine(kv, 1, num_slots=2) as engine:
        # held at the gate: queued behind it...
        engine.submit(store_job(1, [6], [1]))
        # ...this store reads block 5
        engine.submit(store_job(2, [5], [0]))
        # loads are preferred, but this one overwrites block 5
        engine.submit(load_job(3, [1], [5]))
        gate.set()
        assert engine.wait([1, 2, 3], timeout=HANG_S)
    assert torch.equal(engine.slab[0].view(torch.int32).view(-1), old_block_5.view(-1))


def test_shutdown_with_jobs_in_flight_reports_each_job_once(gate):
    # other tests' tier threads may still be winding down
    before = set(threading.enumerate())
    engine = TransferEngine(random_kv("blocks_first", 1, 64, 16), 1, num_slots=64)
    engine.submit(store_job(0, [0], [0]))
    # job 0 is held mid-flight; the next 39 queue behind it
    assert gate.reached.wait(HANG_S)
    for i in range(1, 40):
        engine.submit(store_job(i, [i], [i]))

    # let the held batch go only once shutdown has begun: the queued jobs are failed, not run.
    # (Opened on a 0.1 s timer before, the gate could open first on a loaded machine.)
    def open_once_stopping() -> None:
        deadline = time.monotonic() + HANG_S
        while not engine._backend._stopping and time.monotonic() < deadline:
            time.sleep(0.001)
        gate.set()

    threading.Thread(target=open_once_stopping, daemon=True).start()
    engine.shutdown()
    results = engine.get_finished()
    assert sorted(r.job_id for r in results) == list(range(40))
    never_ran = [r for r in results if not r.success]
    assert len(never_ran) == 39 and all(
        "shut down before the job ran" in r.error for r in never_ran
    )
    # later calls neither raise nor hang
    engine.shutdown()
    engine.submit(load_job(99, [0], [0]))
    (late,) = engine.get_finished()
    assert not late.success and "shut down" in late.error
    assert engine.wait([99], timeout=HANG_S)
    started = set(threading.enumerate()) - before
    assert not [t.name for t in started if t.name.startswith("kvtier-") and t.is_alive()]


def test_slab_is_allocated_once_and_jobs_allocate_no_pages(monkeypatch):
    # 64 KiB
    page_bytes = HEADS * TOKENS * 2048 * 4
    kv = random_kv("blocks_first", 2, 64, 2048)
    engine = TransferEngine(kv, 2, num_slots=16)
    slab_ptr = engine.slab.data_ptr()
    allocations = []
    for name in ("empty", "zeros", "empty_like", "zeros_like", "ones", "full"):
        original = getattr(torch, name)
        monkeypatch.setattr(
            torch, name, lambda *a, _o=original, _n=name, **k: allocations.append(_n) or _o(*a, **k)
        )
    # the caller's objects: built before
    jobs = [
        job
        for i in range(20)
        for job in (
            store_job(
                2 * i,
                np.array([2 * (i % 16), 2 * (i % 16) + 1, 40, 41]),
                np.array([i % 8, 8 + i % 8]),
            ),
            load_job(2 * i + 1, np.array([i % 8]), np.array([50, 51])),
        )
    ]
    tracemalloc.start()
    try:
        for job in jobs:
            engine.submit(job)
        assert engine.wait(range(40), timeout=HANG_S)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        engine.shutdown()
    assert all(r.success for r in engine.get_finished())
    assert allocations == [] and engine.slab.data_ptr() == slab_ptr
    # bookkeeping only: nothing page-sized is allocated per job
    assert peak < page_bytes


def test_bad_arguments_are_config_errors():
    kv = random_kv("blocks_first", 1, 8, 2)
    with pytest.raises(ConfigError, match="blocks_per_chunk and num_slots must be >= 1"):
        TransferEngine(kv, 0, 4)
    with pytest.raises(ConfigError, match="kv_caches is empty"):
        TransferEngine({}, 1, 4)
    with (
        TransferEngine(kv, 1, 4) as engine,
        pytest.raises(ConfigError, match="job_id must be an int"),
    ):
        engine.submit(store_job("job-1", [0], [0]))


def test_cuda_path_imports_and_stays_off_without_a_gpu(copy_path):
    # the CUDA backend is unverified until it runs on a GPU; here it must simply not be chosen
    assert not cuda_usable(torch.device("cpu"))
    with TransferEngine(random_kv("blocks_first", 1, 8, 2), 1, 4) as engine:
        assert type(engine._backend).__name__ == "CpuBackend"
        assert engine._backend._copier.is_native == (copy_path == "native")
        assert not engine.slab.is_pinned()


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first", "strided"])
def test_a_load_can_skip_the_leading_blocks_of_its_first_chunk(layout):
    # chunks of 4 blocks; blocks 0 and 1 of the first chunk are the engine's own (local hits)
    kv = random_kv(layout, num_layers=2, num_blocks=16, content=32)
    with TransferEngine(kv, blocks_per_chunk=4, num_slots=4) as engine:
        engine.submit(store_job(1, list(range(8)), [2, 3]))
        assert engine.wait([1], timeout=HANG_S)
        expected = block_bytes(kv, layout, list(range(8)))
        zero_all(kv)
        # two loads in one batch, each skipping a different number of blocks
        engine.submit(load_job(2, [2, 3], list(range(8)), skip_blocks=2))
        engine.submit(load_job(3, [2], [8, 9, 10, 11], skip_blocks=1))
        assert engine.wait([2, 3], timeout=HANG_S)
        results = {r.job_id: r for r in engine.get_finished()}
        assert all(r.success for r in results.values())
        got = block_bytes(kv, layout, list(range(12)))
        page_bytes = engine.slot_bytes // 4
        assert results[2].num_bytes == 6 * page_bytes and results[3].num_bytes == 3 * page_bytes
        axis = 1 if layout == "kv_first" else 0

        def pick(t: torch.Tensor, ids: list[int]) -> torch.Tensor:
            return t.index_select(axis, torch.tensor(ids))

        for layer, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert not pick(g, [0, 1]).any(), f"layer {layer}: skipped blocks were written"
            assert torch.equal(pick(g, [2, 3, 4, 5, 6, 7]), pick(e, [2, 3, 4, 5, 6, 7]))
            assert not pick(g, [8]).any() and torch.equal(pick(g, [9, 10, 11]), pick(e, [1, 2, 3]))


def test_skip_blocks_is_validated():
    kv = random_kv("blocks_first", num_layers=1, num_blocks=8, content=2)
    with TransferEngine(kv, blocks_per_chunk=2, num_slots=2) as engine:
        # a whole chunk: not a partial one
        engine.submit(load_job(1, [0], [0, 1], skip_blocks=2))
        engine.wait([1], timeout=HANG_S)
        (result,) = engine.get_finished()
        assert not result.success and "skip_blocks=2" in result.error
