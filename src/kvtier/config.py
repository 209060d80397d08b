"""kvtier's user-facing configuration (`kv_connector_extra_config` in vLLM).

The user writes one flat dict; each key goes to the slice that owns it — the core keys here,
`disk_*` to `DiskConfig`, `redis_*` / `s3_*` / `remote_*` to the shared tiers' slices, an
out-of-tree tier's keys to the slice `extra_tiers` names ("module:Class", imported and registered
in `kvtier.tiers.registry`) — and every slice checks its own values when it is built, however it
is built. An unknown key or a bad value is a `ConfigError` that names the key, what was wrong,
and the valid keys.

    {"cpu_bytes": "4GiB", "blocks_per_chunk": 1, "eviction_policy": "lru", "disk_path": "/var/kvtier"}
    {"extra_tiers": ["my_tiers.memcached:MemcachedConfig"], "memcached_servers": "10.0.0.5:11211"}
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import Field, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

from kvtier.errors import ConfigError
from kvtier.scheduler.config import CHECKS as SCHEDULER_CHECKS
from kvtier.settings import (
    flag,
    integer,
    matching,
    parse_size,
    policy,
    quotas,
    setting,
    size,
    slice_fields,
    validate,
)
from kvtier.tiers.disk.config import DiskConfig
from kvtier.tiers.registry import check_registrable, import_tier, load_tier
from kvtier.tiers.remote.config import RedisConfig, RemoteConfig, S3Config

__all__ = ["KVTierConfig", "parse_size"]

_TIER_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
# what routes a user key: the path of a built-in slice (() for a core key), or an out-of-tree
# tier's slice class
Owner = tuple[str, ...] | type


def _tier_specs(key: str, value: Any) -> tuple[str, ...]:
    """Out-of-tree tiers' slices, each "module:Class": a list, or a comma-separated text (a flag);
    () for none."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    is_list = isinstance(value, (list, tuple))
    if not is_list or not all(isinstance(v, str) and _TIER_SPEC.fullmatch(v) for v in value):
        raise ConfigError(
            f"{key}: expected a list of 'module:Class' names of tiers' configuration slices, "
            f"got {value!r:.200}"
        )
    if len(set(value)) != len(value):
        raise ConfigError(f"{key}: names a tier twice: {list(value)}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """Validated kvtier settings: the core keys, one slice per built-in tier (`disk`, `redis`,
    `s3`, and `remote` for what the shared tiers share), and the slices of the out-of-tree tiers
    `extra_tiers` names (`extra_slices`). Each field's help is in its declaration."""

    KEY_PREFIX: ClassVar[str] = ""

    cpu_bytes: int = setting(
        4 * 2**30, size, "Host RAM for the CPU tier, for the whole engine (e.g. 4GiB)."
    )
    blocks_per_chunk: int = setting(
        1, integer(1), "Engine blocks per offloaded chunk, the transfer unit."
    )
    # within 0.005 of the best on 7 traces at 1/5/20 % (bench_default_policy)
    eviction_policy: str = setting(
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
    # sync measured better on vLLM CPU (benchmarks/bench_overlap.py); hybrid models: async
    load_mode: str = setting(
        "sync",
        SCHEDULER_CHECKS["load_mode"],
        "Run a load inside the step (sync) or park its request while it runs and the batch steps on (async).",
    )
    store_mode: str = setting(
        "eager",
        SCHEDULER_CHECKS["store_mode"],
        "Store a chunk once it is computed (eager) or once the engine is about to evict it (lazy).",
    )
    # cost: bench_costmodel (benchmarks/README); never slower than recomputing
    load_policy: str = setting(
        "cost",
        SCHEDULER_CHECKS["load_policy"],
        "Load as much of a found prefix as pays off against recomputing it (cost), or all of it (always).",
    )
    handoff_tier: str | None = setting(
        None,
        matching(r"[a-z][a-z0-9_]{0,31}"),
        "Disaggregated prefill: the tier a prefill engine hands a prompt's chunks over in (redis, "
        "s3, disk); default: the first shared tier configured.",
    )
    handoff_wait_s: float = setting(
        5.0,
        SCHEDULER_CHECKS["handoff_wait_s"],
        "Disaggregated prefill: the longest a decode engine waits for chunks a prefill engine promised.",
    )
    consumer_stores: bool = setting(
        False,
        flag,
        "With kv_role kv_consumer, store what this engine computes too (a consumer only loads by default).",
    )
    extra_tiers: tuple[str, ...] = setting(
        (),
        _tier_specs,
        "Out-of-tree tiers: the 'module:Class' of each one's configuration slice (README, "
        "Adding a tier), imported and registered; its own keys then configure it.",
    )
    disk: DiskConfig = field(default_factory=DiskConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    s3: S3Config = field(default_factory=S3Config)
    # the slices of the tiers `extra_tiers` names, in its order (a tier not given one gets its
    # defaults); not a user key: their keys are
    extra_slices: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        validate(self)
        classes = [load_tier(spec) for spec in self.extra_tiers]
        # every refusal (a key or a name taken, a slice not named) before any registration,
        # however the configuration is built: a refused one leaves the registry as it was
        _routes(type(self), classes)
        extra_slices = _extra_slices(classes, self.extra_slices)
        check_registrable(classes)
        for spec in self.extra_tiers:
            import_tier(spec)
        object.__setattr__(self, "extra_slices", extra_slices)

    @classmethod
    def from_dict(cls, raw: Any) -> KVTierConfig:
        """Validate a user's flat dict; raises ConfigError naming the key and the valid keys."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ConfigError(
                f"kvtier config must be a dict of {cls.valid_keys()}, got {type(raw).__name__}"
            )
        # the out-of-tree tiers first: their keys are valid keys. An unknown key is said first,
        # with why extra_tiers was refused if it was (the keys may be that tier's)
        classes: list[type] = []
        refused: ConfigError | None = None
        try:
            specs = _tier_specs("extra_tiers", raw.get("extra_tiers", ()))
            classes = [load_tier(spec) for spec in specs]
        except ConfigError as exc:
            refused = exc
        routes = _routes(cls, classes)
        unknown = sorted(str(k) for k in raw if k not in routes)
        if unknown:
            why = ""
            if refused is not None:
                why = f" (they may be an extra tier's, and {refused})"
            raise ConfigError(
                f"unknown kvtier config key(s) {unknown}{why}; valid keys: {list(routes)}"
            )
        if refused is not None:
            raise refused
        by_owner: dict[Owner, dict[str, Any]] = {}
        for key, value in raw.items():
            owner, name = routes[key]
            by_owner.setdefault(owner, {})[name] = value
        slices = {
            f.name: f.default_factory(**by_owner.get((f.name,), {})) for f in _slice_fields(cls)
        }
        extra = tuple(c(**by_owner.get(c, {})) for c in classes)
        return cls(**by_owner.get((), {}), **slices, extra_slices=extra)

    def to_dict(self) -> dict[str, Any]:
        """The user's flat dict of every key (`from_dict`'s inverse)."""
        out = {}
        for key, f, path in slice_fields(type(self)):
            owner = self
            for name in path:
                owner = getattr(owner, name)
            out[key] = getattr(owner, f.name)
        for tier in self.extra_slices:
            for key, f, _ in slice_fields(type(tier)):
                out[key] = getattr(tier, f.name)
        return out

    @classmethod
    def valid_keys(cls) -> list[str]:
        """The user's keys, core keys first, then each built-in slice's (an out-of-tree tier's
        keys are valid once `extra_tiers` names it)."""
        return [key for key, _, _ in slice_fields(cls)]

    def tier_configs(self) -> list[Any]:
        """Every secondary tier's slice, in the order a lookup asks the tiers: the built-in ones
        (the fields whose slice has a `TIER` descriptor), then the out-of-tree ones."""
        built_in = [getattr(self, f.name) for f in _slice_fields(type(self))]
        return [s for s in built_in if hasattr(s, "TIER")] + list(self.extra_slices)


def _slice_fields(cls: type) -> Iterator[Field]:
    """The fields of `cls` that hold a built-in slice."""
    return (f for f in fields(cls) if is_dataclass(f.default_factory))


def _routes(cls: type, classes: Sequence[type]) -> dict[str, tuple[Owner, str]]:
    """Every user key -> (its owner, its field's name), the out-of-tree tiers' `classes` last.

    Raises:
        ConfigError: an out-of-tree tier's key is taken already.
    """
    routes: dict[str, tuple[Owner, str]] = {
        key: (path, f.name) for key, f, path in slice_fields(cls)
    }
    for tier in classes:
        for key, f, _ in slice_fields(tier):
            if key in routes:
                raise ConfigError(
                    f"extra_tiers: key {key!r} of {tier.__qualname__} is taken already; give the "
                    "slice a KEY_PREFIX of its own"
                )
            routes[key] = (tier, f.name)
    return routes


def _extra_slices(classes: Sequence[type], given: Sequence[Any]) -> tuple[Any, ...]:
    """One slice per class of `classes`: the one of that class in `given`, else its defaults.

    Raises:
        ConfigError: a slice in `given` of a class `extra_tiers` does not name, or two of one.
    """
    by_class: dict[type, Any] = {}
    for tier in given:
        if type(tier) not in classes or type(tier) in by_class:
            raise ConfigError(
                f"extra_slices: {type(tier).__qualname__} is not named once in extra_tiers"
            )
        by_class[type(tier)] = tier
    out = []
    for c in classes:
        if c in by_class:
            out.append(by_class[c])
        else:
            out.append(c())
    return tuple(out)
