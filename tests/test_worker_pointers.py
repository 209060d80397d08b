"""The address arrays both copy paths consume (`copy_pointers`), checked byte-exactly on CPU,
and the CUDA backend's choice of copy path (selection only: no kernel runs here).

The CUDA backend hands these very arrays to vLLM's `swap_blocks_batch`; here they are copied
run by run with `ctypes.memmove` (and with the C copier the CPU path uses), and the bytes are
compared with what plain tensor indexing says a slot or block must hold.
"""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest
import torch

from helpers import HANG_S, load_job, store_job
from kvtier.jobs import TransferPart
from kvtier.worker import TransferEngine, build_group_layouts, cpu_copy
from kvtier.worker.cuda import CopyPaths, select_copy_paths
from kvtier.worker.memmove import MemmoveCopier
from kvtier.worker.pointers import copy_pointers, plane_pointers
from kvtier.worker.tasks import CopyTask, make_task

NUM_BLOCKS = 7
BLOCK_SIZE = 4
HEADS = 2
HEAD_DIM = 8
BLOCKS_PER_CHUNK = 2
NUM_SLOTS = 4
LAYERS = ("l0", "l1", "l2")
# two groups: l0 and l1 share slots of group 0, l2 alone in group 1
GROUPS = [["l0", "l1"], ["l2"]]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}


def _random_bytes(tensor: torch.Tensor) -> torch.Tensor:
    raw = tensor.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    return tensor


def make_caches(layout: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One KV tensor per layer, laid out as `layout`, filled with random bytes."""
    if layout == "kv_first":
        # vLLM's CUDA attention backends (FlashAttention): (2, num_blocks, block_size, heads, dim)
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
        return {name: _random_bytes(torch.empty(shape, dtype=dtype)) for name in LAYERS}
    if layout == "blocks_first":
        # vLLM 0.32 CPU: (num_blocks, heads, block_size, 2 * dim)
        shape = (NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
        return {name: _random_bytes(torch.empty(shape, dtype=dtype)) for name in LAYERS}
    # cross-layer: one allocation, blocks outside layers; layer i is a strided view of it
    base = _random_bytes(
        torch.empty(NUM_BLOCKS, len(LAYERS), 2, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=dtype)
    )
    return {name: base[:, i] for i, name in enumerate(LAYERS)}


def block_bytes(tensor: torch.Tensor, block: int, layout: str) -> list[torch.Tensor]:
    """Block `block` of one layer's tensor, as its K/V parts' bytes (what a slot holds of it)."""
    parts = [tensor[0], tensor[1]] if layout == "kv_first" else [tensor]
    return [part[block].contiguous().view(torch.uint8).flatten() for part in parts]


def expected_chunk(caches, layers, blocks, layout) -> torch.Tensor:
    """A slot's bytes: per layer, per K/V part, the chunk's pages back to back."""
    pieces = []
    for name in layers:
        per_block = [block_bytes(caches[name], b, layout) for b in blocks]
        for part in range(len(per_block[0])):
            pieces += [pages[part] for pages in per_block]
    return torch.cat(pieces)


def tasks_of(is_store, parts, layouts, job_id=1) -> list[CopyTask]:
    tasks = []
    for index, part in enumerate(parts):
        task = make_task(job_id, index, is_store, part, layouts, BLOCKS_PER_CHUNK, NUM_SLOTS)
        assert isinstance(task, CopyTask)
        tasks.append(task)
    return tasks


def memmove_runs(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
    for to, at, n in zip(dst.tolist(), src.tolist(), nbytes.tolist(), strict=True):
        ctypes.memmove(to, at, n)


def copier_runs(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
    copier = MemmoveCopier(2)
    try:
        copier.copy(dst, src, nbytes)
    finally:
        copier.close()


COPIES = {"memmove": memmove_runs, "copier": copier_runs}
# group 0: chunk [3, 4] (one run) -> slot 2, chunk [6, 0] (two runs) -> slot 0;
# group 1: chunk [1, 2] -> slot 3
STORE_PARTS = [
    TransferPart(group=0, slot_ids=np.array([2, 0]), block_ids=np.array([3, 4, 6, 0])),
    TransferPart(group=1, slot_ids=np.array([3]), block_ids=np.array([1, 2])),
]


def store_all(caches, layouts, slab, copy) -> None:
    tasks = tasks_of(True, STORE_PARTS, layouts)
    pointers = copy_pointers(
        tasks, layouts, plane_pointers(layouts), slab.data_ptr(), slab.shape[1]
    )
    assert pointers.dst.dtype == pointers.src.dtype == pointers.nbytes.dtype == np.int64
    copy(*pointers)


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["kv_first", "blocks_first", "cross_layer"])
def test_store_pointers_write_each_chunk_as_the_tensors_hold_it(layout, dtype, copy):
    caches = make_caches(layout, DTYPES[dtype])
    layouts = build_group_layouts(caches, BLOCKS_PER_CHUNK, GROUPS)
    slot_bytes = max(layout.chunk_bytes for layout in layouts)
    slab = torch.zeros(NUM_SLOTS, slot_bytes, dtype=torch.int8)
    # both groups' stores in one batch, as the CPU path batches them
    store_all(caches, layouts, slab, COPIES[copy])
    rows = slab.view(torch.uint8)
    # each slot holds its chunk's pages, layer by layer, K before V
    assert torch.equal(
        rows[2, : layouts[0].chunk_bytes], expected_chunk(caches, GROUPS[0], [3, 4], layout)
    )
    assert torch.equal(
        rows[0, : layouts[0].chunk_bytes], expected_chunk(caches, GROUPS[0], [6, 0], layout)
    )
    assert torch.equal(
        rows[3, : layouts[1].chunk_bytes], expected_chunk(caches, GROUPS[1], [1, 2], layout)
    )
    # the slot no chunk went to is untouched
    assert not rows[1].any()


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["kv_first", "blocks_first", "cross_layer"])
def test_load_pointers_restore_blocks_but_a_partial_chunks_head(layout, dtype, copy):
    source = make_caches(layout, DTYPES[dtype])
    layouts = build_group_layouts(source, BLOCKS_PER_CHUNK, GROUPS)
    slab = torch.zeros(NUM_SLOTS, max(g.chunk_bytes for g in layouts), dtype=torch.int8)
    store_all(source, layouts, slab, COPIES[copy])
    # a zeroed engine of the same layout
    target = make_caches(layout, DTYPES[dtype])
    for tensor in target.values():
        tensor.view(torch.uint8).zero_()
    target_layouts = build_group_layouts(target, BLOCKS_PER_CHUNK, GROUPS)
    # load slot 2 -> blocks [5, 1] skipping block 5 (the engine's own prefix cache), slot 0 ->
    # blocks [2, 3]; group 1: slot 3 -> blocks [6, 4]
    parts = [
        TransferPart(
            group=0, slot_ids=np.array([2, 0]), block_ids=np.array([5, 1, 2, 3]), skip_blocks=1
        ),
        TransferPart(group=1, slot_ids=np.array([3]), block_ids=np.array([6, 4])),
    ]
    tasks = tasks_of(False, parts, target_layouts)
    pointers = copy_pointers(
        tasks, target_layouts, plane_pointers(target_layouts), slab.data_ptr(), slab.shape[1]
    )
    COPIES[copy](*pointers)
    # block -> the source block whose bytes it must now hold
    moved = {0: {1: 4, 2: 6, 3: 0}, 1: {6: 1, 4: 2}}
    for group, layers in enumerate(GROUPS):
        for name in layers:
            for block in range(NUM_BLOCKS):
                got = block_bytes(target[name], block, layout)
                if block in moved[group]:
                    want = block_bytes(source[name], moved[group][block], layout)
                    assert all(map(torch.equal, got, want)), (name, block)
                else:
                    # skipped (5 in group 0) or never named: still zero
                    assert not any(part.any() for part in got), (name, block)


def test_the_cpu_backend_copies_with_copy_pointers(monkeypatch):
    calls = []
    real = cpu_copy.copy_pointers

    def recording(*args):
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(cpu_copy, "copy_pointers", recording)
    caches = make_caches("kv_first", torch.float16)
    with TransferEngine(caches, BLOCKS_PER_CHUNK, NUM_SLOTS) as engine:
        # store blocks [3, 4] -> slot 1, then load slot 1 -> blocks [0, 1]
        engine.submit(store_job(1, np.array([3, 4]), np.array([1])))
        assert engine.wait([1], timeout=HANG_S)
        engine.submit(load_job(2, np.array([1]), np.array([0, 1])))
        assert engine.wait([2], timeout=HANG_S)
        results = {r.job_id: r for r in engine.get_finished()}
    assert results[1].success and results[2].success
    # every batch went through the one function
    assert [task.job_id for batch in calls for task in batch] == [1, 2]
    for name in LAYERS:
        # compared as bytes: random bytes hold NaNs
        raw = caches[name].view(torch.uint8)
        assert torch.equal(raw[:, 0:2], raw[:, 3:5])


# -- which path the CUDA backend copies with (selection only) -----------------------------


def _fake_batch_copy(*args, **kwargs):
    raise AssertionError("selection only: no kernel runs in these tests")


def _fake_triton_copy(*args, bytes_per_chunk, **kwargs):
    raise AssertionError("selection only: no kernel runs in these tests")


@pytest.fixture
def small_layouts():
    # K or V pages of 4 tokens x 2 heads x 8 x 2 bytes = 128 bytes: small for vLLM's Triton rule
    return build_group_layouts(make_caches("kv_first", torch.float16), BLOCKS_PER_CHUNK, GROUPS)


def _install_vllm(monkeypatch, *, has_op: bool, has_triton: bool = False) -> None:
    """Stand-ins for the vLLM modules the selection imports (never called)."""
    ops = types.ModuleType("vllm._custom_ops")
    if has_op:
        ops.swap_blocks_batch = _fake_batch_copy
        # the compiled op vLLM's wrapper calls
        monkeypatch.setattr(
            torch.ops._C_cache_ops, "swap_blocks_batch", _fake_batch_copy, raising=False
        )
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", ops)
    utils = types.ModuleType("vllm.triton_utils")
    utils.HAS_TRITON = has_triton
    utils.triton = types.SimpleNamespace(next_power_of_2=lambda n: 1 << (n - 1).bit_length())
    monkeypatch.setitem(sys.modules, "vllm.triton_utils", utils)
    kernel = types.ModuleType("vllm.v1.kv_offload.cpu.swap_blocks_triton")
    kernel.THRESHOLD_BYTES = 28 * 1024
    kernel.swap_blocks_batch = _fake_triton_copy
    monkeypatch.setitem(sys.modules, "vllm.v1.kv_offload.cpu.swap_blocks_triton", kernel)


def test_a_vllm_without_swap_blocks_batch_falls_back_to_per_run_copies(monkeypatch, small_layouts):
    _install_vllm(monkeypatch, has_op=False, has_triton=True)
    paths = select_copy_paths(small_layouts, host_is_pinned=True)
    assert paths == CopyPaths(None, None)
    assert "per-run" in paths.description


def test_a_python_wrapper_without_its_compiled_op_falls_back_too(monkeypatch, small_layouts):
    # vLLM's _custom_ops imports without its CUDA extension: the op must be registered as well
    _install_vllm(monkeypatch, has_op=False)
    sys.modules["vllm._custom_ops"].swap_blocks_batch = _fake_batch_copy
    monkeypatch.delattr(torch.ops._C_cache_ops, "swap_blocks_batch", raising=False)
    assert select_copy_paths(small_layouts, host_is_pinned=True).store is None


def test_swap_blocks_batch_copies_both_ways_where_vllm_has_it(monkeypatch, small_layouts):
    _install_vllm(monkeypatch, has_op=True, has_triton=False)
    paths = select_copy_paths(small_layouts, host_is_pinned=True)
    assert paths.store is _fake_batch_copy
    assert paths.for_load(128) is _fake_batch_copy
    assert "swap_blocks_batch" in paths.description


def test_small_loads_take_triton_by_vllms_rule(monkeypatch, small_layouts):
    _install_vllm(monkeypatch, has_op=True, has_triton=True)
    paths = select_copy_paths(small_layouts, host_is_pinned=True)
    # stores never: GPU -> host is bandwidth-bound, the copy engine wins (vLLM's rule)
    assert paths.store is _fake_batch_copy
    # a load whose runs are all small: Triton, chunked at the next power of two of a page
    small = paths.for_load(512)
    assert small.func is _fake_triton_copy
    assert small.keywords == {"bytes_per_chunk": 128}
    # a load with a run at the threshold (consecutive blocks merged): the copy engine
    assert paths.for_load(28 * 1024) is _fake_batch_copy


def test_triton_needs_a_pinned_slab_and_small_pages(monkeypatch, small_layouts):
    _install_vllm(monkeypatch, has_op=True, has_triton=True)
    # Triton dereferences host pointers on the GPU: only pinned memory
    assert select_copy_paths(small_layouts, host_is_pinned=False).small_load is None
    # pages of 64 tokens x 2 heads x 128 x 2 bytes = 32 KiB: over the threshold
    big = {name: torch.zeros(2, NUM_BLOCKS, 64, HEADS, 128, dtype=torch.float16) for name in LAYERS}
    big_layouts = build_group_layouts(big, BLOCKS_PER_CHUNK, GROUPS)
    assert select_copy_paths(big_layouts, host_is_pinned=True).small_load is None
