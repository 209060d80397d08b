"""The namespace: everything that makes two engines' chunk bytes incompatible.

Two engines may read each other's chunks only if every field here is equal: the model,
the KV dtype, the layout of a chunk in the slab (layers, heads, page bytes per rank),
the block size, blocks per chunk, the block-hash algorithm, and the parallel layout
(world size; a chunk's payload holds every rank's shard, in rank order). Every
secondary tier puts `namespace.id_hex` in its paths or key names, and the 16-byte `id`
in each value's header, so a foreign value is never served; a disk tier also writes
`describe()` as `namespace.json` for people reading the directory.

Thread-safety: immutable.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Namespace"]


@dataclass(frozen=True, slots=True)
class Namespace:
    """Args: see the module docstring; `slot_bytes` is one rank's bytes of one chunk."""

    model: str
    dtype: str
    kv_layout: str
    block_size: int
    blocks_per_chunk: int
    hash_algo: str
    world_size: int
    slot_bytes: int
    extra: str = ""  # anything else an engine adapter knows to matter (e.g. group page sizes)

    @property
    def id(self) -> bytes:
        """16 bytes: sha256 of the canonical JSON of every field."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canonical).digest()[:16]

    @property
    def id_hex(self) -> str:
        return self.id.hex()

    @property
    def payload_bytes(self) -> int:
        """Bytes of one chunk across every rank."""
        return self.slot_bytes * self.world_size

    def describe(self) -> dict[str, Any]:
        """The fields, plus the id, for `namespace.json`."""
        return {"id": self.id_hex, **asdict(self)}
