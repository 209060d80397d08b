"""The shared tiers' configuration: the user's `redis_*`, `s3_*` and `remote_*` keys (and
`key_secret_file`), checked when built, and the tiers they build.

No secret is ever a configuration value: passwords, S3 keys and the key secret come from files
named here or the environment (`credentials`), read when the tier is built.

A shared tier whose server does not answer at start does not stop the engine: the tier starts
disabled (its breaker open: every lookup a miss) and turns itself on when the server answers,
with a warning either way — unless `redis_required` / `s3_required` asks for a `ConfigError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

from kvtier.costmodel.estimates import ReadEstimate
from kvtier.errors import ConfigError
from kvtier.settings import choice, flag, integer, matching, seconds, setting, size, text, validate
from kvtier.tiers.cascade import WRITE_MODES, TierRules
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.breaker import CircuitBreaker
from kvtier.tiers.remote.credentials import read_s3_credentials, read_secret, redact
from kvtier.tiers.remote.store import RemoteStore
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.secondary import TierDescriptor

__all__ = ["RedisConfig", "RemoteConfig", "S3Config"]

logger = logging.getLogger(__name__)

_MIN_KEY_SECRET_CHARS = 16
_MAX_BREAKER_RETRY_S = 30.0


def _redis_url(key: str, value: Any) -> str | None:
    """A redis:// or rediss:// URL without a password (the message never repeats the URL: it may hold one)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(
            f"{key}: expected a URL like 'redis://host:6379/0', got {type(value).__name__}"
        )
    try:
        url = urlsplit(value)
        url.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise ConfigError(
            f"{key}: not a valid URL; expected 'redis://host:6379/0' or 'rediss://…'"
        ) from None
    if url.scheme not in ("redis", "rediss") or not url.hostname:
        raise ConfigError(f"{key}: expected the scheme redis:// or rediss:// (TLS) and a host")
    if url.password is not None:
        raise ConfigError(
            f"{key} must not contain a password: set the KVTIER_REDIS_PASSWORD environment variable "
            "or name a file holding it in redis_password_file (and the ACL user in redis_username)"
        )
    return value


def _built(make_store: Callable[[], RemoteStore]) -> tuple[RemoteStore | None, Exception | None]:
    """The store, or the error its client raised when built (a cluster's client connects to read
    the slot map); a ConfigError (a bad CA file, …) is the user's and stops the engine."""
    try:
        return make_store(), None
    except ConfigError:
        raise
    except Exception as exc:
        return None, exc


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """What every shared tier shares (user keys `remote_<field>`, and `key_secret_file`)."""

    KEY_PREFIX: ClassVar[str] = "remote_"

    prefix: str = setting(
        "kvtier",
        # not "." or "..": S3 path segments
        matching(r"(?!\.\.?$)[A-Za-z0-9_.-]{1,64}"),
        "The first part of every Redis key and S3 object name.",
    )
    key_mode: str = setting(
        "plain",
        choice("plain", "keyed"),
        "Name and tag values with a deployment secret (keyed) so that no one without it can read names or "
        "inject KV, or not (plain).",
    )
    key_secret_file: str | None = setting(
        None,
        text,
        "A file holding the keyed mode's secret (else KVTIER_KEY_SECRET).",
        key="key_secret_file",
    )
    breaker_failures: int = setting(
        5, integer(1), "Failures in a row that open a shared tier's circuit breaker."
    )
    breaker_retry_s: float = setting(
        1.0,
        seconds(0.01),
        "The first interval between pings while a breaker is open (doubling up to 30 s).",
    )
    max_queue_bytes: int = setting(
        256 * 2**20,
        size,
        "Backpressure: drop writes to a shared tier while this many bytes are queued for it.",
    )

    def __post_init__(self) -> None:
        validate(self)

    def rules(self, write_mode: str, min_offers: int) -> TierRules:
        return TierRules(
            write_mode=write_mode, min_offers=min_offers, max_queue_bytes=self.max_queue_bytes
        )

    def start(
        self,
        medium: str,
        make_store: Callable[[], RemoteStore],
        namespace: Namespace,
        *,
        required: bool,
        enable_events: bool,
    ) -> RemoteTier | None:
        """The shared tier on the store `make_store` builds; None when the client cannot even be
        built (and the tier is not required).

        Raises:
            ConfigError: a required tier's server does not answer; a keyed mode without its secret.
        """
        store, error = _built(make_store)
        if store is not None:
            try:
                store.ping()
            except Exception as exc:
                error = exc
        if error is not None:
            where = store.describe() if store is not None else medium
            message = (
                f"the {medium} tier at {where} did not answer at start "
                f"({type(error).__name__}: {redact(str(error))})"
            )
            if required:
                if store is not None:
                    store.close()
                raise ConfigError(
                    f"{message}; {medium}_required is set, so the engine does not start"
                ) from None
            if store is None:
                logger.warning("kvtier: %s; the engine runs without it", message)
                return None
            logger.warning(
                "kvtier: %s; starting with it disabled (every lookup a miss), retrying in the background "
                "(set %s_required to refuse to start instead)",
                message,
                medium,
            )
        breaker = CircuitBreaker(
            self.breaker_failures,
            self.breaker_retry_s,
            max(self.breaker_retry_s, _MAX_BREAKER_RETRY_S),
        )
        return RemoteTier(
            store,
            namespace,
            prefix=self.prefix,
            key_secret=self._key_secret(),
            breaker=breaker,
            enable_events=enable_events,
            start_open=error is not None,
        )

    def _key_secret(self) -> bytes | None:
        if self.key_mode == "plain":
            return None
        secret = read_secret("key secret", env="KVTIER_KEY_SECRET", file=self.key_secret_file)
        if secret is None or len(secret) < _MIN_KEY_SECRET_CHARS:
            raise ConfigError(
                f"remote_key_mode 'keyed' needs a deployment secret of at least {_MIN_KEY_SECRET_CHARS} "
                "characters in the KVTIER_KEY_SECRET environment variable or a file named by "
                "key_secret_file"
            )
        return secret.encode()


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """A shared Redis / Valkey tier (user keys `redis_<field>`); no `url`: no Redis tier."""

    KEY_PREFIX: ClassVar[str] = "redis_"
    # Redis over 10 GbE, until measured; a reset deletes values it cannot afford to announce
    TIER: ClassVar[TierDescriptor] = TierDescriptor(
        name="redis",
        event_medium="STORAGE",
        locality="REMOTE",
        read_prior=ReadEstimate(1e9, 0.001),
        announces_reset=False,
        sized_by="the Redis server's maxmemory",
    )

    url: str | None = setting(
        None,
        _redis_url,
        "The Redis / Valkey server, redis://host:6379/0 or rediss://… for TLS, never with a "
        "password in it.",
    )
    cluster: bool = setting(
        False, flag, "The URL names one node of a Redis Cluster; the others are discovered."
    )
    username: str | None = setting(None, text, "The ACL user.")
    password_file: str | None = setting(
        None, text, "A file holding the ACL user's password (else KVTIER_REDIS_PASSWORD)."
    )
    ca_file: str | None = setting(
        None, text, "The CA bundle that rediss:// checks the server against."
    )
    ttl_s: float | None = setting(
        None,
        seconds(1.0, optional=True),
        "A time to live on every value, from its last use (a load, or a store "
        "finding it present); without it the server's maxmemory policy evicts.",
    )
    timeout_ms: int = setting(1000, integer(1), "The timeout of each Redis operation.")
    connect_timeout_ms: int = setting(500, integer(1), "The timeout of connecting to Redis.")
    required: bool = setting(
        False,
        flag,
        "Refuse to start when Redis does not answer, instead of starting the tier disabled.",
    )
    write_mode: str = setting(
        "write_through",
        choice(*WRITE_MODES),
        "Which chunks go to Redis: write_through (every chunk stored in RAM) or on_evict (those RAM evicts).",
    )
    min_offers: int = setting(
        1,
        integer(1),
        "Write to Redis only chunks that at least this many requests stored or reused.",
    )

    def __post_init__(self) -> None:
        validate(self)

    @property
    def is_enabled(self) -> bool:
        return self.url is not None

    def build(
        self, namespace: Namespace, *, enable_events: bool, remote: RemoteConfig
    ) -> tuple[RemoteTier, TierRules] | None:
        """The Redis tier (disabled until the server answers) and its rules; None when its client
        cannot be built. Raises ConfigError as `RemoteConfig.start`, or for an unreadable password file."""
        password = read_secret(
            "redis password", env="KVTIER_REDIS_PASSWORD", file=self.password_file
        )

        def make_store() -> RemoteStore:
            from kvtier.tiers.remote.redis import RedisStore

            return RedisStore(
                self.url or "",
                cluster=self.cluster,
                username=self.username,
                password=password,
                ca_file=self.ca_file,
                connect_timeout_ms=self.connect_timeout_ms,
                timeout_ms=self.timeout_ms,
                ttl_s=self.ttl_s,
            )

        tier = remote.start(
            "redis", make_store, namespace, required=self.required, enable_events=enable_events
        )
        if tier is None:
            return None
        return tier, remote.rules(self.write_mode, self.min_offers)


@dataclass(frozen=True, slots=True)
class S3Config:
    """A shared S3-compatible tier (user keys `s3_<field>`); no `endpoint`: no S3 tier."""

    KEY_PREFIX: ClassVar[str] = "s3_"
    # S3 in the same region, until measured; a reset deletes objects it does not announce
    TIER: ClassVar[TierDescriptor] = TierDescriptor(
        name="s3",
        event_medium="STORAGE",
        locality="REMOTE",
        read_prior=ReadEstimate(3e8, 0.03),
        announces_reset=False,
        sized_by="what the S3 bucket keeps",
    )

    endpoint: str | None = setting(
        None,
        matching(r"https?://[^\s/@]+(/[^\s@]*)?"),
        "The S3-compatible endpoint, https://… (or http:// on a trusted network); set with s3_bucket.",
    )
    bucket: str | None = setting(
        None,
        matching(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"),
        "The bucket that holds one object per chunk.",
    )
    region: str = setting("us-east-1", text, "The region requests are signed for.")
    credentials_file: str | None = setting(
        None,
        text,
        "A JSON file with access_key_id and secret_access_key (else AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY).",
    )
    ca_file: str | None = setting(
        None, text, "The CA bundle that https:// checks the endpoint against."
    )
    timeout_ms: int = setting(5000, integer(1), "The timeout of each S3 request.")
    connect_timeout_ms: int = setting(1000, integer(1), "The timeout of connecting to S3.")
    required: bool = setting(
        False,
        flag,
        "Refuse to start when S3 does not answer, instead of starting the tier disabled.",
    )
    write_mode: str = setting(
        "write_through",
        choice(*WRITE_MODES),
        "Which chunks go to S3: write_through (every chunk stored in RAM) or on_evict (those RAM evicts).",
    )
    min_offers: int = setting(
        1, integer(1), "Write to S3 only chunks that at least this many requests stored or reused."
    )

    def __post_init__(self) -> None:
        validate(self)
        if (self.endpoint is None) != (self.bucket is None):
            raise ConfigError(
                "s3_endpoint and s3_bucket go together: set both for an S3 tier, or neither"
            )

    @property
    def is_enabled(self) -> bool:
        return self.endpoint is not None

    def build(
        self, namespace: Namespace, *, enable_events: bool, remote: RemoteConfig
    ) -> tuple[RemoteTier, TierRules] | None:
        """The S3 tier and its rules, as `RedisConfig.build`."""
        key_id, secret = read_s3_credentials(self.credentials_file)

        def make_store() -> RemoteStore:
            from kvtier.tiers.remote.s3 import S3Store

            return S3Store(
                self.endpoint or "",
                self.bucket or "",
                region=self.region,
                access_key_id=key_id,
                secret_access_key=secret,
                ca_file=self.ca_file,
                connect_timeout_ms=self.connect_timeout_ms,
                timeout_ms=self.timeout_ms,
            )

        tier = remote.start(
            "s3", make_store, namespace, required=self.required, enable_events=enable_events
        )
        if tier is None:
            return None
        return tier, remote.rules(self.write_mode, self.min_offers)
