"""How engine KV tensors and host slots are laid out, in bytes.

Every engine KV tensor is seen as one or more *planes*: a plane is a byte view
`(num_blocks, nbytes)` whose row `b` is one contiguous run of block `b`'s bytes.

- Block dimension first (vLLM 0.32 CPU: `(num_blocks, kv_heads, block_size, 2*head_size)`,
  also with permuted strides such as the CUDA default `LBNHC`): one plane per layer.
- K/V dimension first (`(2, num_blocks, block_size, kv_heads, head_size)`, older
  FlashAttention): two planes per layer, the K part and the V part of each block.
- Heads outside blocks (`LHBNC`): one plane per head. Blocks outside layers
  (`BLHNC`): one plane whose rows are spaced wider than they are long.

A slot of group `g` holds one chunk: for each plane of each layer of the group, in
order, `blocks_per_chunk` pages back to back. So a run of consecutive block ids is one
copy per plane, and a slot is one contiguous byte range a lower tier can write as is.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import ConfigError

__all__ = [
    "KV_LAYOUTS",
    "GroupLayout",
    "Plane",
    "build_group_layouts",
    "chunk_bytes",
    "flat_bytes",
    "kv_planes",
    "slot_bytes_of",
]

KV_LAYOUTS = ("auto", "blocks_first", "kv_first")


@dataclass(frozen=True, slots=True)
class Plane:
    """Rows of bytes, one per block, inside one engine tensor's storage.

    storage: a flat int8 view of the tensor's whole storage (shared, never copied).
    offset: byte offset of block 0's row; block `b`'s row starts at `offset + b * block_stride`.
    block_stride: bytes between the rows of consecutive blocks (>= nbytes).
    nbytes: bytes per row, i.e. this plane's share of one block (a "page").
    """

    layer: str
    storage: torch.Tensor
    offset: int
    block_stride: int
    nbytes: int
    num_blocks: int

    @property
    def is_dense(self) -> bool:
        """True when consecutive blocks' rows touch, so a run of blocks is one copy."""
        return self.block_stride == self.nbytes

    def view(self) -> torch.Tensor:
        """The plane as an int8 tensor `(num_blocks, nbytes)` sharing the engine's memory."""
        return self.storage.as_strided(
            (self.num_blocks, self.nbytes), (self.block_stride, 1), self.offset
        )


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Where each plane of one KV-cache group goes in a slot.

    slot_offsets[i]: byte offset in a slot of plane i's `blocks_per_chunk` pages.
    plane_table: the planes' numbers as one array, so a job's runs are computed for all
        planes at once.
    chunk_bytes: bytes of one chunk of this group (<= the engine's slot_bytes).
    """

    layers: tuple[str, ...]
    planes: tuple[Plane, ...]
    slot_offsets: tuple[int, ...]
    chunk_bytes: int
    num_blocks: int
    # int64 (4, num_planes): offset, block_stride, nbytes, slot offset
    plane_table: np.ndarray

    @property
    def is_dense(self) -> bool:
        """True when every plane copies runs of consecutive blocks at once."""
        return all(p.is_dense for p in self.planes)

    @property
    def plane_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """int64 arrays over planes: offset, block_stride, nbytes, slot offset (for vector maths)."""
        return self.plane_table[0], self.plane_table[1], self.plane_table[2], self.plane_table[3]


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D int8 view of `tensor`'s whole storage (no copy)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.int8, device=tensor.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def _describe(tensor: torch.Tensor) -> str:
    return f"shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}, dtype {tensor.dtype}"


def _block_dim(name: str, tensor: torch.Tensor, kv_layout: str) -> int:
    shape = tuple(tensor.shape)
    if kv_layout == "blocks_first":
        if not shape:
            raise ConfigError(f"KV cache {name!r} is a scalar; expected a block dimension first")
        return 0
    if kv_layout == "kv_first":
        if len(shape) < 2 or shape[0] != 2:
            raise ConfigError(
                f"KV cache {name!r} has {_describe(tensor)}; kv_layout='kv_first' expects (2, num_blocks, ...)"
            )
        return 1
    # auto: vLLM's K/V-first layouts are 5-D with a leading 2; block-first ones never lead with
    # a K/V axis of size 2 unless num_blocks is 2, which "auto" cannot tell apart.
    if len(shape) == 5 and shape[0] == 2:
        if shape[1] == 2:
            raise ConfigError(
                f"KV cache {name!r} has {_describe(tensor)}: block-first and K/V-first both fit; "
                "pass kv_layout='blocks_first' or 'kv_first'"
            )
        return 1
    if not shape:
        raise ConfigError(f"KV cache {name!r} is a scalar; expected a block dimension first")
    return 0


def _row_bytes(name: str, tensor: torch.Tensor, inner: list[tuple[int, int]]) -> int:
    """Bytes of one row: the dims inside the block dim must tile memory densely."""
    expected = tensor.element_size()
    for size, stride in sorted(inner, key=lambda d: d[1]):
        if stride != expected:
            raise ConfigError(
                f"KV cache {name!r} has {_describe(tensor)}: the dimensions inside a block are not dense "
                f"in memory, so a block is not a set of contiguous byte runs; register an unsliced cache tensor"
            )
        expected *= size
    return expected


def _check_no_overlap(
    name: str, tensor: torch.Tensor, row_bytes: int, rows: list[tuple[int, int]]
) -> None:
    extent = row_bytes
    for size, stride in sorted(rows, key=lambda d: d[1]):
        if stride < extent:
            raise ConfigError(
                f"KV cache {name!r} has {_describe(tensor)}: blocks overlap in memory"
            )
        extent += (size - 1) * stride


def kv_planes(name: str, tensor: torch.Tensor, kv_layout: str = "auto") -> list[Plane]:
    """Split one engine KV tensor into planes, without copying.

    Args:
        name: the layer name (for messages).
        tensor: the engine's KV cache of that layer, any dtype, strided.
        kv_layout: "auto", "blocks_first" or "kv_first" (which dimension indexes blocks).
    Returns:
        The planes, in the tensor's logical order of the dimensions outside the block dim.
    Raises:
        ConfigError: the layout is unknown or the bytes of a block cannot be viewed as runs.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ConfigError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if tensor.layout != torch.strided:
        raise ConfigError(f"KV cache {name!r} must be a strided tensor, got layout {tensor.layout}")
    bdim = _block_dim(name, tensor, kv_layout)
    esize = tensor.element_size()
    num_blocks = tensor.shape[bdim]
    block_stride = tensor.stride(bdim) * esize
    nbytes = {
        i: tensor.stride(i) * esize
        for i in range(tensor.dim())
        if i != bdim and tensor.shape[i] > 1
    }
    # Dims with a smaller stride than the block dim live inside a block's row; the others
    # (K/V, or heads in LHBNC) enumerate planes. With one block every dim is inside.
    inner = [i for i in nbytes if nbytes[i] < block_stride or num_blocks == 1]
    outer = [i for i in nbytes if i not in inner]
    row_bytes = _row_bytes(name, tensor, [(tensor.shape[i], nbytes[i]) for i in inner])
    rows = [(num_blocks, block_stride)] + [(tensor.shape[i], nbytes[i]) for i in outer]
    _check_no_overlap(name, tensor, row_bytes, rows)
    storage = flat_bytes(tensor)
    base = tensor.storage_offset() * esize
    stride = block_stride if num_blocks > 1 else row_bytes
    planes = []
    for index in itertools.product(*(range(tensor.shape[i]) for i in outer)):
        offset = base + sum(k * nbytes[i] for k, i in zip(index, outer, strict=True))
        planes.append(Plane(name, storage, offset, stride, row_bytes, num_blocks))
    return planes


def _check_groups(
    kv_caches: Mapping[str, torch.Tensor], layer_groups: Sequence[Sequence[str]]
) -> None:
    grouped = [name for group in layer_groups for name in group]
    if not layer_groups or any(len(group) == 0 for group in layer_groups):
        raise ConfigError("layer_groups must list at least one layer per group")
    unknown = sorted(set(grouped) - set(kv_caches))
    if unknown:
        raise ConfigError(f"layer_groups names layers with no KV cache: {unknown}")
    for group in layer_groups:
        if len(set(group)) != len(group):
            raise ConfigError(f"a layer appears twice in the group {list(group)}")
    missing = sorted(set(kv_caches) - set(grouped))
    if missing:
        raise ConfigError(
            f"KV caches {missing} belong to no group in layer_groups; every registered layer must"
        )


def build_group_layouts(
    kv_caches: Mapping[str, torch.Tensor],
    blocks_per_chunk: int,
    layer_groups: Sequence[Sequence[str]] | None = None,
    kv_layout: str = "auto",
) -> list[GroupLayout]:
    """Validate the engine's KV tensors and lay out one slot per group.

    Args:
        kv_caches: layer name -> KV tensor, as the engine registers them.
        blocks_per_chunk: pages of each plane per slot.
        layer_groups: the layers of each KV-cache group; None puts every layer in group 0.
        kv_layout: see `kv_planes`.
    Returns:
        One `GroupLayout` per group.
    Raises:
        ConfigError: empty caches, unknown layers, mixed devices, unequal block counts in a
            group, or a tensor whose blocks are not byte runs.
    """
    if not kv_caches:
        raise ConfigError("kv_caches is empty; register at least one layer's KV tensor")
    devices = {t.device for t in kv_caches.values()}
    if len(devices) != 1:
        raise ConfigError(f"all KV caches must be on one device, got {sorted(map(str, devices))}")
    groups = [list(kv_caches)] if layer_groups is None else [list(g) for g in layer_groups]
    _check_groups(kv_caches, groups)
    layouts = []
    for gid, group in enumerate(groups):
        planes = [p for name in group for p in kv_planes(name, kv_caches[name], kv_layout)]
        counts = {p.num_blocks for p in planes}
        if len(counts) != 1:
            raise ConfigError(f"layers of group {gid} have different block counts {sorted(counts)}")
        sizes = [blocks_per_chunk * p.nbytes for p in planes]
        offsets = tuple(itertools.accumulate(sizes, initial=0))
        table = np.array([[p.offset, p.block_stride, p.nbytes] for p in planes], dtype=np.int64).T
        table = np.vstack([table, np.array(offsets[:-1], dtype=np.int64)])
        size = chunk_bytes(blocks_per_chunk, [p.nbytes for p in planes])
        layouts.append(
            GroupLayout(tuple(group), tuple(planes), offsets[:-1], size, counts.pop(), table)
        )
    return layouts


def chunk_bytes(blocks_per_chunk: int, page_bytes: Sequence[int]) -> int:
    """Bytes of one chunk of a group: `blocks_per_chunk` pages of each of its planes, back to back.

    The one slot-size formula: the workers apply it to the planes they measured in the engine's
    tensors, the vLLM adapter (`kvtier.integrations.vllm.layout`) to the pages vLLM's KV-cache
    spec declares (a layer's planes together are one page); the host slab's size check
    catches a difference.
    """
    return blocks_per_chunk * sum(page_bytes)


def slot_bytes_of(layouts: Sequence[GroupLayout]) -> int:
    """Bytes of one slot: the largest chunk of any group."""
    return max(g.chunk_bytes for g in layouts)
