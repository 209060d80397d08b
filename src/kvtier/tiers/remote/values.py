"""Names and values of one namespace in a shared remote store.

- **Names**: `<prefix><sep><namespace id hex><sep><key hex>`. Engines of another namespace
  (model, dtype, layout, …) use another middle part, so they never read these bytes. On a
  store that cannot list, the namespace's epoch comes before the key part
  (`<prefix><sep><namespace id hex><sep><epoch><sep><key hex>`, `use_epoch`), and the epoch
  record is `<prefix><sep><namespace id hex><sep>epoch` (`epoch_name`; see
  `kvtier.tiers.remote.reset`).
- **Values**: `ValueHeader` (see `kvtier.tiers.secondary`) + the payload (every rank's buffer,
  back to back), the format of the disk tier's files too. A load receives the header into a
  buffer of its own and the payload straight into the slab rows (`IncomingValue`), hashing
  each piece as the store writes it (still in cache, while the next piece is on its way);
  `check` then verifies length, header, namespace, key, payload length and checksum (or tag),
  and a value that fails any of them is refused (its slot was never readable). A store that
  does not report its pieces leaves the digest to `check`, which then hashes the buffers.
- **Keyed mode** (a deployment secret). Names: the key part is HMAC-SHA256(secret, namespace id
  + key) instead of the key itself, in the name and in the header. vLLM's block hashes are a
  public function of the prompt, so without it anyone who can list the store can hash a guessed
  prompt and test whether it was served. Values: a 32-byte tag follows the payload, keyed
  BLAKE3 of header + payload under a MAC key derived from the secret (BLAKE3's key derivation,
  its own context: never the key of the names' HMAC). The xxh3 checksum is unkeyed, so without
  the tag whoever can write the store could put any payload under a listed name with a header
  made valid for it, and every reader would serve it; with it, such a value (or a valid one
  copied under another name: the header names the key) is a counted miss. The tag is checked
  instead of the checksum, which it subsumes. Keyed BLAKE3 measured 3.7-4.0 GB/s on 1-4 MiB
  payloads here, keyed BLAKE2b (hashlib) 0.38, HMAC-SHA256 0.9-1.0, xxh3 16-25.

What neither mode protects against: whoever holds the secret, and deletion (a writer of the
store can always delete or evict values: a miss, never wrong bytes). A value replayed under its
own name (an older valid one) passes: it holds the same key's KV of the same namespace.

Thread-safety: immutable but for `use_epoch`, which a reset's sweep calls while no job runs;
every method may be called from any thread.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import xxhash
from blake3 import blake3

from kvtier.keys import OffloadKey
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.secondary import HEADER_BYTES, ValueHeader, checksum

__all__ = ["TAG_BYTES", "IncomingValue", "ValueCodec"]

# what a ValueHeader holds
_MAX_KEY_BYTES = 64
# keyed mode's trailer
TAG_BYTES = 32
# BLAKE3 key derivation: a fixed, unique context
_MAC_CONTEXT = "kvtier 2025-06 remote value tag v1"


class ValueCodec:
    """Args:
    namespace: what the bytes mean.
    prefix: the first part of every name (e.g. "kvtier").
    separator: between the parts (":" for Redis, "/" for S3).
    key_secret: the deployment secret of the keyed mode (None: plain names, no tag).
    """

    def __init__(
        self, namespace: Namespace, prefix: str, separator: str, key_secret: bytes | None = None
    ):
        self.namespace_id = namespace.id
        self.payload_bytes = namespace.payload_bytes
        self.is_keyed = key_secret is not None
        self.tag_bytes = TAG_BYTES if self.is_keyed else 0
        self.value_bytes = HEADER_BYTES + self.payload_bytes + self.tag_bytes
        self._separator = separator
        self._namespace_prefix = f"{prefix}{separator}{namespace.id_hex}{separator}"
        # every value's name starts with it
        self.name_prefix = self._namespace_prefix
        # the namespace's epoch, in the names (a store that cannot list), or None
        self.epoch: str | None = None
        self.epoch_name = self._namespace_prefix + "epoch"
        self._secret = key_secret
        self._mac_key = None
        if key_secret is not None:
            self._mac_key = blake3(key_secret, derive_key_context=_MAC_CONTEXT).digest()

    def use_epoch(self, epoch: str) -> None:
        """Name every value under `epoch` from now on (only while no job runs: a reset's sweep)."""
        self.epoch = epoch
        self.name_prefix = f"{self._namespace_prefix}{epoch}{self._separator}"

    def stored_key(self, key: OffloadKey) -> bytes:
        """The key as the store sees it (in the name and the header)."""
        if self._secret is None:
            return key
        return hmac.new(self._secret, self.namespace_id + key, hashlib.sha256).digest()

    def name(self, key: OffloadKey) -> str:
        return self.name_prefix + self.stored_key(key).hex()

    def fits(self, key: OffloadKey, buffers: Sequence[memoryview]) -> bool:
        """Whether a job's chunk can be stored: a key a header holds and a whole payload."""
        return (self.is_keyed or len(key) <= _MAX_KEY_BYTES) and sum(
            b.nbytes for b in buffers
        ) == self.payload_bytes

    def pack(self, key: OffloadKey, buffers: Sequence[memoryview]) -> list[bytes | memoryview]:
        """The value's parts: the header (with the payload's checksum), the buffers, the tag (keyed)."""
        header = ValueHeader(
            self.namespace_id, self.stored_key(key), self.payload_bytes, checksum(buffers)
        ).pack()
        if self._mac_key is None:
            return [header, *buffers]
        return [header, *buffers, self._tag(header, buffers)]

    def receiving_parts(self, buffers: Sequence[memoryview]) -> IncomingValue:
        """Where a value is received: its header into a buffer of its own, the payload into
        `buffers` (the slab rows: no copy), the tag (keyed) into one of its own; see `check`."""
        tag = (memoryview(bytearray(TAG_BYTES)),) if self.is_keyed else ()
        parts = (memoryview(bytearray(HEADER_BYTES)), *buffers, *tag)
        if self._mac_key is None:
            # the checksum covers the payload
            return IncomingValue(
                parts, xxhash.xxh3_64(), HEADER_BYTES, HEADER_BYTES + self.payload_bytes
            )
        # the tag covers the header and the payload
        return IncomingValue(parts, blake3(key=self._mac_key), 0, HEADER_BYTES + self.payload_bytes)

    def check(self, key: OffloadKey, size: int, parts: Sequence[memoryview]) -> str | None:
        """Why a value of `size` bytes received into `parts` (`receiving_parts`) must be refused, or None.

        The payload buffers are only trusted once this returns None: until then they hold
        bytes nobody may read (a PENDING slot)."""
        if size != self.value_bytes:
            return f"{size} bytes, expected {self.value_bytes}"
        header, payload = parts[0], parts[1 : len(parts) - (1 if self.is_keyed else 0)]
        unpacked = ValueHeader.unpack(header)
        if isinstance(unpacked, str):
            return unpacked
        why = unpacked.mismatch(self.namespace_id, self.stored_key(key), self.payload_bytes)
        if why is not None:
            return why
        # the digest of the pieces the store reported, when they were the whole value (else None:
        # the buffers are hashed here)
        hashed = None
        if isinstance(parts, IncomingValue) and parts.num_received == size:
            hashed = parts.hasher
        if self.is_keyed:
            tag = self._tag(header, payload) if hashed is None else hashed.digest()
            if not hmac.compare_digest(tag, parts[-1]):
                return "tag mismatch (not written with this deployment's secret, or altered)"
            return None
        digest = checksum(payload) if hashed is None else hashed.intdigest()
        if digest != unpacked.payload_checksum:
            return "payload checksum mismatch"
        return None

    def _tag(self, header: bytes | memoryview, payload: Sequence[memoryview]) -> bytes:
        """Keyed BLAKE3 of the header and the payload (the header names namespace and key)."""
        mac = blake3(header, key=self._mac_key)
        for buf in payload:
            mac.update(buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B"))
        return mac.digest()


class IncomingValue(tuple):
    """A value's receiving parts (header, payload buffers, tag: a tuple of memoryviews) that hash
    the value as it arrives: a store that receives into them calls `received` with each piece
    just written, in order, every byte once (see `kvtier.tiers.remote.store.RemoteStore.get_into`).

    Bytes `start` to `end` of the value go to `hasher` (the checksum's: the payload; the tag's:
    header and payload). `ValueCodec.check` uses the digest only when `num_received` is the whole
    value; anything else (a store that reports nothing, a value cut short) hashes the buffers.

    Thread-safety: none; the one thread receiving the value uses it, then the one checking it.
    """

    hasher: xxhash.xxh3_64 | blake3
    num_received: int

    def __new__(
        cls, parts: Sequence[memoryview], hasher: xxhash.xxh3_64 | blake3, start: int, end: int
    ):
        self = super().__new__(cls, parts)
        self.hasher = hasher
        self.num_received = 0
        self._start = start
        self._end = end
        return self

    def received(self, piece: memoryview) -> None:
        """`piece` (1-D bytes) is the value's next bytes, now in these parts."""
        first = self.num_received
        self.num_received += piece.nbytes
        lo, hi = max(first, self._start), min(self.num_received, self._end)
        if lo < hi:
            self.hasher.update(piece[lo - first : hi - first])
