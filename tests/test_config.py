"""kvtier's user configuration: sizes, defaults, and errors that say what to change."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.config import KVTierConfig, parse_size
from kvtier.errors import ConfigError
from kvtier.settings import slice_fields
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.disk.config import DiskConfig


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4GiB", 4 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2GB", 2 * 10**9),
        ("100", 100),
        (4096, 4096),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["4 furlongs", "", "-1GiB", 0, True, None, 3.5])
def test_bad_sizes_say_what_is_expected(bad):
    with pytest.raises(ConfigError, match="size like '4GiB'|must be positive"):
        parse_size(bad, "cpu_bytes")


def test_defaults_and_a_full_config():
    assert KVTierConfig.from_dict(None) == KVTierConfig()
    cfg = KVTierConfig.from_dict(
        {
            "cpu_bytes": "1GiB",
            "blocks_per_chunk": 4,
            "eviction_policy": "arc",
            "store_threshold": 2,
            "offload_prompt_only": True,
            "max_defer_s": 0.5,
            "max_deferrals": 8,
            "enable_events": False,
        }
    )
    assert (cfg.cpu_bytes, cfg.blocks_per_chunk, cfg.eviction_policy, cfg.max_defer_s) == (
        2**30,
        4,
        "arc",
        0.5,
    )


def test_a_disk_tier_config():
    cfg = KVTierConfig.from_dict(
        {
            "disk_path": "/var/cache/kvtier",
            "disk_bytes": "2TiB",
            "disk_fsync": True,
            "disk_direct_io": False,
            "disk_write_mode": "on_evict",
            "disk_min_offers": 2,
            "disk_max_queue_bytes": "64MiB",
            "promotion_bytes": "1GiB",
            "disk_rescan_s": 30,
        }
    )
    assert (cfg.disk.path, cfg.disk.bytes, cfg.disk.direct_io, cfg.disk.write_mode) == (
        "/var/cache/kvtier",
        2 * 2**40,
        False,
        "on_evict",
    )
    assert cfg.disk.rescan_s == 30.0 and cfg.promotion_bytes == 2**30
    assert cfg.disk.rules() == TierRules(
        write_mode="on_evict", min_offers=2, max_queue_bytes=64 * 2**20
    )
    # no disk tier unless asked for
    assert not KVTierConfig().disk.is_enabled


def test_unknown_key_lists_the_valid_ones():
    with pytest.raises(
        ConfigError,
        match=r"unknown kvtier config key\(s\) \['cpu_byte'\]; valid keys: \['cpu_bytes'",
    ):
        KVTierConfig.from_dict({"cpu_byte": "4GiB"})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("blocks_per_chunk", 0, "blocks_per_chunk: expected an integer >= 1"),
        ("blocks_per_chunk", "2", "blocks_per_chunk: expected an integer >= 1"),
        (
            "eviction_policy",
            "fifo",
            r"eviction_policy: expected one of \['adaptive', 'arc', 'lru', 'turns'\]",
        ),
        ("offload_prompt_only", "yes", "offload_prompt_only: expected true or false"),
        ("max_defer_s", -1, "max_defer_s: expected seconds >= 0"),
        ("disk_path", "", "disk_path: expected a non-empty string"),
        ("disk_path", 7, "disk_path: expected a non-empty string"),
        ("disk_bytes", "lots", "disk_bytes: expected a size"),
        ("disk_direct_io", "yes", r"disk_direct_io: expected one of \['auto', True, False\]"),
        (
            "disk_write_mode",
            "later",
            r"disk_write_mode: expected one of \['write_through', 'on_evict'\]",
        ),
        ("disk_min_offers", 0, "disk_min_offers: expected an integer >= 1"),
        ("disk_max_store_s", 0, "disk_max_store_s: expected seconds >= 0.001"),
        ("promotion_bytes", -5, "promotion_bytes: "),
        ("disk_rescan_s", "often", "disk_rescan_s: expected seconds"),
        (
            "redis_url",
            "http://localhost:6379",
            "redis_url: expected the scheme redis:// or rediss://",
        ),
        ("redis_url", "redis://host:notaport", "redis_url: not a valid URL"),
        ("redis_url", 6379, "redis_url: expected a URL"),
        ("redis_timeout_ms", 0, "redis_timeout_ms: expected an integer >= 1"),
        ("redis_ttl_s", 0.5, "redis_ttl_s: expected seconds >= 1"),
        (
            "redis_write_mode",
            "eager",
            r"redis_write_mode: expected one of \['write_through', 'on_evict'\]",
        ),
        ("s3_bucket", "Bad_Bucket", "s3_bucket: expected a string matching"),
        ("s3_endpoint", "ftp://host", "s3_endpoint: expected a string matching"),
        ("remote_prefix", "a:b", "remote_prefix: expected a string matching"),
        ("remote_key_mode", "hmac", r"remote_key_mode: expected one of \['plain', 'keyed'\]"),
        ("remote_breaker_failures", 0, "remote_breaker_failures: expected an integer >= 1"),
        ("redis_password_file", "", "redis_password_file: expected a non-empty string"),
    ],
)
def test_bad_values_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        KVTierConfig.from_dict({key: value})
    # however the configuration is built: the slice's constructor, or a replaced field
    path, name = ROUTES[key]
    owner = _slice_class(path)
    with pytest.raises(ConfigError, match=message):
        owner(**{name: value})
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(owner(), **{name: value})


ROUTES = {key: (path, f.name) for key, f, path in slice_fields(KVTierConfig)}


def _slice_class(path: tuple[str, ...]) -> type:
    cls = KVTierConfig
    for name in path:
        cls = {f.name: f.default_factory for f in dataclasses.fields(cls)}[name]
    return cls


def test_the_constructor_checks_like_from_dict():
    with pytest.raises(ConfigError, match="cpu_bytes: must be positive"):
        KVTierConfig(cpu_bytes=-1)
    with pytest.raises(ConfigError, match="disk_bytes: expected a size"):
        KVTierConfig(disk=DiskConfig(path="/x", bytes="lots"))
    # kept as bytes, as from_dict keeps it
    assert KVTierConfig(cpu_bytes="1GiB").cpu_bytes == 2**30


def test_every_key_has_a_whole_sentence_of_help_and_a_valid_default():
    keys = KVTierConfig.valid_keys()
    assert len(keys) == len(set(keys)) == 57
    for key, f, _ in slice_fields(KVTierConfig):
        text = f.metadata["help"]
        assert text[0].isupper() and text.endswith("."), key
    assert KVTierConfig.from_dict({}) == KVTierConfig()
    assert KVTierConfig.from_dict(KVTierConfig().to_dict()) == KVTierConfig()


def test_not_a_dict():
    with pytest.raises(ConfigError, match="must be a dict"):
        KVTierConfig.from_dict(["cpu_bytes"])


def test_a_password_in_redis_url_is_refused_without_repeating_it():
    # the URL is the one place a user might paste a secret: the error says where it belongs instead
    with pytest.raises(ConfigError, match="KVTIER_REDIS_PASSWORD") as err:
        KVTierConfig.from_dict({"redis_url": "redis://app:hunter2-planted@127.0.0.1:6379/0"})
    assert "hunter2-planted" not in str(err.value)


def test_shared_tier_keys_are_accepted():
    cfg = KVTierConfig.from_dict(
        {
            "redis_url": "rediss://cache.internal:6380/0",
            "redis_cluster": True,
            "redis_username": "kvtier",
            "redis_password_file": "/run/secrets/redis",
            "redis_ttl_s": 3600,
            "s3_endpoint": "https://s3.internal:9000",
            "s3_bucket": "kv-cache",
            "remote_key_mode": "keyed",
            "key_secret_file": "/run/secrets/kvtier-key",
        }
    )
    assert (
        cfg.redis.ttl_s == 3600.0 and cfg.s3.bucket == "kv-cache" and cfg.remote.key_mode == "keyed"
    )
    assert (
        cfg.remote.key_secret_file == "/run/secrets/kvtier-key"
        and cfg.redis.is_enabled
        and cfg.s3.is_enabled
    )


def test_s3_endpoint_and_bucket_go_together():
    with pytest.raises(ConfigError, match="s3_endpoint and s3_bucket go together"):
        KVTierConfig.from_dict({"s3_endpoint": "http://127.0.0.1:8333"})
