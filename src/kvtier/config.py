"""kvtier's user-facing configuration (`kv_connector_extra_config` in vLLM).

The user writes one flat dict; each key goes to the slice that owns it — the core keys here,
`disk_*` to `DiskConfig`, `redis_*` / `s3_*` / `remote_*` to the shared tiers' slices — and
every slice checks its own values when it is built, however it is built. An unknown key or a
bad value is a `ConfigError` that names the key, what was wrong, and the valid keys.

    {"cpu_bytes": "4GiB", "blocks_per_chunk": 1, "eviction_policy": "lru", "disk_path": "/var/kvtier"}
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from kvtier.errors import ConfigError
from kvtier.scheduler.config import CHECKS as SCHEDULER_CHECKS
from kvtier.settings import (
    flag,
    integer,
    parse_size,
    policy,
    quotas,
    setting,
    size,
    slice_fields,
    validate,
)
from kvtier.tiers.disk.config import DiskConfig
from kvtier.tiers.remote.config import RedisConfig, RemoteConfig, S3Config

__all__ = ["KVTierConfig", "parse_size"]


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """Validated kvtier settings: the core keys, and one slice per tier (`disk`, `redis`, `s3`,
    and `remote` for what the shared tiers share). Each field's help is in its declaration."""

    KEY_PREFIX: ClassVar[str] = ""

    cpu_bytes: int = setting(
        4 * 2**30, size, "Host RAM for the CPU tier, for the whole engine (e.g. 4GiB)."
    )
    blocks_per_chunk: int = setting(
        1, integer(1), "Engine blocks per offloaded chunk, the transfer unit."
    )
    eviction_policy: str = setting(  # within 0.005 of the best on 7 traces at 1/5/20 % (bench_default_policy)
        "adaptive",
        policy,
        "The CPU tier's eviction policy: adaptive, turns, lru, arc or an out-of-tree module:Class.",
    )
    tenant_quotas: tuple[tuple[str, int], ...] = setting(
        (),
        quotas,
        'Bytes of the CPU tier each tenant (cache_salt) may hold, e.g. {"tenant-a": "2GiB", '
        '"*": "512MiB"}: at its quota a tenant evicts its own chunks, never another\'s.',
    )
    store_threshold: int = setting(
        1, integer(1), "Store a chunk only on its N-th offer (1 stores every chunk)."
    )
    offload_prompt_only: bool = setting(False, flag, "Do not store chunks of generated tokens.")
    max_defer_s: float = setting(
        2.0,
        SCHEDULER_CHECKS["max_defer_s"],
        "The longest a request waits for writes of its prefix still in flight.",
    )
    max_deferrals: int = setting(
        4096,
        SCHEDULER_CHECKS["max_deferrals"],
        "A backstop on the steps a request waits (max_defer_s is the bound; an idle engine steps every ~2.5 ms).",
    )
    job_timeout_s: float = setting(
        10.0,
        SCHEDULER_CHECKS["job_timeout_s"],
        "A transfer not done by then is abandoned: a load is recomputed, a store dropped.",
    )
    enable_events: bool = setting(True, flag, "Publish BlockStored and BlockRemoved KV events.")
    promotion_bytes: int = setting(
        256 * 2**20,
        size,
        "The most bytes of chunks being read back from disk, Redis or S3 into RAM at once.",
    )
    load_mode: str = setting(  # sync measured better on vLLM CPU (benchmarks/bench_overlap.py); hybrid models: async
        "sync",
        SCHEDULER_CHECKS["load_mode"],
        "Run a load inside the step (sync) or park its request while it runs and the batch steps on (async).",
    )
    store_mode: str = setting(
        "eager",
        SCHEDULER_CHECKS["store_mode"],
        "Store a chunk once it is computed (eager) or once the engine is about to evict it (lazy).",
    )
    load_policy: str = setting(  # cost: bench_costmodel (benchmarks/README); never slower than recomputing
        "cost",
        SCHEDULER_CHECKS["load_policy"],
        "Load as much of a found prefix as pays off against recomputing it (cost), or all of it (always).",
    )
    disk: DiskConfig = field(default_factory=DiskConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    s3: S3Config = field(default_factory=S3Config)

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_dict(cls, raw: Any) -> KVTierConfig:
        """Validate a user's flat dict; raises ConfigError naming the key and the valid keys."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ConfigError(
                f"kvtier config must be a dict of {cls.valid_keys()}, got {type(raw).__name__}"
            )
        routes = {key: (path, f.name) for key, f, path in slice_fields(cls)}
        unknown = sorted(str(k) for k in raw if k not in routes)
        if unknown:
            raise ConfigError(
                f"unknown kvtier config key(s) {unknown}; valid keys: {cls.valid_keys()}"
            )
        by_slice: dict[tuple[str, ...], dict[str, Any]] = {}
        for key, value in raw.items():
            path, name = routes[key]
            by_slice.setdefault(path, {})[name] = value
        slices = {
            f.name: f.default_factory(**by_slice.get((f.name,), {}))
            for f in fields(cls)
            if "check" not in f.metadata
        }
        return cls(**by_slice.get((), {}), **slices)

    def to_dict(self) -> dict[str, Any]:
        """The user's flat dict of every key (`from_dict`'s inverse)."""
        out = {}
        for key, f, path in slice_fields(type(self)):
            owner = self
            for name in path:
                owner = getattr(owner, name)
            out[key] = getattr(owner, f.name)
        return out

    @classmethod
    def valid_keys(cls) -> list[str]:
        """The user's keys, core keys first, then each slice's."""
        return [key for key, _, _ in slice_fields(cls)]
