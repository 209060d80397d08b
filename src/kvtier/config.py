"""kvtier's user-facing configuration (`kv_connector_extra_config` in vLLM).

Every key is validated at engine start: an unknown key or a bad value is a
`ConfigError` that names the key, what was wrong, and the valid keys.

    {"cpu_bytes": "4GiB", "blocks_per_chunk": 1, "eviction_policy": "lru"}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from kvtier.errors import ConfigError
from kvtier.policies import policy_names

__all__ = ["KVTierConfig", "parse_size"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int or a string like "4GiB", "512 MiB", "2e9"-free "2000000000"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like '4GiB' or a number of bytes, got {value!r}")
    if isinstance(value, int):
        num_bytes = value
    elif isinstance(value, str) and (m := _SIZE.match(value)) and m.group(2).lower() in _UNITS:
        num_bytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ConfigError(f"{key}: expected a size like '4GiB', '512MiB' or a number of bytes, got {value!r}")
    if num_bytes <= 0:
        raise ConfigError(f"{key}: must be positive, got {value!r}")
    return num_bytes


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """Validated kvtier settings.

    cpu_bytes: host RAM for the CPU tier (e.g. "4GiB").
    blocks_per_chunk: engine blocks per offloaded chunk (the transfer unit).
    eviction_policy: "lru", "arc" or an out-of-tree "module:Class".
    store_threshold: store a chunk on its N-th offer (1 = always).
    offload_prompt_only: do not store chunks of generated tokens.
    max_defer_s / max_deferrals: the bound on how long a request waits for pending writes.
    job_timeout_s: a transfer job not done by then is abandoned (loads recomputed, stores dropped).
    enable_events: publish BlockStored / BlockRemoved KV events.
    disk_path: directory of the disk tier (None: no disk tier); created if missing.
    disk_bytes: capacity of the disk tier.
    disk_fsync: fsync each chunk file (and its directory) before it counts as stored.
    disk_direct_io: "auto" (O_DIRECT where the filesystem and buffers allow), true or false.
    disk_write_mode: "write_through" (every stored chunk) or "on_evict" (chunks RAM evicts).
    disk_min_offers: cascade to disk only chunks offered by at least this many requests.
    disk_eviction_policy: the disk tier's eviction policy.
    disk_rescan_s: every so many seconds, adopt chunk files other engines sharing the directory
        wrote since this one started (None: only the scan at start).
    disk_max_queue_bytes / disk_max_store_s: backpressure: cascades to disk are dropped
        while this many bytes are queued or recent writes took longer.
    promotion_bytes: bytes of chunks being read back from secondary tiers at most.
    """

    cpu_bytes: int = 4 * 2**30
    blocks_per_chunk: int = 1
    eviction_policy: str = "lru"
    store_threshold: int = 1
    offload_prompt_only: bool = False
    max_defer_s: float = 2.0
    max_deferrals: int = 64
    job_timeout_s: float = 10.0
    enable_events: bool = True
    disk_path: str | None = None
    disk_bytes: int = 16 * 2**30
    disk_fsync: bool = False
    disk_direct_io: str | bool = "auto"
    disk_write_mode: str = "write_through"
    disk_min_offers: int = 1
    disk_eviction_policy: str = "lru"
    disk_rescan_s: float | None = None
    disk_max_queue_bytes: int = 256 * 2**20
    disk_max_store_s: float = 2.0
    promotion_bytes: int = 256 * 2**20

    @classmethod
    def from_dict(cls, raw: Any) -> KVTierConfig:
        """Validate a user dict; raises ConfigError naming the key and the valid keys."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ConfigError(f"kvtier config must be a dict of {cls.valid_keys()}, got {type(raw).__name__}")
        unknown = sorted(str(k) for k in raw if k not in cls.valid_keys())
        if unknown:
            raise ConfigError(f"unknown kvtier config key(s) {unknown}; valid keys: {cls.valid_keys()}")
        values = {k: _check(k, v) for k, v in raw.items()}
        return cls(**values)

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]


_SIZES = ("cpu_bytes", "disk_bytes", "disk_max_queue_bytes", "promotion_bytes")
_BOOLS = ("offload_prompt_only", "enable_events", "disk_fsync")
_CHOICES = {"disk_direct_io": ("auto", True, False), "disk_write_mode": ("write_through", "on_evict")}


def _check(key: str, value: Any) -> Any:
    if key in _SIZES:
        return parse_size(value, key)
    if key in ("blocks_per_chunk", "store_threshold", "disk_min_offers"):
        return _int_at_least(key, value, 1)
    if key == "max_deferrals":
        return _int_at_least(key, value, 0)
    if key == "disk_rescan_s" and value is None:
        return None
    if key in ("max_defer_s", "job_timeout_s", "disk_max_store_s", "disk_rescan_s"):
        least = 0.0 if key == "max_defer_s" else 0.001
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value < float("inf"):
            raise ConfigError(f"{key}: expected seconds >= {least:g}, got {value!r}")
        return float(value)
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if key in _CHOICES:
        if not any(value is c or (isinstance(c, str) and value == c) for c in _CHOICES[key]):
            raise ConfigError(f"{key}: expected one of {list(_CHOICES[key])}, got {value!r}")
        return value
    if key in ("eviction_policy", "disk_eviction_policy"):
        if not isinstance(value, str) or (value not in policy_names() and ":" not in value):
            raise ConfigError(f"{key}: expected one of {policy_names()} or 'module:Class', got {value!r}")
        return value
    if key == "disk_path":
        if value is not None and (not isinstance(value, str) or not value.strip() or "\x00" in value):
            raise ConfigError(f"{key}: expected a directory path (a non-empty string) or null, got {value!r}")
        return value
    raise ConfigError(f"unknown kvtier config key {key!r}")


def _int_at_least(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}: expected an integer >= {minimum}, got {value!r}")
    return value
