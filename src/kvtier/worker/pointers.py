"""A batch of copy tasks as three address arrays: what both copy paths consume.

`copy_pointers` turns the byte runs of `plan_copies` into `(dst, src, nbytes)`, int64 arrays of
absolute addresses and lengths, one entry per run. The CPU path hands them to the C copier
(`MemmoveCopier`, i.e. `_copyruns`); the CUDA path hands the same arrays, as CPU int64 tensors,
to vLLM's `swap_blocks_batch` (one driver call per task). So the byte-exact CPU tests check the
very arrays a GPU copies from and to.

An engine address is its plane's storage pointer (device memory on CUDA) plus the run's engine
offset; a slab address is the slab's base pointer (host memory) plus the run's slab offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvtier.worker.layouts import GroupLayout
from kvtier.worker.tasks import CopyTask, plan_copies

__all__ = ["CopyPointers", "copy_pointers", "plane_pointers"]


class CopyPointers(NamedTuple):
    """Run i copies `nbytes[i]` bytes from address `src[i]` to address `dst[i]` (all int64)."""

    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray


def plane_pointers(layouts: Sequence[GroupLayout]) -> list[np.ndarray]:
    """Per group, the base address of each plane's storage (int64), in plane order."""
    return [
        np.array([plane.storage.data_ptr() for plane in layout.planes], dtype=np.int64)
        for layout in layouts
    ]


def copy_pointers(
    batch: Sequence[CopyTask],
    layouts: Sequence[GroupLayout],
    plane_ptrs: Sequence[np.ndarray],
    slab_ptr: int,
    slot_bytes: int,
) -> CopyPointers:
    """The runs of every task of `batch`, planned once per (direction, group, layer slice).

    Args:
        batch: validated tasks (`make_task`), possibly of both directions and several groups.
        layouts: the engine's group layouts; plane_ptrs: `plane_pointers(layouts)`.
        slab_ptr: address of the slab's first byte; slot_bytes: bytes per slot.
    Returns:
        The runs' destinations, sources and lengths: a store copies engine -> slab, a load
        slab -> engine.
    """
    parts = []
    # dict, not set: the same batch always yields its runs in the same order
    keys = dict.fromkeys((task.is_store, task.group, task.layers) for task in batch)
    for is_store, group, layers in keys:
        tasks = [
            task
            for task in batch
            if (task.is_store, task.group, task.layers) == (is_store, group, layers)
        ]
        runs = plan_copies(
            np.concatenate([task.block_ids for task in tasks]),
            np.concatenate([task.slot_ids for task in tasks]),
            layouts[group],
            slot_bytes,
            np.concatenate([task.first_pages() for task in tasks]),
            tasks[0].planes,
        )
        engine = plane_ptrs[group][runs.plane] + runs.engine_offset
        slab = slab_ptr + runs.slab_offset
        if is_store:
            parts.append(CopyPointers(slab, engine, runs.nbytes))
        else:
            parts.append(CopyPointers(engine, slab, runs.nbytes))
    if len(parts) == 1:
        return parts[0]
    return CopyPointers(*(np.concatenate(column) for column in zip(*parts, strict=True)))
