"""The C copy helper `kvtier.worker._copyruns` and `MemmoveCopier`'s choice of path."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import kvtier.worker.memmove as memmove
from helpers import HANG_S, CopyEnded, mid_copy
from kvtier.worker.memmove import MemmoveCopier

copyruns = pytest.importorskip(
    "kvtier.worker._copyruns", reason="C helper not built (python setup.py build_ext)"
)


class Runs:
    """A source buffer of random bytes, a zeroed destination, and runs between them: uneven
    lengths (some zero) at shuffled destination places, so every run lands somewhere else."""

    def __init__(self, num_runs: int, max_len: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.nbytes = rng.integers(0, max_len, num_runs, dtype=np.int64)
        self.nbytes[::5] = 0
        total = int(self.nbytes.sum())
        self.src = rng.integers(0, 256, total, dtype=np.uint8)
        self.dst = np.zeros(total, dtype=np.uint8)
        src_offsets = np.cumsum(self.nbytes) - self.nbytes
        # destination runs laid out in a shuffled order
        order = rng.permutation(num_runs)
        dst_offsets = np.empty(num_runs, dtype=np.int64)
        dst_offsets[order] = np.cumsum(self.nbytes[order]) - self.nbytes[order]
        self.src_addr = self.src.ctypes.data + src_offsets
        self.dst_addr = self.dst.ctypes.data + dst_offsets
        self.expected = np.zeros_like(self.dst)
        for s, d, n in zip(src_offsets, dst_offsets, self.nbytes, strict=True):
            self.expected[d : d + n] = self.src[s : s + n]

    def arrays(
        self, first: int = 0, end: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.dst_addr[first:end], self.src_addr[first:end], self.nbytes[first:end]


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize(("num_runs", "max_len"), [(1, 1 << 20), (7, 3), (500, 70_000)])
def test_copy_runs_copies_every_byte_once(num_threads, num_runs, max_len):
    runs = Runs(num_runs, max_len)
    copyruns.copy_runs(*runs.arrays(), num_threads)
    assert np.array_equal(runs.dst, runs.expected)


@pytest.mark.parametrize("dst_misalign", [0, 1, 7, 15])
@pytest.mark.parametrize("length", [65_535, 65_536, 65_536 + 63, 200_001])
def test_streaming_stores_copy_long_runs_exactly(dst_misalign, length):
    # runs of >= 64 KiB take the streaming-store path: unaligned heads and odd tails included
    rng = np.random.default_rng(length + dst_misalign)
    src = rng.integers(0, 256, length + 16, dtype=np.uint8)
    dst = np.zeros(length + 32, dtype=np.uint8)
    addr = lambda a, off: np.array([a.ctypes.data + off], dtype=np.int64)  # noqa: E731
    copyruns.copy_runs(addr(dst, dst_misalign), addr(src, 3), np.array([length], dtype=np.int64), 1)
    assert np.array_equal(dst[dst_misalign : dst_misalign + length], src[3 : 3 + length])
    assert not dst[:dst_misalign].any() and not dst[dst_misalign + length :].any()


def test_copy_runs_with_nothing_to_copy_returns():
    empty = np.zeros(0, dtype=np.int64)
    copyruns.copy_runs(empty, empty, empty, 2)
    zeros = np.zeros(3, dtype=np.int64)
    # zero-length runs may have null addresses
    copyruns.copy_runs(zeros, zeros, zeros, 2)


def good() -> np.ndarray:
    return np.ones(4, dtype=np.int64)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1, 2], good(), good()), "dst must be a C-contiguous 1-D int64 array"),
        (
            (good(), good().astype(np.int32), good()),
            "src must be a 1-D int64 array, got format 'i'",
        ),
        (
            (good(), good(), good().astype(np.float64)),
            "nbytes must be a 1-D int64 array, got format 'd'",
        ),
        ((good(), good(), good().astype(np.uint64)), "nbytes must be a 1-D int64 array"),
        (
            (np.ones((2, 2), dtype=np.int64), good(), good()),
            "dst must be a 1-D int64 array.*ndim 2",
        ),
        ((np.ones(8, dtype=np.int64)[::2], good(), good()), "dst must be a C-contiguous"),
        ((good(), good()[:3], good()), "equal lengths, got 4, 3, 4"),
        ((good(), good(), np.array([1, -1, 1, 1])), r"nbytes\[1\] = -1"),
        ((good(), np.array([1, 0, 1, 1]), good()), "run 1 has a null address"),
    ],
)
def test_copy_runs_rejects_malformed_arguments_before_copying(args, message):
    with pytest.raises(ValueError, match=message):
        copyruns.copy_runs(*args, 1)


@pytest.mark.parametrize("num_threads", [0, 65])
def test_copy_runs_rejects_thread_counts_out_of_range(num_threads):
    with pytest.raises(ValueError, match=r"num_threads must be in \[1, 64\]"):
        copyruns.copy_runs(good(), good(), good(), num_threads)


def test_copier_copies_batches_started_back_to_back():
    runs = Runs(600, 40_000, seed=1)
    copier = copyruns.Copier(2)
    # three batches in flight at once, cut into 2, 1 and 2 shares; waited for out of order
    tickets = [
        copier.start(*runs.arrays(0, 200), 2),
        copier.start(*runs.arrays(200, 400), 1),
        copier.start(*runs.arrays(400), 2),
    ]
    waited = [copier.wait(t) for t in reversed(tickets)]
    assert np.array_equal(runs.dst, runs.expected)
    assert all(seconds >= 0 and is_complete is True for seconds, is_complete in waited)
    # a ticket is forgotten once waited for
    with pytest.raises(ValueError, match="no started copy has ticket"):
        copier.wait(tickets[0])
    # malformed batches are refused at start, and the copier keeps working
    with pytest.raises(ValueError, match="equal lengths"):
        copier.start(good(), good()[:1], good(), 1)
    empty = np.zeros(0, dtype=np.int64)
    assert copier.wait(copier.start(empty, empty, empty, 2)) == (0.0, True)
    # close finishes what was started (never waited for here), then refuses new batches
    runs = Runs(50, 10_000, seed=2)
    copier.start(*runs.arrays(), 2)
    copier.close()
    copier.close()
    assert np.array_equal(runs.dst, runs.expected)
    with pytest.raises(RuntimeError, match="Copier is closed"):
        copier.start(empty, empty, empty, 1)


@pytest.mark.parametrize("path", ["native", "ctypes"])
def test_memmove_copier_copies_on_either_path(path, monkeypatch):
    if path == "ctypes":
        monkeypatch.setattr(memmove, "_copyruns", None)
    copier = MemmoveCopier(2)
    assert copier.is_native == (path == "native")
    # a small batch (one share) and a large one (split by bytes over both threads)
    small, large = Runs(20, 1000, seed=3), Runs(300, 30_000, seed=4)
    handles = [copier.start(*small.arrays()), copier.start(*large.arrays())]
    for handle in handles:
        handle.wait()
        assert handle.finished_at > 0
    copier.close()
    assert np.array_equal(small.dst, small.expected) and np.array_equal(large.dst, large.expected)


def test_the_path_is_logged_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(memmove, "_logged_paths", set())
    caplog.set_level(logging.INFO, logger="kvtier.worker.memmove")
    for _ in range(2):
        MemmoveCopier(1).close()
    monkeypatch.setattr(memmove, "_copyruns", None)
    MemmoveCopier(1).close()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert (
        "native path" in messages[0] and "ctypes path" in messages[1] and "not built" in messages[1]
    )


# -- cancelling a started copy (issue #20) -------------------------------------------------------

# one long run: about 0.1 s here, cancelled inside it
RUN = 256 << 20


def one_long_run() -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    src = np.full(RUN, 7, dtype=np.uint8)
    dst = np.zeros(RUN, dtype=np.uint8)
    addr = lambda a: np.array([a.ctypes.data], dtype=np.int64)  # noqa: E731
    return src, dst, (addr(dst), addr(src), np.array([RUN], dtype=np.int64))


def wait_for_first_byte(dst: np.ndarray) -> None:
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        if dst[0]:
            return
        time.sleep(0.0001)
    raise AssertionError("the copy never began")


@pytest.mark.parametrize("num_shares", [1, 2])
def test_a_cancel_stops_a_copy_inside_a_long_run_and_nothing_is_written_after_it(num_shares):
    copier = copyruns.Copier(2)

    def attempt() -> tuple[np.ndarray, np.ndarray, int, int]:
        # returned: `runs` holds only addresses of src and dst
        src, dst, runs = one_long_run()
        ticket = copier.start(*runs, num_shares)
        wait_for_first_byte(dst)
        assert copier.cancel(ticket) is True
        seconds, is_complete = copier.wait(ticket)
        copied = int(np.count_nonzero(dst))
        if is_complete and copied == RUN:
            raise CopyEnded
        # cut short: wait returned once every thread stopped, within a slice of the cancel
        assert is_complete is False and seconds >= 0
        assert 0 < copied < RUN
        return src, dst, copied, ticket

    # both kept mapped while a late write is looked for
    src, dst, copied, ticket = mid_copy(attempt)
    time.sleep(0.05)
    assert int(np.count_nonzero(dst)) == copied, "a thread wrote after wait() returned"
    # the ticket is gone; the copier copies the next batch whole
    assert copier.cancel(ticket) is False
    runs2 = Runs(50, 10_000, seed=5)
    assert copier.wait(copier.start(*runs2.arrays(), 2))[1] is True
    assert np.array_equal(runs2.dst, runs2.expected)
    copier.close()
    assert copier.cancel(ticket) is False


def test_a_cancel_after_the_copy_ended_leaves_it_complete():
    runs = Runs(20, 1000, seed=6)
    copier = copyruns.Copier(1)
    ticket = copier.start(*runs.arrays(), 1)
    while not np.array_equal(runs.dst, runs.expected):
        time.sleep(0.001)
    # too late to cut anything: every byte was copied
    copier.cancel(ticket)
    assert copier.wait(ticket)[1] is True


@pytest.mark.parametrize("path", ["native", "ctypes"])
def test_a_cancelled_handle_says_it_was_cut_short_on_either_path(path, monkeypatch):
    if path == "ctypes":
        monkeypatch.setattr(memmove, "_copyruns", None)
    copier = MemmoveCopier(2)

    def attempt() -> tuple[np.ndarray, np.ndarray, int]:
        # returned: `runs` holds only addresses of src and dst
        src, dst, runs = one_long_run()
        handle = copier.start(*runs)
        wait_for_first_byte(dst)
        handle.cancel()
        cut = handle.wait() is False
        copied = int(np.count_nonzero(dst))
        if not cut and copied == RUN:
            raise CopyEnded
        assert cut and 0 < copied < RUN
        return src, dst, copied

    # both kept mapped while a late write is looked for
    src, dst, copied = mid_copy(attempt)
    time.sleep(0.05)
    assert int(np.count_nonzero(dst)) == copied
    small = Runs(20, 1000, seed=7)
    assert copier.start(*small.arrays()).wait() is True
    copier.close()
