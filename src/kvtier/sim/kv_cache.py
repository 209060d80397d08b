"""The fake engine's KV cache: real CPU tensors whose blocks hold a value that names their KV.

There are `num_layers` tensors of shape `(num_blocks, block_size, 2)` int64 (block dimension
first, like vLLM's CPU layout), and layer l of every KV-cache group is the same tensor: as in
vLLM's hybrid KV cache, a block id names the same memory in every group, and the block pool
hands each id to one group at a time. Computing block j of a request writes, in
every element of the block's row of layer l, `content(block_hash_j, group) + l`. Reading
checks the same value, so a block that holds another prefix's KV, another group's, another
layer's, or nothing, is caught — whoever moved the bytes (the real `TransferEngine`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["ContentMismatch", "KVCache"]


class ContentMismatch(AssertionError):
    """A block held other KV than the tokens it stands for (a correctness bug)."""


class KVCache:
    """`num_groups` x `num_layers` tensors of `num_blocks` blocks."""

    def __init__(self, num_groups: int, num_blocks: int, block_size: int, num_layers: int = 2):
        shared = [
            torch.zeros((num_blocks, block_size, 2), dtype=torch.int64) for _ in range(num_layers)
        ]
        self.tensors = {
            f"g{g}.l{layer}": shared[layer]
            for g in range(num_groups)
            for layer in range(num_layers)
        }
        self.layer_groups = [
            [f"g{g}.l{layer}" for layer in range(num_layers)] for g in range(num_groups)
        ]
        # views: numpy indexing costs less
        self._arrays = {name: t.numpy() for name, t in self.tensors.items()}
        # content -> what it stands for
        self._names: dict[int, str] = {0: "nothing (never written)"}
        # (block hash, group) -> content, computed once
        self._values: dict[tuple[bytes, int], int] = {}

    def content(self, block_hash: bytes, group: int) -> int:
        value = self._values.get((block_hash, group))
        if value is None:
            value = int.from_bytes(
                hashlib.blake2b(block_hash + group.to_bytes(4, "big"), digest_size=7).digest(),
                "big",
            )
            self._values[block_hash, group] = value
            self._names.setdefault(value, f"block hash {block_hash.hex()[:12]}… of group {group}")
        return value

    def write(self, group: int, block_ids: Sequence[int], contents: Sequence[int]) -> None:
        if block_ids:
            index = np.asarray(block_ids, dtype=np.int64)
            values = np.asarray(contents, dtype=np.int64)
            for layer, name in enumerate(self.layer_groups[group]):
                self._arrays[name][index] = (values + layer)[:, None, None]

    def check_unwritten(self, block_id: int, what: str) -> None:
        """Raise `ContentMismatch` if block `block_id` of any group was ever written (the null block)."""
        for name, array in self._arrays.items():
            if array[block_id].any():
                raise ContentMismatch(
                    f"{what}: block {block_id} ({name}) was written; nothing may write it"
                )

    def check(
        self,
        req_id: str,
        group: int,
        positions: Sequence[int],
        block_ids: Sequence[int],
        contents: Sequence[int],
    ) -> None:
        """Raise `ContentMismatch` unless block `block_ids[i]` holds `contents[i]` in every layer."""
        if not block_ids:
            return
        index = np.asarray(block_ids, dtype=np.int64)
        values = np.asarray(contents, dtype=np.int64)
        for layer, name in enumerate(self.layer_groups[group]):
            rows = self._arrays[name][index].reshape(len(index), -1)
            bad = np.flatnonzero((rows != (values + layer)[:, None]).any(axis=1))
            if len(bad):
                i = int(bad[0])
                got = int(rows[i, 0]) - layer
                raise ContentMismatch(
                    f"{req_id}: block {positions[i]} of group {group} (engine block {block_ids[i]}, layer {layer}) "
                    f"holds the KV of {self._names.get(got, f'unknown value {got}')}, "
                    f"expected {self._names[contents[i]]}"
                )
