"""Names and values of one namespace in a shared remote store.

- **Names**: `<prefix><sep><namespace id hex><sep><key hex>`. Engines of another namespace
  (model, dtype, layout, …) use another middle part, so they never read these bytes.
- **Keyed mode**: with a deployment secret, the key part is HMAC-SHA256(secret, namespace id +
  key) instead of the key itself, in the name and in the value's header. vLLM's block hashes
  are a public function of the prompt, so without it anyone who can list the store can hash a
  guessed prompt and test whether it was served; with it, names are unpredictable without the
  secret (and a store without the secret cannot be read by an engine that has it, or back).
- **Values**: `ValueHeader` (see `kvtier.tiers.secondary`) + the payload (every rank's buffer,
  back to back). A load receives the header into a buffer of its own and the payload straight
  into the slab rows; `check` then verifies length, header, namespace, key, payload length and
  checksum, and a value that fails any of them is refused (its slot was never readable).

Thread-safety: immutable; every method may be called from any thread.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from kvtier.keys import OffloadKey
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.secondary import HEADER_BYTES, ValueHeader, checksum

__all__ = ["ValueCodec"]

_MAX_KEY_BYTES = 64  # what a ValueHeader holds


class ValueCodec:
    """Args:
        namespace: what the bytes mean.
        prefix: the first part of every name (e.g. "kvtier").
        separator: between the parts (":" for Redis, "/" for S3).
        key_secret: the deployment secret of the keyed mode (None: plain names).
    """

    def __init__(self, namespace: Namespace, prefix: str, separator: str, key_secret: bytes | None = None):
        self.namespace_id = namespace.id
        self.payload_bytes = namespace.payload_bytes
        self.value_bytes = HEADER_BYTES + self.payload_bytes
        self.name_prefix = f"{prefix}{separator}{namespace.id_hex}{separator}"
        self.is_keyed = key_secret is not None
        self._secret = key_secret

    def stored_key(self, key: OffloadKey) -> bytes:
        """The key as the store sees it (in the name and the header)."""
        if self._secret is None:
            return key
        return hmac.new(self._secret, self.namespace_id + key, hashlib.sha256).digest()

    def name(self, key: OffloadKey) -> str:
        return self.name_prefix + self.stored_key(key).hex()

    def fits(self, key: OffloadKey, buffers: Sequence[memoryview]) -> bool:
        """Whether a job's chunk can be stored: a key a header holds and a whole payload."""
        return (self.is_keyed or len(key) <= _MAX_KEY_BYTES) and sum(b.nbytes for b in buffers) == self.payload_bytes

    def pack(self, key: OffloadKey, buffers: Sequence[memoryview]) -> list[bytes | memoryview]:
        """The value's parts: the header (with the payload's checksum), then the buffers."""
        header = ValueHeader(self.namespace_id, self.stored_key(key), self.payload_bytes, checksum(buffers))
        return [header.pack(), *buffers]

    def header_buffer(self) -> memoryview:
        """Room for a value's header, received before its payload (see `check`)."""
        return memoryview(bytearray(HEADER_BYTES))

    def check(self, key: OffloadKey, size: int, header: memoryview, payload: Sequence[memoryview]) -> str | None:
        """Why a value of `size` bytes received into `header` + `payload` must be refused, or None.

        The payload buffers are only trusted once this returns None: until then they hold
        bytes nobody may read (a PENDING slot)."""
        if size != self.value_bytes:
            return f"{size} bytes, expected {self.value_bytes}"
        unpacked = ValueHeader.unpack(header)
        if isinstance(unpacked, str):
            return unpacked
        if (why := unpacked.mismatch(self.namespace_id, self.stored_key(key), self.payload_bytes)) is not None:
            return why
        if checksum(payload) != unpacked.payload_checksum:
            return "payload checksum mismatch"
        return None
