"""Secrets for the shared tiers: read from a file or the environment, never from config text,
and kept out of every log line and error message.

- `read_secret(what, env=..., file=...)`: the file named in the config when given (its last
  newline stripped), else the environment variable, else None. A file that others may read
  gets a warning (the secret is as safe as its file). Every secret read is remembered so that
  `redact(text)` can replace it with "***" in any message built from a client's exception.
- `read_s3_credentials(file)`: an access key id and secret from a JSON file
  (`{"access_key_id": …, "secret_access_key": …}`) or from `AWS_ACCESS_KEY_ID` /
  `AWS_SECRET_ACCESS_KEY`.

Thread-safety: `read_*` run at engine start; `redact` may be called from any thread.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading

from kvtier.errors import ConfigError

__all__ = ["read_s3_credentials", "read_secret", "redact"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_secrets: set[str] = set()


def read_secret(what: str, *, env: str | None = None, file: str | None = None) -> str | None:
    """The secret `what` from `file` (when given) or the environment variable `env`.

    Raises:
        ConfigError: `file` is given but cannot be read or is empty (the message names the
            file, never its content).
    """
    if file is not None:
        secret = _read_file(what, file).rstrip("\r\n")
        if not secret:
            raise ConfigError(f"{what}: the file {file} is empty")
    else:
        secret = os.environ.get(env or "", "") or None
    if secret is not None:
        with _lock:
            _secrets.add(secret)
    return secret


def read_s3_credentials(file: str | None) -> tuple[str | None, str | None]:
    """(access key id, secret access key) from a JSON `file`, else the AWS_* environment variables."""
    if file is None:
        key_id = os.environ.get("AWS_ACCESS_KEY_ID") or None
        return key_id, read_secret("S3 secret access key", env="AWS_SECRET_ACCESS_KEY")
    try:
        data = json.loads(_read_file("s3_credentials_file", file))
        key_id, secret = data["access_key_id"], data["secret_access_key"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"s3_credentials_file {file}: expected JSON with string fields access_key_id and "
            f"secret_access_key ({type(exc).__name__})"
        ) from None
    if not isinstance(key_id, str) or not isinstance(secret, str) or not secret:
        raise ConfigError(
            f"s3_credentials_file {file}: access_key_id and secret_access_key must be non-empty strings"
        )
    with _lock:
        _secrets.add(secret)
    return key_id, secret


def redact(text: str) -> str:
    """`text` with every secret read so far replaced by "***"."""
    with _lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def _read_file(what: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            content = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{what}: cannot read {path}: {reason}") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning(
            "kvtier: %s is readable by other users (mode %o); chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
    return content
