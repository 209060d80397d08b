"""Synchronous loads copied layer by layer, so that the forward pass starts before they end.

A synchronous load must be in the engine's blocks before the forward pass reads them; until
now the worker waited for all of it before the pass began. But each layer's attention reads
only that layer's KV, and vLLM asks the connector before each one (`wait_for_layer_load`). So
a load is cut into *slices* of layers, in the order the forward pass reaches them, each copied
and reported on its own (a batch of its own on the copy threads); layer `L`'s attention waits
only for the slices that hold `L`, and the copy of the later layers runs beside the compute of
the earlier ones. The first slice is one layer alone: the pass reaches its attention soonest.

Only where it is known to be safe:

- the order comes from the engine itself (`ForwardOrder`): the layers it asked for, in the
  order it asked, over one whole forward pass that asked for every layer the worker
  registered. Until such a pass was seen, loads are waited for whole, before the pass.
- A step whose pass did not ask for every slice it loaded (a layer read without asking)
  reports all of that step's layered loads failed: the engine recomputes those blocks, and
  layered loading stops (logged).
- On CUDA, each slice is a task on the load stream with its own end event, and
  `wait_for_layer_load` makes the compute stream wait for the events of the slices holding its
  layer (`CudaBackend.wait_layer_on_stream`) instead of blocking: UNVERIFIED on a GPU.

What it saves is the copy time of every slice but the first, as long as the compute of the
layers before a slice takes longer than the slice's copy: measured in `bench_overlap`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from kvtier.worker.layouts import GroupLayout
from kvtier.worker.tasks import CopyTask

__all__ = ["MAX_SLICES", "ForwardOrder", "layer_slices", "slice_task"]

# a slice is a batch on the copy threads (~0.1 ms of planning each); more buys little
MAX_SLICES = 8

logger = logging.getLogger(__name__)


def layer_slices(order: Sequence[str], max_slices: int = MAX_SLICES) -> list[frozenset[str]]:
    """`order`'s layers cut into at most `max_slices` runs, in order: the first layer alone, the
    rest in runs as even as they can be."""
    if not order:
        return []
    rest = list(order[1:])
    # (never fewer slices than it takes to hold every layer)
    num_rest = min(len(rest), max(1, max_slices - 1))
    runs = []
    if num_rest:
        parts = np.array_split(np.array(rest, dtype=object), num_rest)
        runs = [frozenset(part.tolist()) for part in parts]
    return [frozenset(order[:1]), *runs]


def slice_task(
    task: CopyTask, slices: Sequence[frozenset[str]], layout: GroupLayout, blocks_per_chunk: int
) -> list[CopyTask]:
    """`task` as one task per slice that holds layers of its group, in the slices' order (all
    of it again when no slice does). The chunks that failed validation are reported by the first."""
    plane_layers = [plane.layer for plane in layout.planes]
    pages = len(task.slot_ids) * blocks_per_chunk - task.skip_blocks
    nbytes = layout.plane_arrays[2]
    group_layers = set(layout.layers)
    out: list[CopyTask] = []
    for layers in slices:
        mine = layers & group_layers
        if not mine:
            continue
        planes = np.array(
            [i for i, layer in enumerate(plane_layers) if layer in mine], dtype=np.int64
        )
        first = not out
        memory = frozenset(layout.planes[i].storage.data_ptr() for i in planes)
        out.append(
            dataclasses.replace(
                task,
                layers=frozenset(mine),
                planes=planes,
                memory=memory,
                num_bytes=int(nbytes[planes].sum()) * pages,
                failed_chunks=task.failed_chunks if first else (),
                error=task.error if first else None,
            )
        )
    covered = set().union(*(t.layers for t in out)) if out else set()
    # a layer no slice holds: never left out, copy the task whole
    if covered != group_layers:
        return [task]
    return out


class ForwardOrder:
    """The layers the engine's forward pass asks for (`wait_for_layer_load`), in its order.

    `saw(layer)` on each ask; `step_ended()` after each pass. Once one pass asked for every
    registered layer, `slices` is that order cut by `layer_slices`; until then, and once turned
    off, None.
    """

    def __init__(self, layers: Sequence[str]) -> None:
        self._registered = frozenset(layers)
        # the layers this pass asked for, each once, in its order
        self._seen: dict[str, None] = {}
        self.slices: list[frozenset[str]] | None = None
        # no layers, or turned off after a pass that skipped some
        self.is_off = not self._registered

    def saw(self, layer: str) -> None:
        self._seen.setdefault(layer)

    def step_ended(self) -> bool:
        """After a forward pass: whether it asked for every registered layer (then, the first
        time, the slices are set from its order)."""
        asked_all = self._seen.keys() == self._registered
        if asked_all and self.slices is None and not self.is_off:
            self.slices = layer_slices(list(self._seen))
            logger.info(
                "kvtier: synchronous loads are copied layer by layer (%d slices of %d layers)",
                len(self.slices),
                len(self._seen),
            )
        self._seen = {}
        return asked_all

    def turn_off(self, why: str) -> None:
        if not self.is_off:
            logger.warning(
                "kvtier: layer-by-layer loading turned off: %s; loads are waited for whole", why
            )
        self.is_off = True
        self.slices = None
