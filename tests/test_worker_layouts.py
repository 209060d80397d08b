"""Engine KV tensors seen as planes of byte pages, and where each page goes in a slot."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from helpers import HANG_S, load_job, store_job
from kvtier.errors import ConfigError
from kvtier.worker import TransferEngine, build_group_layouts, kv_planes
from kvtier.worker.memmove import split_by_bytes

NUM_BLOCKS = 6


def cpu_layout() -> torch.Tensor:
    """vLLM 0.32 CPU: (num_blocks, kv_heads, block_size, 2 * head_size), block dim first."""
    return torch.randn(NUM_BLOCKS, 2, 4, 16)


def kv_first_layout() -> torch.Tensor:
    """Older FlashAttention: (2, num_blocks, block_size, kv_heads, head_size)."""
    return torch.randn(2, NUM_BLOCKS, 4, 2, 8)


def lbnhc_layout() -> torch.Tensor:
    """Logical (blocks, heads, tokens, content), tokens-then-heads in memory (CUDA default)."""
    return torch.randn(NUM_BLOCKS, 4, 2, 16).permute(0, 2, 1, 3)


def lhbnc_layout() -> torch.Tensor:
    """Heads outside blocks: each block is one run per head."""
    return torch.randn(2, NUM_BLOCKS, 4, 16).permute(1, 0, 2, 3)


def blhnc_layout() -> torch.Tensor:
    """Blocks outside layers: this layer's rows are spaced three pages apart."""
    return torch.randn(NUM_BLOCKS, 3, 2, 4, 16)[:, 1]


LAYOUTS = {
    "cpu": (cpu_layout, 1, True),
    "kv_first": (kv_first_layout, 2, True),
    "lbnhc": (lbnhc_layout, 1, True),
    "lhbnc": (lhbnc_layout, 2, True),
    "blhnc": (blhnc_layout, 1, False),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_planes_cover_each_block_exactly_once(name):
    make, num_planes, is_dense = LAYOUTS[name]
    tensor = make()
    planes = kv_planes("layer", tensor)
    # the planes' rows of one block hold exactly that block's bytes
    assert len(planes) == num_planes
    assert all(p.num_blocks == NUM_BLOCKS and p.is_dense == is_dense for p in planes)
    page_bytes = tensor.numel() * tensor.element_size() // NUM_BLOCKS
    assert sum(p.nbytes for p in planes) == page_bytes
    # mark block 3 only: its rows are all marked, every other row is untouched
    tensor.zero_()
    block = tensor[:, 3] if name == "kv_first" else tensor[3]
    # no zero byte anywhere in the block
    block.view(torch.int32).fill_(0x01020304)
    for plane in planes:
        rows = plane.view().view(torch.uint8)
        assert rows[3].any() and not rows[3].eq(0).any()
        assert rows[[0, 1, 2, 4, 5]].eq(0).all()


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_block_loaded_elsewhere_equals_the_stored_block(name):
    make = LAYOUTS[name][0]
    kv = {"a": make(), "b": make()}
    blocks = {k: (t[:, 2] if name == "kv_first" else t[2]).clone() for k, t in kv.items()}
    with TransferEngine(kv, blocks_per_chunk=1, num_slots=2) as engine:
        # store block 2 into slot 1, load slot 1 into block 5: block 5 reads as block 2 did
        engine.submit(store_job(1, [2], [1]))
        engine.submit(load_job(2, [1], [5]))
        assert engine.wait([1, 2], timeout=HANG_S)
        assert all(r.success for r in engine.get_finished())
    for k, t in kv.items():
        assert torch.equal(t[:, 5] if name == "kv_first" else t[5], blocks[k])


def test_unviewable_tensor_is_a_config_error_naming_shape_and_strides():
    sliced = torch.zeros(NUM_BLOCKS, 2, 4, 32)[..., :16]
    with pytest.raises(ConfigError, match=r"shape \(6, 2, 4, 16\), strides \(256, 128, 32, 1\)"):
        kv_planes("layer", sliced)


def test_overlapping_blocks_are_rejected():
    overlapping = torch.zeros(64).as_strided((NUM_BLOCKS, 16), (8, 1))
    with pytest.raises(ConfigError, match="overlap"):
        kv_planes("layer", overlapping)


def test_layout_names_and_ambiguity():
    with pytest.raises(ConfigError, match="kv_layout must be one of"):
        kv_planes("layer", cpu_layout(), "nhd")
    with pytest.raises(ConfigError, match=r"expects \(2, num_blocks"):
        kv_planes("layer", cpu_layout(), "kv_first")
    # (2, 2, ...) fits both readings: auto refuses, an explicit layout decides
    ambiguous = torch.zeros(2, 2, 4, 2, 8)
    with pytest.raises(ConfigError, match="pass kv_layout"):
        kv_planes("layer", ambiguous)
    assert len(kv_planes("layer", ambiguous, "kv_first")) == 2
    assert len(kv_planes("layer", ambiguous, "blocks_first")) == 1


def test_groups_lay_out_slots_and_slot_bytes_is_the_largest_chunk():
    kv = {"full.0": cpu_layout(), "full.1": cpu_layout(), "swa.0": kv_first_layout()}
    layouts = build_group_layouts(kv, 4, [["full.0", "full.1"], ["swa.0"]])
    page = 2 * 4 * 16 * 4
    assert [g.chunk_bytes for g in layouts] == [2 * 4 * page, 4 * page]
    # each plane's 4 pages sit back to back in the slot, plane after plane
    assert layouts[0].slot_offsets == (0, 4 * page)
    assert layouts[1].slot_offsets == (0, 4 * page // 2)
    with TransferEngine(kv, 4, 3, [["full.0", "full.1"], ["swa.0"]]) as engine:
        assert engine.slot_bytes == 2 * 4 * page
        assert tuple(engine.slab.shape) == (3, 2 * 4 * page)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([["a", "zz"]], "no KV cache"),
        ([["a"]], "belong to no group"),
        ([["a", "a", "b"]], "appears twice"),
        ([["a", "b"], []], "at least one layer"),
    ],
)
def test_bad_groups_are_config_errors(groups, message):
    with pytest.raises(ConfigError, match=message):
        build_group_layouts({"a": cpu_layout(), "b": cpu_layout()}, 1, groups)


def test_layers_of_a_group_must_agree_on_block_count():
    with pytest.raises(ConfigError, match="different block counts"):
        build_group_layouts({"a": cpu_layout(), "b": torch.zeros(NUM_BLOCKS + 1, 2, 4, 16)}, 1)


def test_split_by_bytes_covers_every_byte_once():
    rng = np.random.default_rng(1)
    for shares in (2, 3):
        for sizes in (
            rng.integers(1, 5000, 40),
            np.array([1 << 20]),
            rng.integers(1, 10, 3) * 1000,
        ):
            dst = np.cumsum(np.append(0, sizes[:-1])) + 10_000_000
            src = dst + 50_000_000
            parts = split_by_bytes(dst, src, sizes, shares)
            assert len(parts) == shares
            covered = sorted(
                (d, d + n) for part in parts for d, n in zip(part[0], part[2], strict=True)
            )
            assert covered[0][0] == dst[0] and covered[-1][1] == dst[-1] + sizes[-1]
            assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
            assert all(
                s - d == 50_000_000 for part in parts for d, s in zip(part[0], part[1], strict=True)
            )
