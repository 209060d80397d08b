"""Which file holds a chunk: names, the directory layout, temporary files, spares, scans.

A chunk of namespace N is the file `<root>/<N.id_hex>/<hh>/<key-hex>.kv` (`hh`: the first
two hex characters of the key, so no directory holds more than 1/256 of the files); what a
file holds is `kvtier.tiers.disk_format`. Durability protocol: a file is written whole
under a temporary name `<key-hex>.kv.tmp.<pid>.<n>` in the same directory, then renamed; a
rename within a directory is atomic, so only a complete file ever carries a final name,
even when the writer is killed mid-write.

An evicted file is not unlinked but renamed into `spare/` and later overwritten whole under
a new temporary name: on the ext4 disks measured (benchmarks/README.md) creating an inode
costs ~0.6 ms of CPU and allocating fresh blocks makes an O_DIRECT write 4x slower than
one into allocated blocks. A spare is never read: it only ever gets a final name again
after a complete rewrite, and a reader of the old file (another engine) that races the
rewrite fails the header or checksum check.

`ChunkFiles` keeps no index and starts no thread; `kvtier.tiers.disk.DiskTier` decides
what to read, write and delete. Thread-safety: any method may run on any number of
threads at once.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey
from kvtier.tiers.disk_format import BLOCK, O_DIRECT, ChunkFormat, is_aligned, probe_direct_io
from kvtier.tiers.namespace import Namespace

__all__ = ["BLOCK", "ChunkFiles", "ScanResult", "is_aligned", "make_directory", "probe_direct_io",
           "write_namespace_json"]

MAX_SPARES = 64  # files kept for reuse; the directory exceeds the byte budget by at most this many
TMP_MAX_AGE_S = 600.0  # a temp file this old is abandoned even if a process with its pid lives
_MAX_KEY_HEX = 128  # ValueHeader holds keys of at most 64 bytes


def make_directory(root: Path, namespace: Namespace) -> str:
    """Create `<root>/<namespace id hex>` with its `namespace.json`; returns its path.

    Raises:
        ConfigError: `root` is not a directory kvtier may create and write.
    """
    directory = root / namespace.id_hex
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_namespace_json(str(directory), namespace.describe())
    except OSError as exc:
        raise ConfigError(f"disk tier root {str(root)!r} is not a writable directory ({exc}); "
                          f"point the disk tier at a directory kvtier may create and write") from exc
    return str(directory)


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
        self.format = ChunkFormat(namespace_id, payload_bytes)
        self.file_bytes = self.format.file_bytes
        self.direct_io = direct_io
        self.fsync = fsync
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
        tmp = f"{self.path(key)}.tmp.{os.getpid()}.{next(self._tmp_ids)}"
        fd = self._open_tmp(tmp, direct)
        try:
            self.format.write(fd, key, views, direct)
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
        fd = os.open(self.path(key), os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))
        try:
            return self.format.read(fd, key, views), direct
        finally:
            os.close(fd)

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
        flags = os.O_WRONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0)
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
