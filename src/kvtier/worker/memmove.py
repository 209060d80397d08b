"""Copying lists of byte runs between host addresses, on a few threads, without the GIL.

Two paths, chosen when a copier is made (the first one logs at INFO which):

- native: `_copyruns.Copier`, the C helper built by `setup.py` (optional): persistent
  pthreads copy each started batch with memcpy and never take the GIL, so consecutive
  batches copy back to back however busy the interpreter is; `wait` blocks without the GIL.
- ctypes (fallback, when the helper is not built): `ctypes.memmove` run by run on one Python
  thread per share, retaking the GIL after every run.

Why memmove and not `Tensor.copy_` (measured on the 2-core development machine, 128 MiB
moved in runs at random offsets, against one contiguous 2-thread `copy_` at ~18 GB/s):

    run size            128 KiB   256 KiB   512 KiB
    copy_ per run        0.60      0.71      0.78
    _foreach_copy_       0.51      0.65      0.75
    memmove, 1 thread    0.65      0.74      0.80
    memmove, 2 threads   0.87      0.93      0.95

`copy_` pays a TensorIterator set-up and an OpenMP fork per call, comparable to copying
128 KiB. (`index_copy_` and advanced-index assignment reach ~0.6 GB/s here and are never used.)

Why persistent C threads rather than a Python thread calling a GIL-free `copy_runs` per batch:
beside a thread spinning in pure Python (an engine's forward pass between torch ops), every
return to Python waited ~5-7 ms for the GIL (the interpreter's switch interval): 256 MiB in 64
`copy_runs` calls went at 0.5 GB/s, in one call at 8.7 GB/s. See `benchmarks/README.md`.

Cancelling (issue #20): `CopyHandle.cancel` cuts a started copy short. Both paths check a flag
before every run and every `_CANCEL_SLICE_BYTES` inside a long one (the C helper with a relaxed
atomic load, the fallback with an attribute read: no system call on the copy path), so a copy
stops within about a MiB; `wait` then says whether every byte was copied.

Memory safety: callers pass addresses computed from validated ids and bounds-checked
planes, inside tensors they keep alive until the copy has finished.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import queue
import threading
import time
from types import ModuleType

import numpy as np

_copyruns: ModuleType | None
try:
    from kvtier.worker import _copyruns
# not built (no C compiler at install time): the ctypes path copies
except ImportError:
    _copyruns = None

__all__ = ["CopyHandle", "MemmoveCopier", "native_copy_available"]

logger = logging.getLogger(__name__)

# below this, waking a second thread costs more than it saves
_SPLIT_MIN_BYTES = 1 << 20
# a long run is copied in slices this long, a cancel checked between
_CANCEL_SLICE_BYTES = 1 << 20
_logged_paths: set[str] = set()
_PATH_NOTES = {
    "native": "C helper kvtier.worker._copyruns: batches copy without the GIL",
    "ctypes": "kvtier.worker._copyruns is not built; ctypes.memmove retakes the GIL after every run",
}


def native_copy_available() -> bool:
    """True when the C helper is built, so copies hold no GIL while they run."""
    return _copyruns is not None


class CopyHandle:
    """One started copy: `wait()` for it; `finished_at` is when its last part ended.

    Thread-safety: `cancel` may be called from any thread, `wait` from one.
    """

    def __init__(self, num_parts: int) -> None:
        self._left = num_parts
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._is_complete = True
        # read by the copy threads before every run (a plain attribute: cheap)
        self.is_cancelled = False
        self.finished_at = 0.0
        if num_parts == 0:
            self._done.set()

    def part_done(self, error: BaseException | None, is_cut_short: bool = False) -> None:
        """Called by a copy thread when its part ended (with its exception, if any)."""
        with self._lock:
            self._left -= 1
            self._error = self._error or error
            self._is_complete = self._is_complete and not is_cut_short
            if self._left == 0:
                self.finished_at = time.perf_counter()
                self._done.set()

    def cancel(self) -> None:
        """Cut the copy short: its threads stop before their next run or slice (never blocks)."""
        self.is_cancelled = True

    def wait(self) -> bool:
        """Block until no thread copies any part any more.

        Returns:
            True when every byte was copied; False when `cancel` cut it short.
        Raises:
            RuntimeError: a part failed (the caller reports its jobs failed).
        """
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"copy thread failed: {self._error!r}")
        return self._is_complete


class _NativeCopyHandle(CopyHandle):
    """A batch started on a `_copyruns.Copier`; `wait` blocks in C, without the GIL."""

    def __init__(self, copier: object, ticket: int, started_at: float) -> None:
        super().__init__(1)
        self._copier = copier
        self._ticket = ticket
        self._started_at = started_at

    def cancel(self) -> None:
        # None once waited for: nothing copies any more
        ticket = self._ticket
        if ticket is not None:
            self._copier.cancel(ticket)  # type: ignore[attr-defined]

    def wait(self) -> bool:
        # idempotent: the C side forgets a ticket once waited for
        if self._ticket is not None:
            seconds, self._is_complete = self._copier.wait(self._ticket)  # type: ignore[attr-defined]
            self.finished_at = self._started_at + seconds
            self._ticket = None
        return self._is_complete


class MemmoveCopier:
    """Copies (dst, src, nbytes) byte runs on `num_threads` threads, split evenly by bytes.

    `start` returns at once; batches copy in start order. Not thread-safe: one caller (the job
    thread).
    """

    def __init__(self, num_threads: int) -> None:
        self._num_threads = max(1, num_threads)
        self._native = _copyruns.Copier(self._num_threads) if _copyruns is not None else None
        path = "ctypes" if self._native is None else "native"
        if path not in _logged_paths:
            _logged_paths.add(path)
            logger.info("kvtier copies on the %s path (%s)", path, _PATH_NOTES[path])
        num_servers = 0 if self._native is not None else self._num_threads
        self._inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(num_servers)]
        self._threads = [
            threading.Thread(target=_serve, args=(inbox,), name=f"kvtier-copy-{i}", daemon=True)
            for i, inbox in enumerate(self._inboxes)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def is_native(self) -> bool:
        """True when batches are copied by the C helper."""
        return self._native is not None

    def start(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> CopyHandle:
        """Start copying every run.

        Args:
            dst, src: int64 addresses; nbytes: int64 lengths (destinations must not overlap).
        Returns:
            The handle to wait on.
        Raises:
            ValueError: malformed arrays (native path), before anything is copied.
        """
        if nbytes.size == 0:
            return CopyHandle(0)
        shares = 1 if int(nbytes.sum()) < _SPLIT_MIN_BYTES else self._num_threads
        if self._native is not None:
            started_at = time.perf_counter()
            return _NativeCopyHandle(
                self._native, self._native.start(dst, src, nbytes, shares), started_at
            )
        parts = split_by_bytes(dst, src, nbytes, shares)
        handle = CopyHandle(len(parts))
        # small copies have one part
        for inbox, part in zip(self._inboxes, parts, strict=False):
            inbox.put((part, handle))
        return handle

    def copy(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
        """`start` and wait (nothing can cancel it)."""
        self.start(dst, src, nbytes).wait()

    def close(self) -> None:
        """Stop the threads after the copies already started (idempotent)."""
        if self._native is not None:
            self._native.close()
        for inbox in self._inboxes:
            inbox.put(None)
        for thread in self._threads:
            thread.join()
        self._inboxes = []
        self._threads = []


def _serve(inbox: queue.SimpleQueue) -> None:
    while (work := inbox.get()) is not None:
        (dst, src, nbytes), handle = work
        try:
            is_cut_short = _copy_part(dst, src, nbytes, handle)
        # handed to the waiter, which fails the jobs
        except BaseException as e:
            handle.part_done(e)
        else:
            handle.part_done(None, is_cut_short)


def _copy_part(dst: list[int], src: list[int], nbytes: list[int], handle: CopyHandle) -> bool:
    """Copy the runs, checking `handle.is_cancelled` before each run and slice; True if it stopped early."""
    memmove = ctypes.memmove
    for d, s, n in zip(dst, src, nbytes, strict=True):
        if handle.is_cancelled and n:
            return True
        # a long run: sliced, so a cancel stops it within a slice
        while n > _CANCEL_SLICE_BYTES:
            memmove(d, s, _CANCEL_SLICE_BYTES)
            d += _CANCEL_SLICE_BYTES
            s += _CANCEL_SLICE_BYTES
            n -= _CANCEL_SLICE_BYTES
            if handle.is_cancelled:
                return True
        memmove(d, s, n)
    return False


def split_by_bytes(
    dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, shares: int
) -> list[tuple]:
    """Cut the runs into `shares` lists of about equal bytes, splitting runs at the cuts.

    Returns:
        `shares` tuples of Python lists (dst, src, nbytes); iterating lists is what the
        copy loop does fastest.
    """
    if shares == 1:
        return [(dst.tolist(), src.tolist(), nbytes.tolist())]
    if nbytes.size >= 4 * shares and int(nbytes.max()) * 4 * shares <= int(nbytes.sum()):
        # Many runs, none large: cutting between runs balances well enough and costs less.
        cut = np.searchsorted(
            np.cumsum(nbytes), np.arange(1, shares) * (int(nbytes.sum()) // shares)
        )
        bounds = [0, *cut.tolist(), nbytes.size]
        return [
            (dst[a:b].tolist(), src[a:b].tolist(), nbytes[a:b].tolist())
            for a, b in itertools.pairwise(bounds)
        ]
    ends = np.cumsum(nbytes)
    total = int(ends[-1])
    cuts = np.array([total * k // shares for k in range(1, shares)], dtype=np.int64)
    # Byte positions of run starts plus the cuts; every piece lies inside one run.
    starts = ends - nbytes
    points = np.union1d(starts, cuts)
    points = points[points < total]
    run = np.searchsorted(ends, points, side="right")
    skip = points - starts[run]
    lengths = np.diff(np.append(points, total))
    owner = np.searchsorted(cuts, points, side="right")
    d = dst[run] + skip
    s = src[run] + skip
    return [
        (d[owner == k].tolist(), s[owner == k].tolist(), lengths[owner == k].tolist())
        for k in range(shares)
    ]
