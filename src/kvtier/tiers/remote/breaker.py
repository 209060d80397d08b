"""A circuit breaker for a remote tier: stop asking a server that is down, notice when it is back.

- **closed** (normal): every operation goes to the server; `failures` consecutive failed
  operations (errors or timeouts) open the breaker.
- **open**: the tier answers MISS at once and fails jobs without I/O, so no request waits on a
  dead server; every `retry_s` (doubling up to `max_retry_s` while it stays down) the tier's
  probe thread asks `should_probe()` and pings the server; a ping that succeeds closes it.

One success resets the failure count, so a single slow reply among good ones never opens it.

Thread-safety: every method may be called from any thread (one lock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvtier.errors import ConfigError

__all__ = ["CircuitBreaker"]


class CircuitBreaker:
    """Args:
    failures: consecutive failures that open the breaker.
    retry_s: seconds between pings while open (the first one comes this long after opening).
    max_retry_s: the longest interval between pings (the interval doubles up to it).
    clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        failures: int = 5,
        retry_s: float = 1.0,
        max_retry_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if failures < 1 or not 0 < retry_s <= max_retry_s:
            raise ConfigError(
                f"breaker: failures >= 1 and 0 < retry_s <= max_retry_s, got {failures}, {retry_s}, "
                f"{max_retry_s}"
            )
        self.failures_to_open = failures
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._num_failures = 0
        self._is_open = False
        self._interval = retry_s
        self._next_probe_at = 0.0
        self.num_opens = 0
        self.num_closes = 0

    @property
    def is_open(self) -> bool:
        return self._is_open

    def record_success(self) -> None:
        with self._lock:
            self._num_failures = 0

    def record_failure(self) -> bool:
        """Count one failed operation; True when it opened the breaker."""
        with self._lock:
            self._num_failures += 1
            if self._is_open or self._num_failures < self.failures_to_open:
                return False
            self._is_open = True
            self._interval = self.retry_s
            self._next_probe_at = self._clock() + self._interval
            self.num_opens += 1
            return True

    def open_now(self) -> None:
        """Open at once (the server could not be reached at start)."""
        with self._lock:
            if not self._is_open:
                self._is_open = True
                self._interval = self.retry_s
                self._next_probe_at = self._clock()
                self.num_opens += 1

    def should_probe(self) -> bool:
        """While open: True when it is time for the next ping (and schedules the one after)."""
        with self._lock:
            now = self._clock()
            if not self._is_open or now < self._next_probe_at:
                return False
            self._next_probe_at = now + self._interval
            self._interval = min(self._interval * 2, self.max_retry_s)
            return True

    def probe_succeeded(self) -> bool:
        """A ping answered: close; True when this closed it."""
        with self._lock:
            was_open = self._is_open
            self._is_open = False
            self._num_failures = 0
            self.num_closes += was_open
            return was_open

    def seconds_to_next_probe(self) -> float:
        with self._lock:
            if not self._is_open:
                return self.retry_s
            return max(0.0, self._next_probe_at - self._clock())
