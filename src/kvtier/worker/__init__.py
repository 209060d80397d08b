"""The worker side of kvtier: moving KV bytes between engine tensors and the host slab.

- `layouts`: engine KV tensors as planes of byte pages; where each goes in a slot.
- `jobs`: validation of submissions and the byte runs of a job.
- `queue`: the order jobs run in (loads first unless they conflict with a store).
- `cpu_copy`: the CPU path (a job thread plans batches; `memmove` copies them without the GIL).
- `cuda`: the CUDA path (pinned slab, streams, events); unverified on a GPU so far.
- `transfer`: `TransferEngine`, the one class the connector uses.
"""

from kvtier.worker.jobs import TransferResult
from kvtier.worker.layouts import GroupLayout, Plane, build_group_layouts, kv_planes
from kvtier.worker.transfer import TransferEngine

__all__ = ["GroupLayout", "Plane", "TransferEngine", "TransferResult", "build_group_layouts", "kv_planes"]
