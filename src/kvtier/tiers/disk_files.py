"""How one chunk lives in one file: names, the on-disk format, aligned positional I/O.

A chunk of namespace N is the file `<root>/<N.id_hex>/<hh>/<key-hex>.kv` (`hh`: the first
two hex characters of the key, so no directory holds more than 1/256 of the files):

    [0, 4096)            `ValueHeader.pack()`, zero padded to one alignment block
    [4096, 4096 + P)     the payload: the chunk's buffers back to back, in rank order
    [4096 + P, end)      zeros up to a multiple of 4096

Every file of a namespace has the same size, and a page-aligned slab row goes to and
from its file with `O_DIRECT` (no page cache, no bounce copy). Durability protocol: a
file is written whole under a temporary name `<key-hex>.kv.tmp.<pid>.<n>` in the same
directory, then renamed; a rename within a directory is atomic, so only a complete file
ever carries a final name, even when the writer is killed mid-write. A reader trusts
nothing: size, header, namespace, key, length and payload checksum are checked on every
read, and anything wrong is reported as a reason, never served.

An evicted file is not unlinked but renamed into `spare/` and later overwritten whole under
a new temporary name: on the ext4 disks measured (benchmarks/README.md) creating an inode
costs ~0.6 ms of CPU and allocating fresh blocks makes an O_DIRECT write 4x slower than
one into allocated blocks. A spare is never read: it only ever gets a final name again
after a complete rewrite, and a reader of the old file (another engine) that races the
rewrite fails the header or checksum check.

`ChunkFiles` keeps no index and starts no thread; `kvtier.tiers.disk.DiskTier` decides
what to read, write and delete. Thread-safety: any method may run on any number of
threads at once (each thread has its own aligned header block).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.keys import OffloadKey
from kvtier.tiers.secondary import HEADER_BYTES, ValueHeader, checksum

__all__ = ["BLOCK", "ChunkFiles", "ScanResult", "is_aligned", "probe_direct_io", "write_namespace_json"]

BLOCK = 4096  # the alignment unit of O_DIRECT on every Linux filesystem we target
MAX_SPARES = 64  # files kept for reuse; the directory exceeds the byte budget by at most this many
TMP_MAX_AGE_S = 600.0  # a temp file this old is abandoned even if a process with its pid lives
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_ZERO_TAIL = bytes(BLOCK - HEADER_BYTES)
_MAX_KEY_HEX = 128  # ValueHeader holds keys of at most 64 bytes
_local = threading.local()


def round_up(num_bytes: int) -> int:
    return -(-num_bytes // BLOCK) * BLOCK


def is_aligned(buffers: Sequence[memoryview]) -> bool:
    """Whether every buffer starts on and spans whole alignment blocks (what O_DIRECT needs)."""
    return all(buf.nbytes % BLOCK == 0 and np.frombuffer(buf, np.uint8).ctypes.data % BLOCK == 0 for buf in buffers)


def probe_direct_io(directory: str) -> bool:
    """Whether the filesystem of `directory` accepts an O_DIRECT write (tmpfs before Linux 6.6,
    some FUSE and network filesystems refuse it at open or at the first write)."""
    if not _O_DIRECT:
        return False
    path = os.path.join(directory, f".direct-probe.{os.getpid()}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT, 0o600)
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


def write_namespace_json(directory: str, description: dict[str, Any]) -> None:
    """`namespace.json` for people reading the directory (written whole, then renamed)."""
    tmp = os.path.join(directory, f"namespace.json.tmp.{os.getpid()}")
    Path(tmp).write_text(json.dumps(description, indent=2, sort_keys=True) + "\n")
    os.rename(tmp, os.path.join(directory, "namespace.json"))


@dataclass(slots=True)
class ScanResult:
    """What a directory scan found: chunk keys newest file first, and what it removed."""

    keys: list[OffloadKey] = field(default_factory=list)
    num_tmp_removed: int = 0
    num_garbage_removed: int = 0


class ChunkFiles:
    """The chunk files of one namespace directory.

    Args:
        directory: `<root>/<namespace id hex>`, existing.
        namespace_id: written into and checked against every header.
        payload_bytes: bytes of one chunk's payload (every rank's buffer).
        direct_io: use O_DIRECT for chunks whose buffers are all aligned.
        fsync: fsync each file before its rename, and the directory after it.
    """

    def __init__(self, directory: str, namespace_id: bytes, payload_bytes: int, *, direct_io: bool, fsync: bool):
        self.directory = directory
        self.namespace_id = namespace_id
        self.payload_bytes = payload_bytes
        self.file_bytes = BLOCK + round_up(payload_bytes)
        self.direct_io = direct_io
        self.fsync = fsync
        self._pad = memoryview(bytes(round_up(payload_bytes) - payload_bytes))
        self._tmp_ids = itertools.count()  # next() is atomic under the GIL
        self._started_ns = time.time_ns()
        self._spare_dir = os.path.join(directory, "spare")
        os.makedirs(self._spare_dir, exist_ok=True)
        self._spares: deque[str] = deque()  # append / popleft are atomic: no lock

    def path(self, key: OffloadKey) -> str:
        name = key.hex()
        return f"{self.directory}/{name[:2]}/{name}.kv"

    def write_tmp(self, key: OffloadKey, buffers: Sequence[memoryview]) -> tuple[str, bool]:
        """Write `key`'s file under a fresh temporary name.

        Returns:
            (the temporary path, whether O_DIRECT was used).
        Raises:
            OSError: the write failed; the temporary file is already removed.
        """
        views = [memoryview(buf).cast("B") for buf in buffers]
        direct = self.direct_io and is_aligned(views)
        header = ValueHeader(self.namespace_id, key, self.payload_bytes, checksum(views)).pack()
        block = _header_block()
        block[:HEADER_BYTES] = header
        block[HEADER_BYTES:] = _ZERO_TAIL
        iov = [memoryview(block), *views]
        if not direct and self._pad.nbytes:
            iov.append(self._pad)
        tmp = f"{self.path(key)}.tmp.{os.getpid()}.{next(self._tmp_ids)}"
        fd = self._open_tmp(tmp, direct)
        try:
            _pwritev_all(fd, iov)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            self.discard(tmp)
            raise
        os.close(fd)
        return tmp, direct

    def publish(self, tmp: str, key: OffloadKey) -> None:
        """Give the complete temporary file its final name (atomically replacing any older one)."""
        final = self.path(key)
        os.rename(tmp, final)
        if self.fsync:  # the rename itself is durable only once the directory is
            fd = os.open(os.path.dirname(final), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def read(self, key: OffloadKey, buffers: Sequence[memoryview]) -> tuple[str | None, bool]:
        """Read `key`'s file straight into `buffers` and check it.

        Returns:
            (why the file is not a valid value of `key`, or None; whether O_DIRECT was used).
        Raises:
            OSError: the file could not be opened or read (FileNotFoundError: it is gone).
        """
        views = [memoryview(buf).cast("B") for buf in buffers]
        direct = self.direct_io and is_aligned(views)
        fd = os.open(self.path(key), os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0))
        try:
            size = os.fstat(fd).st_size
            if size != self.file_bytes:
                return f"file of {size} bytes, expected {self.file_bytes}", direct
            block = _header_block()
            expected = BLOCK + self.payload_bytes
            if _preadv_all(fd, [memoryview(block), *views]) < expected:
                return "short read", direct
        finally:
            os.close(fd)
        return self._check(block, key, views), direct

    def _check(self, block: mmap.mmap, key: OffloadKey, views: list[memoryview]) -> str | None:
        header = ValueHeader.unpack(memoryview(block)[:HEADER_BYTES])
        if isinstance(header, str):
            return header
        wrong = header.mismatch(self.namespace_id, key, self.payload_bytes)
        if wrong is not None:
            return wrong
        if checksum(views) != header.payload_checksum:
            return "payload checksum mismatch"
        return None

    def unlink(self, key: OffloadKey) -> None:
        self.discard(self.path(key))

    def retire(self, key: OffloadKey) -> None:
        """Take `key`'s final name away, keeping the file as a spare for a later write."""
        if len(self._spares) >= MAX_SPARES:
            self.unlink(key)
            return
        spare = os.path.join(self._spare_dir, f"{os.getpid()}.{next(self._tmp_ids)}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.path(key), spare)
            self._spares.append(spare)

    def _take_spare(self, path: str) -> bool:
        """Rename a spare to `path`; False when there is none left."""
        while True:
            try:
                spare = self._spares.popleft()
            except IndexError:
                return False
            try:
                os.rename(spare, path)
                return True
            except FileNotFoundError:  # another engine took it, or the hh directory is new
                if os.path.exists(spare):
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    os.rename(spare, path)
                    return True

    def adopt_spares(self) -> None:
        """Reuse the spares a previous run left (beyond MAX_SPARES they are deleted)."""
        for entry in _entries(self._spare_dir):
            if len(self._spares) < MAX_SPARES:
                self._spares.append(entry.path)
            else:
                self.discard(entry.path)

    @staticmethod
    def discard(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def scan(self) -> ScanResult:
        """Every chunk file's key, newest first, from names alone (contents are checked at load).

        Removes temporary files no writer will finish and files that are not chunk files.
        """
        result = ScanResult()
        found: list[tuple[int, OffloadKey]] = []
        for sub in _entries(self.directory):
            if len(sub.name) == 2 and _is_hex(sub.name) and sub.is_dir(follow_symlinks=False):
                for entry in _entries(sub.path):
                    self._scan_entry(entry, sub.name, found, result)
        found.sort(reverse=True)
        result.keys = [key for _, key in found]
        return result

    def _scan_entry(self, entry: os.DirEntry, prefix: str, found: list, result: ScanResult) -> None:
        name = entry.name
        stem, dot, ext = name.partition(".")
        with contextlib.suppress(FileNotFoundError):  # another engine may delete files meanwhile
            key = _key_of(stem) if ext == "kv" and stem.startswith(prefix) else None
            if key is not None:
                found.append((entry.stat().st_mtime_ns, key))
            elif ext.startswith("kv.tmp."):
                if self._is_abandoned(entry, ext):
                    os.unlink(entry.path)
                    result.num_tmp_removed += 1
            elif not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)
                result.num_garbage_removed += 1

    def _is_abandoned(self, entry: os.DirEntry, ext: str) -> bool:
        pid_text = ext.split(".")[2] if ext.count(".") >= 3 else ""
        mtime_ns = entry.stat().st_mtime_ns
        if not pid_text.isdigit():
            return True
        pid = int(pid_text)
        if pid == os.getpid():  # ours if written since we started; else a dead process had our pid
            return mtime_ns < self._started_ns
        return not _is_alive(pid) or time.time_ns() - mtime_ns > TMP_MAX_AGE_S * 1e9

    def _open_tmp(self, path: str, direct: bool) -> int:
        """A file named `path` to write: a spare renamed there, else a new file."""
        flags = os.O_WRONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
        if self._take_spare(path):
            try:
                fd = os.open(path, flags)
            except OSError:
                self.discard(path)
                raise
            if os.fstat(fd).st_size > self.file_bytes:  # the spare was a damaged, longer file
                os.ftruncate(fd, self.file_bytes)
            return fd
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # first file of its hh directory (or someone removed it)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)


def _header_block() -> mmap.mmap:
    """This thread's page-aligned, page-sized buffer for a header (O_DIRECT needs alignment)."""
    block = getattr(_local, "block", None)
    if block is None:
        block = _local.block = mmap.mmap(-1, BLOCK)
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


def _entries(directory: str) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _key_of(stem: str) -> OffloadKey | None:
    """The key a file stem names, or None (bytes.fromhex alone would also take upper case and
    spaces, naming a key whose canonical path is another file)."""
    if not 0 < len(stem) <= _MAX_KEY_HEX:
        return None
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    return key if key.hex() == stem else None


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
