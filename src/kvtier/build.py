"""The manager a configuration asks for: the CPU tier alone, or a `TieredManager` with the
secondary tiers the configuration names (disk, Redis, S3, searched in that order).
Engine-agnostic: the engine adapter brings the slab rows and the namespace.

A shared tier whose server does not answer at start does not stop the engine: the tier
starts disabled (its breaker open: every lookup a miss) and turns itself on when the server
answers, with a warning either way — unless `redis_required` / `s3_required` asks for a
`ConfigError` instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.base import OffloadingManager
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.breaker import CircuitBreaker
from kvtier.tiers.remote.credentials import read_s3_credentials, read_secret, redact
from kvtier.tiers.remote.store import RemoteStore
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.secondary import SecondaryTier
from kvtier.tiers.tiered import TieredManager

__all__ = ["build_manager", "secondary_tiers"]

logger = logging.getLogger(__name__)

_MIN_KEY_SECRET_CHARS = 16


def secondary_tiers(cfg: KVTierConfig, namespace: Namespace) -> list[tuple[SecondaryTier, TierRules]]:
    """The configured secondary tiers, in lookup order, each with its cascade rules.

    Raises:
        ConfigError: a tier that cannot start (a disk directory that cannot be created, a
            secret file that cannot be read, a required shared tier that does not answer).
    """
    tiers: list[tuple[SecondaryTier, TierRules]] = []
    if cfg.disk_path is not None:
        from kvtier.tiers.disk.tier import DiskTier

        direct = None if cfg.disk_direct_io == "auto" else bool(cfg.disk_direct_io)
        disk = DiskTier(cfg.disk_path, namespace, cfg.disk_bytes, policy=cfg.disk_eviction_policy,
                        fsync=cfg.disk_fsync, direct_io=direct, enable_events=cfg.enable_events,
                        rescan_s=cfg.disk_rescan_s, file_mode=int(cfg.disk_file_mode, 8))
        rules = TierRules(write_mode=cfg.disk_write_mode, min_offers=cfg.disk_min_offers,
                          max_queue_bytes=cfg.disk_max_queue_bytes, max_store_seconds=cfg.disk_max_store_s)
        tiers.append((disk, rules))
    for store, required_key, rules in _remote_stores(cfg):
        tier = _start_remote(store, cfg, namespace, required=getattr(cfg, required_key), required_key=required_key)
        if tier is not None:
            tiers.append((tier, rules))
    return tiers


def build_manager(cfg: KVTierConfig, num_slots: int, key_bytes: int, slabs: Sequence[np.ndarray],
                  namespace: Namespace) -> OffloadingManager:
    """The CPU tier, behind a `TieredManager` when secondary tiers are configured."""
    primary = CPUTierManager(num_slots, policy=cfg.eviction_policy, store_threshold=cfg.store_threshold,
                             enable_events=cfg.enable_events, key_bytes=key_bytes)
    tiers = secondary_tiers(cfg, namespace)
    if not tiers:
        return primary
    return TieredManager(primary, slabs, tiers, max_promotion_bytes=cfg.promotion_bytes,
                         job_timeout_s=cfg.job_timeout_s)


def _remote_stores(cfg: KVTierConfig) -> list[tuple[RemoteStore | Exception, str, TierRules]]:
    """The configured shared stores (or the error their client raised when built)."""
    stores: list[tuple[RemoteStore | Exception, str, TierRules]] = []
    if cfg.redis_url is not None:
        password = read_secret("redis password", env="KVTIER_REDIS_PASSWORD", file=cfg.redis_password_file)
        stores.append((_build(lambda: _redis_store(cfg, password)), "redis_required",
                       _remote_rules(cfg.redis_write_mode, cfg.redis_min_offers, cfg)))
    if cfg.s3_endpoint is not None:
        key_id, secret = read_s3_credentials(cfg.s3_credentials_file)
        stores.append((_build(lambda: _s3_store(cfg, key_id, secret)), "s3_required",
                       _remote_rules(cfg.s3_write_mode, cfg.s3_min_offers, cfg)))
    return stores


def _redis_store(cfg: KVTierConfig, password: str | None) -> RemoteStore:
    from kvtier.tiers.remote.redis import RedisStore

    return RedisStore(cfg.redis_url or "", cluster=cfg.redis_cluster, username=cfg.redis_username, password=password,
                      ca_file=cfg.redis_ca_file, connect_timeout_ms=cfg.redis_connect_timeout_ms,
                      timeout_ms=cfg.redis_timeout_ms, ttl_s=cfg.redis_ttl_s)


def _s3_store(cfg: KVTierConfig, key_id: str | None, secret: str | None) -> RemoteStore:
    from kvtier.tiers.remote.s3 import S3Store

    return S3Store(cfg.s3_endpoint or "", cfg.s3_bucket or "", region=cfg.s3_region, access_key_id=key_id,
                   secret_access_key=secret, ca_file=cfg.s3_ca_file, connect_timeout_ms=cfg.s3_connect_timeout_ms,
                   timeout_ms=cfg.s3_timeout_ms)


def _build(make: Callable[[], RemoteStore]) -> RemoteStore | Exception:
    try:
        return make()
    except ConfigError:
        raise
    except Exception as exc:  # a client that connects when built (a cluster's slot map)
        return exc


def _remote_rules(write_mode: str, min_offers: int, cfg: KVTierConfig) -> TierRules:
    return TierRules(write_mode=write_mode, min_offers=min_offers, max_queue_bytes=cfg.remote_max_queue_bytes)


def _start_remote(store: RemoteStore | Exception, cfg: KVTierConfig, namespace: Namespace, *, required: bool,
                  required_key: str) -> RemoteTier | None:
    medium = required_key.removesuffix("_required")
    try:
        if isinstance(store, Exception):
            raise store
        store.ping()
        is_up = True
    except Exception as exc:
        where = store.describe() if isinstance(store, RemoteStore) else medium
        message = f"the {medium} tier at {where} did not answer at start ({type(exc).__name__}: {redact(str(exc))})"
        if required:
            if isinstance(store, RemoteStore):
                store.close()
            raise ConfigError(f"{message}; {required_key} is set, so the engine does not start") from None
        if not isinstance(store, RemoteStore):
            logger.warning("kvtier: %s; the engine runs without it", message)
            return None
        logger.warning("kvtier: %s; starting with it disabled (every lookup a miss), retrying in the background "
                       "(set %s to refuse to start instead)", message, required_key)
        is_up = False
    breaker = CircuitBreaker(cfg.remote_breaker_failures, cfg.remote_breaker_retry_s,
                             max(cfg.remote_breaker_retry_s, 30.0))
    return RemoteTier(store, namespace, prefix=cfg.remote_prefix, key_secret=_key_secret(cfg), breaker=breaker,
                      enable_events=cfg.enable_events, start_open=not is_up)


def _key_secret(cfg: KVTierConfig) -> bytes | None:
    if cfg.remote_key_mode == "plain":
        return None
    secret = read_secret("key secret", env="KVTIER_KEY_SECRET", file=cfg.key_secret_file)
    if secret is None or len(secret) < _MIN_KEY_SECRET_CHARS:
        raise ConfigError(f"remote_key_mode 'keyed' needs a deployment secret of at least {_MIN_KEY_SECRET_CHARS} "
                          "characters in the KVTIER_KEY_SECRET environment variable or a file named by key_secret_file")
    return secret.encode()
