"""Warnings a tier logs at most once a minute per kind: a full disk or a dead server fails
every operation, and the counters (`stats()`) already count each one.

Thread-safety: `log_once` may be called from any thread (its own lock guards the rate limit).
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["RateLimitedLog"]

_LOG_EVERY_S = 60.0


class RateLimitedLog:
    """Args: logger: where the warnings go."""

    def __init__(self, logger: logging.Logger):
        self._logger = logger
        self._lock = threading.Lock()
        self._last_logged: dict[str, float] = {}

    def log_once(self, kind: str, message: str) -> None:
        """Log `message` unless a message of `kind` was logged less than a minute ago."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_logged.get(kind, -_LOG_EVERY_S) < _LOG_EVERY_S:
                return
            self._last_logged[kind] = now
        self._logger.warning(
            "%s (such failures are logged once a minute; counted in stats())", message
        )
