"""The namespace: everything that makes two engines' chunk bytes incompatible — and nothing else.

Two engines may read each other's chunks only if every field here is equal:

- `model`: what the model is (for vLLM its architectures), readable;
- `engine`: a digest of what the engine itself hashes for its computation graph, cut to the
  parts that change a KV byte (for vLLM: the model config with quantization, dtype and the
  `hf_overrides` applied to it, the KV-cache config, the attention config, the engine version);
- `weights`: the identity of the weight files' *content*, not their path;
- `dtype`, `kv_layout` (a chunk's layout in the slab: device, groups, layers, page bytes),
  `block_size`, `blocks_per_chunk`, `hash_algo` (the block-hash algorithm), and the parallel
  layout (`world_size`, `extra`; a chunk's payload holds every rank's shard, in rank order).

What only differs between replicas of one deployment is left out on purpose, so replicas on
other hosts share a tier: paths, ports, ranks, devices, and kvtier's own settings (RAM, tiers,
policies). `label` is for people (the name the engine knows the model by) and is not part of
the id: replicas at other paths share the namespace, and `namespace.json` names whichever
opened it last.

Every secondary tier puts `id_hex` in its paths or key names, and the 16-byte `id` in each
value's header, so a foreign value is never served; a disk tier also writes `describe()` as
`namespace.json` for people reading the directory. Changing what goes into the id (as issue #20
did, adding `engine`, `weights` and `label`) is a format change only in that caches written
before become misses: their values stay under the old id, never read, until they expire or are
removed (a disk tier's old namespace directory by hand); nothing is ever read across ids.

Thread-safety: immutable.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
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
    # anything else an engine adapter knows to matter (e.g. the parallel layout)
    extra: str = ""
    # digest of the engine-side factors that change KV bytes
    engine: str = ""
    # identity of the weight files' content
    weights: str = ""
    # for people; not part of the id
    label: str = field(default="", compare=False)

    @property
    def id(self) -> bytes:
        """16 bytes: sha256 of the canonical JSON of every field but `label`."""
        fields = asdict(self)
        del fields["label"]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
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
