"""kvtier's user-facing configuration (`kv_connector_extra_config` in vLLM).

Every key is validated at engine start: an unknown key or a bad value is a
`ConfigError` that names the key, what was wrong, and the valid keys.

    {"cpu_bytes": "4GiB", "blocks_per_chunk": 1, "eviction_policy": "lru"}
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from kvtier.errors import ConfigError
from kvtier.policies import policy_names

__all__ = ["KVTierConfig", "parse_size"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")  # fullmatch: "$" would take a trailing newline
_MAX_BYTES = 2**63 - 1  # what every size field of a header, a file offset or a C size_t holds


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int or a string like "4GiB", "512 MiB", "2e9"-free "2000000000"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like '4GiB' or a number of bytes, got {value!r}")
    if isinstance(value, int):
        num_bytes = value
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)) and m.group(2).lower() in _UNITS:
        num_bytes = float(m.group(1)) * _UNITS[m.group(2).lower()]  # inf for 400 digits: refused below
    else:
        raise ConfigError(f"{key}: expected a size like '4GiB', '512MiB' or a number of bytes, got {_short(value)}")
    if not 0 < num_bytes <= _MAX_BYTES:
        raise ConfigError(f"{key}: must be positive and at most {_MAX_BYTES} (8 EiB), got {_short(value)}")
    return int(num_bytes)


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """Validated kvtier settings.

    cpu_bytes: host RAM for the CPU tier (e.g. "4GiB").
    blocks_per_chunk: engine blocks per offloaded chunk (the transfer unit).
    eviction_policy: "turns" (conversation depth), "lru", "arc" or an out-of-tree "module:Class".
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
    disk_file_mode: "0600" (chunk files and directories for this user only) or "0640" (the
        group may read them too); directories get search bits (0700, 0750).
    disk_rescan_s: every so many seconds, adopt chunk files other engines sharing the directory
        wrote since this one started (None: only the scan at start).
    disk_max_queue_bytes / disk_max_store_s: backpressure: cascades to disk are dropped
        while this many bytes are queued or recent writes took longer.
    promotion_bytes: bytes of chunks being read back from secondary tiers at most.
    load_mode: "async" (the engine parks a request while its load runs; the batch keeps
        stepping) or "sync" (the load ends inside the step, before the forward pass).
    store_mode: "eager" (store a chunk once it is computed) or "lazy" (once the engine is about
        to evict it: the host tier then holds what the engine lost, not a copy of what it holds).
    redis_* / s3_*: the shared tiers (see README, "Shared tiers"); no secret is ever a config
        value: passwords, S3 keys and the key secret come from files named here or the environment.
    remote_prefix: the first part of every Redis key and S3 object name.
    remote_key_mode: "keyed" names values by HMAC(secret, key) (`key_secret_file` or
        KVTIER_KEY_SECRET), so listing a store reveals no prompt; "plain" by the key itself.
    remote_breaker_failures / remote_breaker_retry_s: failures in a row that open a shared tier's
        circuit breaker, and the first interval between pings while it is open.
    remote_max_queue_bytes: backpressure for each shared tier (as disk_max_queue_bytes).
    """

    cpu_bytes: int = 4 * 2**30
    blocks_per_chunk: int = 1
    eviction_policy: str = "turns"  # won or tied LRU and ARC at every capacity in the policy sweep (README)
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
    disk_file_mode: str = "0600"
    disk_rescan_s: float | None = None
    disk_max_queue_bytes: int = 256 * 2**20
    disk_max_store_s: float = 2.0
    promotion_bytes: int = 256 * 2**20
    load_mode: str = "sync"  # measured better on vLLM CPU (benchmarks/bench_overlap.py); hybrid models: async
    store_mode: str = "eager"
    redis_url: str | None = None
    redis_cluster: bool = False
    redis_username: str | None = None
    redis_password_file: str | None = None
    redis_ca_file: str | None = None
    redis_ttl_s: float | None = None
    redis_timeout_ms: int = 1000
    redis_connect_timeout_ms: int = 500
    redis_required: bool = False
    redis_write_mode: str = "write_through"
    redis_min_offers: int = 1
    s3_endpoint: str | None = None
    s3_bucket: str | None = None
    s3_region: str = "us-east-1"
    s3_credentials_file: str | None = None
    s3_ca_file: str | None = None
    s3_timeout_ms: int = 5000
    s3_connect_timeout_ms: int = 1000
    s3_required: bool = False
    s3_write_mode: str = "write_through"
    s3_min_offers: int = 1
    remote_prefix: str = "kvtier"
    remote_key_mode: str = "plain"
    key_secret_file: str | None = None
    remote_breaker_failures: int = 5
    remote_breaker_retry_s: float = 1.0
    remote_max_queue_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        if (self.s3_endpoint is None) != (self.s3_bucket is None):
            raise ConfigError("s3_endpoint and s3_bucket go together: set both for an S3 tier, or neither")

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


_SIZES = ("cpu_bytes", "disk_bytes", "disk_max_queue_bytes", "promotion_bytes", "remote_max_queue_bytes")
_BOOLS = ("offload_prompt_only", "enable_events", "disk_fsync", "redis_cluster", "redis_required", "s3_required")
_WRITE_MODES = ("write_through", "on_evict")
_CHOICES = {"disk_direct_io": ("auto", True, False), "disk_write_mode": _WRITE_MODES, "redis_write_mode": _WRITE_MODES,
            "s3_write_mode": _WRITE_MODES, "remote_key_mode": ("plain", "keyed"), "load_mode": ("async", "sync"),
            "store_mode": ("eager", "lazy"), "disk_file_mode": ("0600", "0640")}
_INTS = {"blocks_per_chunk": 1, "store_threshold": 1, "disk_min_offers": 1, "max_deferrals": 0, "redis_min_offers": 1,
         "s3_min_offers": 1, "redis_timeout_ms": 1, "redis_connect_timeout_ms": 1, "s3_timeout_ms": 1,
         "s3_connect_timeout_ms": 1, "remote_breaker_failures": 1}
_SECONDS = {"max_defer_s": 0.0, "job_timeout_s": 0.001, "disk_max_store_s": 0.001, "disk_rescan_s": 0.001,
            "redis_ttl_s": 1.0, "remote_breaker_retry_s": 0.01}
_OPTIONAL = ("disk_rescan_s", "redis_ttl_s")  # seconds or null
_MAX_SECONDS = 10.0**9  # ~30 years: larger is a typo (and overflows float conversions and timers)
_MAX_INT = 2**31 - 1  # counts and milliseconds: larger ones overflow C ints in timers and sockets
# paths and names: a non-empty string or null (a file's content is read at engine start, never here)
_STRINGS = ("disk_path", "redis_username", "redis_password_file", "redis_ca_file", "s3_credentials_file",
            "s3_ca_file", "key_secret_file", "s3_region")
# matched whole (fullmatch): "$" alone would let a trailing newline into a key name or a URL
_PATTERNS = {"s3_bucket": re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"),
             "remote_prefix": re.compile(r"(?!\.\.?$)[A-Za-z0-9_.-]{1,64}"),  # not "." or "..": S3 path segments
             "s3_endpoint": re.compile(r"https?://[^\s/@]+(/[^\s@]*)?")}


def _check(key: str, value: Any) -> Any:
    if key in _SIZES:
        return parse_size(value, key)
    if key in _INTS:
        return _int_at_least(key, value, _INTS[key])
    if key in _OPTIONAL and value is None:
        return None
    if key in _SECONDS:
        least = _SECONDS[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value <= _MAX_SECONDS:
            raise ConfigError(f"{key}: expected seconds >= {least:g} (at most {_MAX_SECONDS:g}), got {_short(value)}")
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
    if value is None and (key in _STRINGS or key in _PATTERNS or key == "redis_url"):
        return None
    if key in _STRINGS:
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            raise ConfigError(f"{key}: expected a non-empty string or null, got {type(value).__name__}")
        return value
    if key in _PATTERNS:
        if not isinstance(value, str) or not _PATTERNS[key].fullmatch(value):
            raise ConfigError(f"{key}: expected a string matching {_PATTERNS[key].pattern}")
        return value
    if key == "redis_url":
        return _redis_url(value)
    raise ConfigError(f"unknown kvtier config key {key!r}")


def _redis_url(value: Any) -> str:
    """A redis:// or rediss:// URL without a password (the message never repeats the URL: it may hold one)."""
    if not isinstance(value, str):
        raise ConfigError(f"redis_url: expected a URL like 'redis://host:6379/0', got {type(value).__name__}")
    try:
        url = urlsplit(value)
        url.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise ConfigError("redis_url: not a valid URL; expected 'redis://host:6379/0' or 'rediss://…'") from None
    if url.scheme not in ("redis", "rediss") or not url.hostname:
        raise ConfigError("redis_url: expected the scheme redis:// or rediss:// (TLS) and a host")
    if url.password is not None:
        raise ConfigError("redis_url must not contain a password: set the KVTIER_REDIS_PASSWORD environment variable "
                          "or name a file holding it in redis_password_file (and the ACL user in redis_username)")
    return value


def _int_at_least(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _MAX_INT:
        raise ConfigError(f"{key}: expected an integer >= {minimum} (at most {_MAX_INT}), got {_short(value)}")
    return value


def _short(value: Any) -> str:
    """`repr(value)`, cut to a line: a message must stay readable whatever was passed."""
    return reprlib.repr(value)
