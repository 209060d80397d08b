"""The worker side of kvtier: moving KV bytes between engine tensors and the host slab.

- `side`: `WorkerSide`, the worker half of the scheduler protocol: runs each step's plan
  (flushes, loads, stores) on a `TransferEngine`, enforces job deadlines, reports results.
- `transfer`: `TransferEngine`, which runs `kvtier.jobs.TransferJob`s and reports each once.
- `tasks`: a job's parts as validated copy tasks, and the byte runs each one copies.
- `pointers`: a batch's byte runs as (dst, src, nbytes) address arrays, for either copy path.
- `layouts`: engine KV tensors as planes of byte pages; where each goes in a slot.
- `queue`: the order tasks run in (loads first unless they conflict with a store).
- `cpu_copy`: the CPU path (a planning thread batches; `memmove` copies without the GIL).
- `cuda`: the CUDA path (vLLM's `swap_blocks_batch`, pinned slab, streams, events); unverified
  on a GPU so far.
"""

from kvtier.worker.layouts import GroupLayout, Plane, build_group_layouts, kv_planes
from kvtier.worker.side import WorkerSide
from kvtier.worker.transfer import TransferEngine

__all__ = [
    "GroupLayout",
    "Plane",
    "TransferEngine",
    "WorkerSide",
    "build_group_layouts",
    "kv_planes",
]
