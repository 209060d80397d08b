"""Block hashes and offload keys."""

from __future__ import annotations

import importlib.util

import pytest

from kvtier.errors import ConfigError
from kvtier.keys import (
    DEFAULT_SEED,
    BlockHasher,
    extra_keys,
    hash_block_tokens,
    make_offload_key,
    none_hash,
    sha256_cbor,
    split_offload_key,
)


def test_offload_key_round_trip():
    h = bytes(range(32))
    k = make_offload_key(h, 3)
    assert len(k) == 36 and k[-4:] == b"\x00\x00\x00\x03"
    assert split_offload_key(k) == (h, 3)


def test_offload_key_rejects_bad_input():
    with pytest.raises(ConfigError, match="does not fit"):
        make_offload_key(b"x" * 32, 2**32)
    with pytest.raises(ConfigError, match="too short"):
        split_offload_key(b"abc")


# Pinned bytes, cross-checked by hand: sha256 over the canonical CBOR array
# 0x83 | 0x5820 <parent> | 0x84 t0 t1 t2 t3 | 0xf6 (null extra keys), with the first
# parent sha256(0x61 0x30) = sha256_cbor("0"), vLLM's NONE_HASH for PYTHONHASHSEED=0.
PINNED = [
    "8d4c7c828f1611f485f1ebfc2b19f0fe1c90d0a71d00cd90948a1fa5e8c9e91f",
    "ed6fa5d37a067707ede9aff44aa2819ab639263ca4ca66e8d36d02ffac952d33",
    "1b7047f472ffe29f9649139ce64bf3c05228f5a99bb7792568bb68f2d7410c30",
]


def test_pinned_hash_bytes():
    hasher = BlockHasher(block_size=4, seed="0")
    chain = hasher.hash_blocks(list(range(12)))
    assert [h.hex() for h in chain] == PINNED


def test_hash_chain_structure():
    hasher = BlockHasher(block_size=4, seed="0")
    # two full blocks, the partial third is not hashed
    tokens = list(range(10))
    h1, h2 = hasher.hash_blocks(tokens)
    assert h1 == sha256_cbor((none_hash("0"), (0, 1, 2, 3), None))
    assert h2 == sha256_cbor((h1, (4, 5, 6, 7), None))
    # continuing the chain from h1 gives the same second hash
    assert hasher.hash_blocks(tokens[4:], parent=h1)[0] == h2


def test_cache_salt_changes_every_block_and_only_enters_the_first():
    hasher = BlockHasher(block_size=2)
    plain = hasher.hash_blocks([1, 2, 3, 4])
    salted = hasher.hash_blocks([1, 2, 3, 4], cache_salt="tenant-a")
    assert all(a != b for a, b in zip(plain, salted, strict=False))
    assert salted[1] == hash_block_tokens(salted[0], (3, 4), None)


def test_extra_keys_are_type_tagged():
    # a LoRA named like a salt must not produce the salt's hash
    hasher = BlockHasher(block_size=2)
    as_lora = hasher.hash_blocks([1, 2], lora_name="x")
    as_salt = hasher.hash_blocks([1, 2], cache_salt="x")
    assert as_lora != as_salt
    assert extra_keys("x", ["m"], "s") == (("lora", "x"), ("mm", "m"), ("salt", "s"))
    assert extra_keys() is None


def test_keyed_mode_needs_the_secret():
    tokens = [5, 6, 7, 8]
    plain = BlockHasher(2).hash_blocks(tokens)
    keyed_a = BlockHasher(2, secret=b"a" * 32).hash_blocks(tokens)
    keyed_b = BlockHasher(2, secret=b"b" * 32).hash_blocks(tokens)
    assert len({plain[1], keyed_a[1], keyed_b[1]}) == 3
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        BlockHasher(2, secret=b"short")


def test_bad_block_size():
    with pytest.raises(ConfigError, match="block_size must be a positive"):
        BlockHasher(0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize("seed", ["0", DEFAULT_SEED])
def test_byte_identical_to_installed_vllm(seed):
    from vllm.utils.hashing import sha256_cbor as vllm_sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import hash_block_tokens as vllm_hash_block_tokens

    assert kv_cache_utils.DEFAULT_NONE_HASH_SEED == DEFAULT_SEED
    parent = vllm_sha256_cbor(seed)
    assert parent == none_hash(seed)
    ours = BlockHasher(block_size=4, seed=seed).hash_blocks(list(range(12)))
    for i, expected in enumerate(ours):
        parent = vllm_hash_block_tokens(
            vllm_sha256_cbor, parent, list(range(4 * i, 4 * i + 4)), None
        )
        assert bytes(parent) == expected
    extra = extra_keys("lora", ["mm"], "salt")
    assert bytes(
        vllm_hash_block_tokens(vllm_sha256_cbor, ours[0], [1, 2], extra)
    ) == hash_block_tokens(ours[0], [1, 2], extra)
