"""A secondary tier's threads: a read pool, a write pool, a housekeeper, an optional timer.

`Workers` runs each task on its pool, counts the tasks in flight so that `drain` can wait
for them, turns a task's unexpected exception into a log line (a bug, not an I/O failure:
the tier stays alive), and refuses new tasks once closed. What the tasks do is the tier's
(`kvtier.tiers.disk.tier.DiskTier`, `kvtier.tiers.remote.tier.RemoteTier`).

The threads are daemons and `close` waits for them only so long (issue 20: a read stuck in
the kernel, or a store waiting on a claim that was never released, held engine shutdown
forever — `ThreadPoolExecutor` joins its threads at `shutdown` and again at interpreter exit,
without a bound). A tier whose threads outlived `close` must not release what they may
still use (the disk tier keeps its directory descriptors open): `close` says whether they did.

Thread-safety: `read`, `write` and `housekeep` may be called from any thread, `every` and `close` from the
tier's owner. The task count and `is_closed` change only under `cond`'s lock, which is the
tier's, so the tier may read `is_closed` under it too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["CLOSE_WAIT_S", "Workers"]

# how long `close` waits for tasks still running (a stuck one is abandoned after)
CLOSE_WAIT_S = 10.0

# None: the thread's signal to stop
_Task = tuple[Callable[..., None], tuple] | None


class _Pool:
    """`num_threads` daemon threads running tasks from one queue, first in first out.

    The threads hold their `Workers` only while they run a task (a weak reference otherwise), so a
    tier nobody closed ends its threads when it is collected, as `ThreadPoolExecutor` does.
    """

    def __init__(
        self, num_threads: int, name: str, run: Callable[[Callable[..., None], tuple], None]
    ):
        self._queue: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._run = weakref.WeakMethod(run)  # type: ignore[arg-type]
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}_{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., None], args: tuple) -> None:
        self._queue.put((fn, args))

    def stop(self) -> None:
        """Each thread ends after the tasks queued before this call."""
        for _ in self._threads:
            self._queue.put(None)

    def join(self, deadline: float) -> int:
        """Wait until `deadline` (time.monotonic()) for the threads; returns how many still run."""
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return sum(thread.is_alive() for thread in self._threads)

    def _serve(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            run = self._run()
            if run is None:
                # the tier is gone
                return
            run(*task)
            del run, task


class Workers:
    """Thread pools with a count of the tasks in flight.

    Args:
        cond: the tier's condition; its lock guards the task count and `is_closed`.
        num_read_threads, num_write_threads: sizes of the read and write pools.
        logger: where a task's unexpected exception is logged.
        medium: the tier's name, in thread names and log lines.
    """

    def __init__(
        self,
        cond: threading.Condition,
        num_read_threads: int,
        num_write_threads: int,
        logger: logging.Logger,
        medium: str,
    ):
        self.medium = medium
        self.is_closed = False
        self._cond = cond
        self._logger = logger
        self._num_tasks = 0
        self._readers = _Pool(num_read_threads, f"kvtier-{medium}-read", self._run)
        self._writers = _Pool(num_write_threads, f"kvtier-{medium}-write", self._run)
        self._housekeeper = _Pool(1, f"kvtier-{medium}-housekeep", self._run)
        weakref.finalize(self, _stop_all, [self._readers, self._writers, self._housekeeper])
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None

    def every(self, period_s: float, fn: Callable[[], None]) -> None:
        """Call `fn` (a method of the tier) on a thread of its own every `period_s` seconds until
        `close()`, or until the tier is collected (the thread holds it only while it calls `fn`)."""
        stop = self._stop
        method = weakref.WeakMethod(fn)  # type: ignore[arg-type]

        def loop() -> None:
            while not stop.wait(period_s):
                call = method()
                if call is None:
                    return
                call()
                del call

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

    def _spawn(self, pool: _Pool, fn: Callable[..., None], args: tuple) -> None:
        with self._cond:
            if self.is_closed:
                return
            self._num_tasks += 1
        pool.submit(fn, args)

    def _run(self, fn: Callable[..., None], args: tuple) -> None:
        try:
            fn(*args)
        except Exception:
            # a bug, not an I/O failure: say so, keep the tier alive
            self._logger.exception("%s tier: %s failed", self.medium, fn.__name__)
        finally:
            with self._cond:
                self._num_tasks -= 1
                self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until no task is in flight; True when none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_tasks == 0, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new tasks, stop the timer, and wait up to `timeout` seconds (default `CLOSE_WAIT_S`)
        for the tasks already submitted; returns True when every thread has ended (False: some are
        stuck, abandoned)."""
        timeout = CLOSE_WAIT_S if timeout is None else timeout
        if self.is_closed:
            return self._num_tasks == 0
        with self._cond:
            self.is_closed = True
        self._stop.set()
        if self._timer is not None:
            self._timer.join(timeout)
        deadline = time.monotonic() + timeout
        for pool in (self._housekeeper, self._readers, self._writers):
            pool.stop()
        stuck = 0
        for pool in (self._housekeeper, self._readers, self._writers):
            stuck += pool.join(deadline)
        if stuck:
            self._logger.error(
                "%s tier: %d I/O thread(s) still busy after %.0f s at shutdown; abandoned",
                self.medium,
                stuck,
                timeout,
            )
        return stuck == 0


def _stop_all(pools: list[_Pool]) -> None:
    for pool in pools:
        pool.stop()
