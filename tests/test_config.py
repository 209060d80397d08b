"""kvtier's user configuration: sizes, defaults, and errors that say what to change."""

from __future__ import annotations

import pytest

from kvtier.config import KVTierConfig, parse_size
from kvtier.errors import ConfigError


@pytest.mark.parametrize("text, expected", [
    ("4GiB", 4 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29), ("2GB", 2 * 10**9),
    ("100", 100), (4096, 4096),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["4 furlongs", "", "-1GiB", 0, True, None, 3.5])
def test_bad_sizes_say_what_is_expected(bad):
    with pytest.raises(ConfigError, match="size like '4GiB'|must be positive"):
        parse_size(bad, "cpu_bytes")


def test_defaults_and_a_full_config():
    assert KVTierConfig.from_dict(None) == KVTierConfig()
    cfg = KVTierConfig.from_dict({"cpu_bytes": "1GiB", "blocks_per_chunk": 4, "eviction_policy": "arc",
                                  "store_threshold": 2, "offload_prompt_only": True, "max_defer_s": 0.5,
                                  "max_deferrals": 8, "enable_events": False})
    assert (cfg.cpu_bytes, cfg.blocks_per_chunk, cfg.eviction_policy, cfg.max_defer_s) == (2**30, 4, "arc", 0.5)


def test_a_disk_tier_config():
    cfg = KVTierConfig.from_dict({"disk_path": "/var/cache/kvtier", "disk_bytes": "2TiB", "disk_fsync": True,
                                  "disk_direct_io": False, "disk_write_mode": "on_evict", "disk_min_offers": 2,
                                  "disk_max_queue_bytes": "64MiB", "promotion_bytes": "1GiB", "disk_rescan_s": 30})
    assert (cfg.disk_path, cfg.disk_bytes, cfg.disk_direct_io, cfg.disk_write_mode) == (
        "/var/cache/kvtier", 2 * 2**40, False, "on_evict")
    assert cfg.disk_rescan_s == 30.0
    assert KVTierConfig().disk_path is None  # no disk tier unless asked for


def test_unknown_key_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown kvtier config key\(s\) \['cpu_byte'\]; valid keys: \['cpu_bytes'"):
        KVTierConfig.from_dict({"cpu_byte": "4GiB"})


@pytest.mark.parametrize("key, value, message", [
    ("blocks_per_chunk", 0, "blocks_per_chunk: expected an integer >= 1"),
    ("blocks_per_chunk", "2", "blocks_per_chunk: expected an integer >= 1"),
    ("eviction_policy", "fifo", r"eviction_policy: expected one of \['arc', 'lru'\]"),
    ("offload_prompt_only", "yes", "offload_prompt_only: expected true or false"),
    ("max_defer_s", -1, "max_defer_s: expected seconds >= 0"),
    ("disk_path", "", "disk_path: expected a directory path"),
    ("disk_path", 7, "disk_path: expected a directory path"),
    ("disk_bytes", "lots", "disk_bytes: expected a size"),
    ("disk_direct_io", "yes", r"disk_direct_io: expected one of \['auto', True, False\]"),
    ("disk_write_mode", "later", r"disk_write_mode: expected one of \['write_through', 'on_evict'\]"),
    ("disk_min_offers", 0, "disk_min_offers: expected an integer >= 1"),
    ("disk_max_store_s", 0, "disk_max_store_s: expected seconds >= 0.001"),
    ("promotion_bytes", -5, "promotion_bytes: "),
    ("disk_rescan_s", "often", "disk_rescan_s: expected seconds"),
])
def test_bad_values_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        KVTierConfig.from_dict({key: value})


def test_not_a_dict():
    with pytest.raises(ConfigError, match="must be a dict"):
        KVTierConfig.from_dict(["cpu_bytes"])
