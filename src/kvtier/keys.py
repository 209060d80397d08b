"""Block hashes and offload keys.

A `BlockHash` is the engine's chained prefix hash of one full block: the hash of
block *i* covers tokens 0..i (and the extra keys that apply to them). An
`OffloadKey` names one offloaded chunk of one KV-cache group: the block hash of
the chunk's LAST block followed by the group index as 4 big-endian bytes, so one
key names a whole prefix.

For engines that bring no hashes (the simulator, tests) `BlockHasher` computes the
same chain as vLLM's `sha256_cbor` scheme, byte for byte:

    hash_i = sha256(cbor_canonical((hash_{i-1}, tuple(tokens_i), extra_keys_i)))
    hash_{-1} = NONE_HASH = sha256(cbor_canonical(seed))

where vLLM's seed is PYTHONHASHSEED when set, else "vllm-none-hash" (`DEFAULT_SEED`).

Extra keys are type-tagged pairs (``("lora", name)``, ``("mm", hash)``,
``("salt", cache_salt)``), so a LoRA adapter named like a tenant's salt can never
produce the same hash. For tiers shared between tenants an optional keyed mode
replaces sha256 with HMAC-SHA256 under a deployment secret, so a party without
the secret cannot forge or predict keys.

Thread-safety: everything here is a pure function or immutable after construction.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from typing import Any

import cbor2

from kvtier.errors import ConfigError

__all__ = [
    "BLOCK_HASH_BYTES",
    "DEFAULT_SEED",
    "GROUP_INDEX_BYTES",
    "OFFLOAD_KEY_BYTES",
    "BlockHash",
    "BlockHasher",
    "OffloadKey",
    "extra_keys",
    "hash_block_tokens",
    "make_offload_key",
    "none_hash",
    "key_length_error",
    "sha256_cbor",
    "split_offload_key",
]

# the engine's chained prefix hash of one full block
BlockHash = bytes
# BlockHash of a chunk's last block + 4-byte big-endian group index
OffloadKey = bytes

# sha256 / HMAC-SHA256 digests; engines with other hashes pass key_bytes
BLOCK_HASH_BYTES = 32
GROUP_INDEX_BYTES = 4
OFFLOAD_KEY_BYTES = BLOCK_HASH_BYTES + GROUP_INDEX_BYTES
# vLLM's NONE_HASH seed for sha256 hashes without PYTHONHASHSEED
DEFAULT_SEED = "vllm-none-hash"
_MAX_GROUP_INDEX = 2 ** (8 * GROUP_INDEX_BYTES) - 1


def make_offload_key(block_hash: BlockHash, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV-cache group index into an `OffloadKey`."""
    if not 0 <= group_idx <= _MAX_GROUP_INDEX:
        raise ConfigError(f"group index {group_idx} does not fit in 4 bytes")
    return bytes(block_hash) + group_idx.to_bytes(GROUP_INDEX_BYTES, "big")


def split_offload_key(key: OffloadKey) -> tuple[BlockHash, int]:
    """Unpack an `OffloadKey` into (block hash, group index)."""
    if len(key) <= GROUP_INDEX_BYTES:
        raise ConfigError(
            f"offload key of {len(key)} bytes is too short: expected a block hash "
            f"followed by a {GROUP_INDEX_BYTES}-byte group index (make_offload_key)"
        )
    return key[:-GROUP_INDEX_BYTES], int.from_bytes(key[-GROUP_INDEX_BYTES:], "big")


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's `sha256_cbor`: sha256 of the canonical CBOR encoding of `obj`."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(seed: str = DEFAULT_SEED) -> BlockHash:
    """The parent hash of a request's first block (vLLM's NONE_HASH for this seed)."""
    return sha256_cbor(seed)


def hash_block_tokens(
    parent: BlockHash,
    token_ids: Sequence[int],
    extra: tuple | None = None,
    secret: bytes | None = None,
) -> BlockHash:
    """Hash one full block, chained on its parent (vLLM's `hash_block_tokens`).

    Args:
        parent: the previous block's hash, or `none_hash(seed)` for the first block.
        token_ids: the block's token ids.
        extra: the block's extra keys (see `extra_keys`), or None.
        secret: when given, HMAC-SHA256 under this secret instead of sha256.
    Returns:
        The 32-byte block hash.
    """
    payload = cbor2.dumps((parent, tuple(token_ids), extra), canonical=True)
    if secret is None:
        return hashlib.sha256(payload).digest()
    return hmac.new(secret, payload, hashlib.sha256).digest()


def extra_keys(
    lora_name: str | None = None,
    mm_hashes: Iterable[str] = (),
    cache_salt: str | None = None,
) -> tuple | None:
    """Type-tagged extra keys of one block, or None when there are none.

    Returns:
        A tuple of ``(tag, value)`` pairs; the tag keeps a LoRA name, a multimodal
        hash and a cache salt with equal text apart.
    """
    keys: list[tuple[str, str]] = []
    if lora_name:
        keys.append(("lora", lora_name))
    keys.extend(("mm", h) for h in mm_hashes)
    if cache_salt:
        keys.append(("salt", cache_salt))
    return tuple(keys) or None


def key_length_error(key: object, expected: int) -> ConfigError:
    """The error a tier raises for an offload key of the wrong length."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        size: int | str = len(key)
    else:
        size = type(key).__name__
    return ConfigError(
        f"offload key of {size} bytes where this tier expects {expected}: build keys with "
        "kvtier.keys.make_offload_key(block_hash, group_idx), or pass key_bytes for other hash sizes"
    )


class BlockHasher:
    """Chained block hashes for engines that bring none (byte-compatible with vLLM).

    Args:
        block_size: tokens per block; only full blocks are hashed.
        seed: the first block's parent seed (vLLM: PYTHONHASHSEED, else DEFAULT_SEED).
        secret: optional deployment secret; switches to HMAC-SHA256 (keyed mode).
    """

    def __init__(self, block_size: int, seed: str = DEFAULT_SEED, secret: bytes | None = None):
        if block_size <= 0:
            raise ConfigError(f"block_size must be a positive number of tokens, got {block_size}")
        if secret is not None and len(secret) < 16:
            raise ConfigError(
                "the keyed-hash secret must be at least 16 bytes; generate one with os.urandom(32)"
            )
        self.block_size = block_size
        self.secret = secret
        self.root = none_hash(seed)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
        parent: BlockHash | None = None,
    ) -> list[BlockHash]:
        """Hash every full block of `token_ids`.

        Like vLLM, the LoRA name enters every block and the cache salt only the first
        (the chain carries it on). Pass `parent` to continue an earlier chain.
        """
        hashes: list[BlockHash] = []
        prev = self.root if parent is None else parent
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            salt = cache_salt if (start == 0 and parent is None) else None
            extra = extra_keys(lora_name, (), salt)
            prev = hash_block_tokens(prev, token_ids[start : start + size], extra, self.secret)
            hashes.append(prev)
        return hashes
