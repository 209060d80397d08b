"""Starting the shared tiers from a configuration: secrets from files or the environment only,
a server that does not answer (or refuses the password) at start, and no secret in any log."""

from __future__ import annotations

import logging
import time

import pytest

from helpers import HANG_S, keys
from kvtier.base import LookupResult
from kvtier.build import secondary_tiers
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.tier import RemoteTier
from redis_servers import RedisServer, free_port

# must never appear in a log line or an error
PLANTED = "planted-secret-7f3a9c"


def namespace() -> Namespace:
    return Namespace(
        f"build-{time.monotonic_ns()}", "float16", "blocks", 16, 4, "sha256_cbor", 1, 4096
    )


def start(cfg: dict) -> list[RemoteTier]:
    tiers = [t for t, _ in secondary_tiers(KVTierConfig.from_dict(cfg), namespace())]
    assert all(isinstance(t, RemoteTier) for t in tiers)
    return tiers  # type: ignore[return-value]


def close(tiers: list[RemoteTier]) -> None:
    for tier in tiers:
        tier.close()


def test_an_acl_user_with_its_password_from_a_file(redis_server_acl, tmp_path):
    secret_file = tmp_path / "redis-password"
    secret_file.write_text(redis_server_acl.password + "\n")
    secret_file.chmod(0o600)
    tiers = start(
        {
            "redis_url": redis_server_acl.url,
            "redis_username": redis_server_acl.username,
            "redis_password_file": str(secret_file),
        }
    )
    try:
        assert not tiers[0].breaker.is_open
        # a probe runs: the server answers
        assert tiers[0].lookup(keys(1)[0]) is LookupResult.RETRY
    finally:
        close(tiers)


def test_the_password_from_the_environment(redis_server_acl, monkeypatch):
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", redis_server_acl.password)
    tiers = start({"redis_url": redis_server_acl.url, "redis_username": redis_server_acl.username})
    try:
        assert not tiers[0].breaker.is_open
    finally:
        close(tiers)


def test_a_wrong_password_starts_the_tier_disabled_with_a_warning_and_no_secret_in_it(
    redis_server_acl, monkeypatch, caplog
):
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", PLANTED)
    with caplog.at_level(logging.DEBUG):
        tiers = start(
            {"redis_url": redis_server_acl.url, "redis_username": redis_server_acl.username}
        )
    try:
        assert tiers[0].breaker.is_open
        # disabled: misses, never a wait
        assert tiers[0].lookup(keys(1)[0]) is LookupResult.MISS
        assert "did not answer at start" in caplog.text and "disabled" in caplog.text
        assert PLANTED not in caplog.text
        assert PLANTED not in repr(tiers[0].stats()) and PLANTED not in tiers[0].store.describe()
    finally:
        close(tiers)


def test_a_wrong_password_with_redis_required_stops_the_start(redis_server_acl, monkeypatch):
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", PLANTED)
    with pytest.raises(ConfigError, match="redis_required is set") as err:
        start(
            {
                "redis_url": redis_server_acl.url,
                "redis_username": redis_server_acl.username,
                "redis_required": True,
            }
        )
    assert PLANTED not in str(err.value)


def test_an_unreachable_server_turns_the_tier_on_once_it_answers(tmp_path, caplog):
    # nothing listens on its port yet
    server = RedisServer(port=free_port(), dir=tmp_path)
    tiers = start(
        {"redis_url": server.url, "redis_connect_timeout_ms": 100, "remote_breaker_retry_s": 0.05}
    )
    try:
        assert tiers[0].breaker.is_open and "did not answer at start" in caplog.text
        server.start()
        deadline = time.monotonic() + HANG_S
        while tiers[0].breaker.is_open and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not tiers[0].breaker.is_open
        assert "answers again" in caplog.text
    finally:
        close(tiers)
        server.stop()


def test_an_unreachable_required_server_stops_the_start():
    with pytest.raises(ConfigError, match="did not answer at start.*redis_required is set"):
        start(
            {
                "redis_url": f"redis://127.0.0.1:{free_port()}/0",
                "redis_connect_timeout_ms": 100,
                "redis_required": True,
            }
        )


def test_an_unreadable_password_file_names_the_file_not_a_secret(tmp_path):
    with pytest.raises(ConfigError, match="cannot read .*missing"):
        start(
            {"redis_url": "redis://127.0.0.1:1/0", "redis_password_file": str(tmp_path / "missing")}
        )


def test_keyed_mode_needs_a_long_enough_secret(monkeypatch, redis_server):
    monkeypatch.setenv("KVTIER_KEY_SECRET", "short")
    with pytest.raises(ConfigError, match="keyed.*16 characters"):
        start({"redis_url": redis_server.url, "remote_key_mode": "keyed"})
    monkeypatch.setenv("KVTIER_KEY_SECRET", PLANTED * 2)
    tiers = start({"redis_url": redis_server.url, "remote_key_mode": "keyed"})
    try:
        assert tiers[0].codec.is_keyed
    finally:
        close(tiers)
