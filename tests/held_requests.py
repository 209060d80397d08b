"""Faults for the remote-store tests, placed under kvtier's store classes, never in them:

- `HeldRequests`: obstore's `put` or `get` (the client library a real `S3Store` calls once per
  request) made to fail at once for one name and to wait for `release()` for another, so that a
  batch has one failed request and one still running, in that order, on purpose.
- `HeldCall`: a store method (a real `RedisStore`'s, say) that waits for `release()` before it
  runs, so that a job is in flight for as long as the test wants.
- `logged`: an event set when a logger says something (what a test waits for instead of time).
- `first_of`: which of several conditions came true first.

A held request gives up after `CEILING_S`, which only a test that never releases it reaches.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import obstore
import pytest

from helpers import HANG_S

__all__ = ["CEILING_S", "HeldCall", "HeldRequests", "first_of", "logged"]

CEILING_S = HANG_S


class HeldRequests:
    """obstore's `op` ("put" or "get"): `failing`'s request raises a connection reset once
    `fails_after` other requests have started (a batch stops sending its requests at its first
    failure: those must be running by then), `held`'s waits until `release()` and then runs for
    real; every other name passes through.

    Events: `has_failed`, `is_held` (it waits now), `has_ended` (its real request returned).
    """

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        op: str,
        *,
        held: str | None = None,
        failing: str | None = None,
        fails_after: int = 0,
    ):
        self.has_failed, self.is_held, self.has_ended = (
            threading.Event(),
            threading.Event(),
            threading.Event(),
        )
        self._released = threading.Event()
        self._started = threading.Condition()
        self._num_started = 0
        real = getattr(obstore, op)

        def request(store: object, name: str, *args: object, **kwargs: object) -> object:
            if name == failing:
                with self._started:
                    is_due = self._started.wait_for(
                        lambda: self._num_started >= fails_after, CEILING_S
                    )
                assert is_due, f"{fails_after} other requests never started"
                self.has_failed.set()
                raise ConnectionResetError(f"injected: connection reset during the {op} of {name}")
            with self._started:
                self._num_started += 1
                self._started.notify_all()
            if name != held:
                return real(store, name, *args, **kwargs)
            self.is_held.set()
            assert self._released.wait(CEILING_S), f"the test never released the {op} of {name}"
            try:
                return real(store, name, *args, **kwargs)
            finally:
                self.has_ended.set()

        monkeypatch.setattr(obstore, op, request)

    @property
    def is_holding(self) -> bool:
        """The held request waits now (reached, not released)."""
        return self.is_held.is_set() and not self._released.is_set()

    def release(self) -> None:
        self._released.set()


class HeldCall:
    """`obj.<method>`, its first call held until `release()` before it runs; later calls pass through.

    Events: `is_held`, `has_ended` (the held call returned or raised).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, obj: object, method: str):
        self.is_held, self.has_ended = threading.Event(), threading.Event()
        self._released = threading.Event()
        real = getattr(obj, method)

        def call(*args: object, **kwargs: object) -> object:
            if self.is_held.is_set():
                return real(*args, **kwargs)
            self.is_held.set()
            assert self._released.wait(CEILING_S), f"the test never released {method}"
            try:
                return real(*args, **kwargs)
            finally:
                self.has_ended.set()

        monkeypatch.setattr(obj, method, call)

    @property
    def is_holding(self) -> bool:
        return self.is_held.is_set() and not self._released.is_set()

    def release(self) -> None:
        self._released.set()


@contextlib.contextmanager
def logged(logger_name: str, text: str) -> Iterator[threading.Event]:
    """An event set once `logger_name` logs a message containing `text` (DEBUG included, for
    the time of the block)."""
    logger = logging.getLogger(logger_name)
    said = threading.Event()

    class Listener(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                said.set()

    listener = Listener(logging.DEBUG)
    level = logger.level
    logger.addHandler(listener)
    logger.setLevel(logging.DEBUG)
    try:
        yield said
    finally:
        logger.removeHandler(listener)
        logger.setLevel(level)


def first_of(conditions: dict[str, Callable[[], bool]], timeout: float = CEILING_S) -> str | None:
    """The name of the first condition found true (checked in order, every 5 ms); None after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, condition in conditions.items():
            if condition():
                return name
        time.sleep(0.005)
    return None
