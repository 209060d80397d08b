"""A secondary tier's threads: a read pool, a write pool, a housekeeper, an optional timer.

`Workers` runs each task on its pool, counts the tasks in flight so that `drain` can wait
for them, turns a task's unexpected exception into a log line (a bug, not an I/O failure:
the tier stays alive), and refuses new tasks once closed. What the tasks do is the tier's
(`kvtier.tiers.disk.DiskTier`, `kvtier.tiers.remote.RemoteTier`).

Thread-safety: `read`, `write` and `housekeep` may be called from any thread, `every` and `close` from the
tier's owner. The task count and `is_closed` change only under `cond`'s lock, which is the
tier's, so the tier may read `is_closed` under it too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["Workers"]


class Workers:
    """Thread pools with a count of the tasks in flight.

    Args:
        cond: the tier's condition; its lock guards the task count and `is_closed`.
        num_read_threads, num_write_threads: sizes of the read and write pools.
        logger: where a task's unexpected exception is logged.
        medium: the tier's name, in thread names and log lines.
    """

    def __init__(self, cond: threading.Condition, num_read_threads: int, num_write_threads: int,
                 logger: logging.Logger, medium: str):
        self._readers = ThreadPoolExecutor(num_read_threads, f"kvtier-{medium}-read")
        self._writers = ThreadPoolExecutor(num_write_threads, f"kvtier-{medium}-write")
        self._housekeeper = ThreadPoolExecutor(1, f"kvtier-{medium}-housekeep")
        self.medium = medium
        self.is_closed = False
        self._cond, self._logger = cond, logger
        self._num_tasks = 0
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None

    def every(self, period_s: float, fn: Callable[[], None]) -> None:
        """Call `fn` on a thread of its own every `period_s` seconds until `close()`."""
        def loop() -> None:
            while not self._stop.wait(period_s):
                fn()

        self._timer = threading.Thread(target=loop, daemon=True, name=f"kvtier-{self.medium}-timer")
        self._timer.start()

    def read(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the read pool (nothing once closed)."""
        self._spawn(self._readers, fn, args)

    def write(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the write pool (nothing once closed)."""
        self._spawn(self._writers, fn, args)

    def housekeep(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the housekeeping thread, after the tasks queued there (nothing once closed)."""
        self._spawn(self._housekeeper, fn, args)

    def _spawn(self, pool: ThreadPoolExecutor, fn: Callable[..., None], args: tuple) -> None:
        with self._cond:
            if self.is_closed:
                return
            self._num_tasks += 1
        pool.submit(self._run, fn, args)

    def _run(self, fn: Callable[..., None], args: tuple) -> None:
        try:
            fn(*args)
        except Exception:  # a bug, not an I/O failure: say so, keep the tier alive
            self._logger.exception("%s tier: %s failed", self.medium, fn.__name__)
        finally:
            with self._cond:
                self._num_tasks -= 1
                self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until no task is in flight; True when none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_tasks == 0, timeout)

    def close(self) -> None:
        """Refuse new tasks, stop the timer, and wait for the tasks already submitted."""
        if self.is_closed:
            return
        with self._cond:
            self.is_closed = True
        self._stop.set()
        if self._timer is not None:
            self._timer.join()
        for pool in (self._housekeeper, self._readers, self._writers):
            pool.shutdown(wait=True)
