"""What one chunk file holds, byte for byte, and how it moves: aligned positional I/O.

    [0, 4096)            `ValueHeader.pack()`, zero padded to one alignment block
    [4096, 4096 + P)     the payload: the chunk's buffers back to back, in rank order
    [4096 + P, end)      zeros up to a multiple of 4096

Every file of a namespace has the same size, and a page-aligned slab row goes to and
from its file with `O_DIRECT` (no page cache, no bounce copy). A reader trusts nothing:
size, header, namespace, key, length and payload checksum are checked on every read, and
anything wrong is reported as a reason, never served.

`ChunkFormat` writes to and reads from an open file descriptor; which file that is (names,
temporary files, spares) is `kvtier.tiers.disk.files`. Thread-safety: any function or
method may run on any number of threads at once (each thread has its own aligned header
block).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey
from kvtier.tiers.secondary import HEADER_BYTES, ValueHeader, checksum

__all__ = [
    "BLOCK",
    "O_DIRECT",
    "ChunkFormat",
    "choose_direct_io",
    "is_aligned",
    "probe_direct_io",
    "round_up",
]

# the alignment unit of O_DIRECT on every Linux filesystem we target
BLOCK = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)
_ZERO_TAIL = bytes(BLOCK - HEADER_BYTES)
_local = threading.local()


def round_up(num_bytes: int) -> int:
    return -(-num_bytes // BLOCK) * BLOCK


def is_aligned(buffers: Sequence[memoryview]) -> bool:
    """Whether every buffer starts on and spans whole alignment blocks (what O_DIRECT needs)."""
    return all(
        buf.nbytes % BLOCK == 0 and np.frombuffer(buf, np.uint8).ctypes.data % BLOCK == 0
        for buf in buffers
    )


def probe_direct_io(directory: str) -> bool:
    """Whether the filesystem of `directory` accepts an O_DIRECT write (tmpfs before Linux 6.6,
    some FUSE and network filesystems refuse it at open or at the first write)."""
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f".direct-probe.{os.getpid()}")
    # a crashed probe's file, or anything planted under its name
    with contextlib.suppress(OSError):
        os.unlink(path)
    # never through a symlink, never an existing file
    try:
        fd = os.open(
            path,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | O_DIRECT,
            0o600,
        )
    except OSError:
        return False
    try:
        os.pwrite(fd, _header_block(), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


def choose_direct_io(directory: str, direct_io: bool | None) -> bool:
    """Whether to use O_DIRECT in `directory`: `direct_io`, or None for where the filesystem allows it.

    Raises:
        ConfigError: direct_io=True where the filesystem refuses O_DIRECT.
    """
    if direct_io is False:
        return False
    allowed = probe_direct_io(directory)
    if direct_io and not allowed:
        raise ConfigError(
            f"the filesystem of {directory!r} refuses O_DIRECT; set direct_io=None or False"
        )
    return allowed


class ChunkFormat:
    """The file format of one namespace's chunks.

    Args:
        namespace_id: written into and checked against every header.
        payload_bytes: bytes of one chunk's payload (every rank's buffer).
    """

    def __init__(self, namespace_id: bytes, payload_bytes: int):
        self.namespace_id = namespace_id
        self.payload_bytes = payload_bytes
        self.file_bytes = BLOCK + round_up(payload_bytes)
        self._pad = memoryview(bytes(round_up(payload_bytes) - payload_bytes))

    def write(self, fd: int, key: OffloadKey, views: Sequence[memoryview], direct: bool) -> None:
        """Write `key`'s whole file to `fd` from byte views (`direct`: fd is O_DIRECT, views aligned).

        Raises:
            OSError: the write failed.
        """
        header = ValueHeader(self.namespace_id, key, self.payload_bytes, checksum(views)).pack()
        block = _header_block()
        block[:HEADER_BYTES] = header
        block[HEADER_BYTES:] = _ZERO_TAIL
        iov = [memoryview(block), *views]
        # O_DIRECT views already end on a block
        if not direct and self._pad.nbytes:
            iov.append(self._pad)
        _pwritev_all(fd, iov)

    def read(self, fd: int, key: OffloadKey, views: Sequence[memoryview]) -> str | None:
        """Read the file open as `fd` straight into byte views and check it.

        Returns:
            Why the file is not a valid value of `key`, or None when it is.
        Raises:
            OSError: the file could not be read.
        """
        size = os.fstat(fd).st_size
        if size != self.file_bytes:
            return f"file of {size} bytes, expected {self.file_bytes}"
        block = _header_block()
        if _preadv_all(fd, [memoryview(block), *views]) < BLOCK + self.payload_bytes:
            return "short read"
        return self._check(block, key, views)

    def _check(self, block: mmap.mmap, key: OffloadKey, views: Sequence[memoryview]) -> str | None:
        header = ValueHeader.unpack(memoryview(block)[:HEADER_BYTES])
        if isinstance(header, str):
            return header
        wrong = header.mismatch(self.namespace_id, key, self.payload_bytes)
        if wrong is not None:
            return wrong
        if checksum(views) != header.payload_checksum:
            return "payload checksum mismatch"
        return None


def _header_block() -> mmap.mmap:
    """This thread's page-aligned, page-sized buffer for a header (O_DIRECT needs alignment)."""
    block = getattr(_local, "block", None)
    if block is None:
        block = mmap.mmap(-1, BLOCK)
        _local.block = block
    return block


def _pwritev_all(fd: int, views: list[memoryview]) -> None:
    offset = 0
    while views:
        done = os.pwritev(fd, views, offset)
        if done <= 0:
            raise OSError(f"pwritev wrote nothing at offset {offset}")
        offset += done
        views = _advance(views, done)


def _preadv_all(fd: int, views: list[memoryview]) -> int:
    offset = 0
    while views:
        done = os.preadv(fd, views, offset)
        if done <= 0:
            break
        offset += done
        views = _advance(views, done)
    return offset


def _advance(views: list[memoryview], num_bytes: int) -> list[memoryview]:
    """`views` without their first `num_bytes` bytes (after a short positional read or write)."""
    i = 0
    while i < len(views) and num_bytes >= views[i].nbytes:
        num_bytes -= views[i].nbytes
        i += 1
    rest = views[i:]
    if rest and num_bytes:
        rest[0] = rest[0][num_bytes:]
    return rest
