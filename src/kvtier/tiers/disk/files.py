"""Which file holds a chunk: the directory layout, temporary files, spares, scans.

Names (`<root>/<N.id_hex>/<hh>/<key-hex>.kv`, temporary and spare names, whose writer is
gone) are `kvtier.tiers.disk.names`; what a file holds is `kvtier.tiers.disk.format`.
Durability protocol: a file is written whole under a temporary name in the same directory,
then renamed; a rename within a directory is atomic, so only a complete file ever carries a
final name, even when the writer is killed mid-write.

An evicted file is not unlinked but renamed into `spare/` and later overwritten whole under
a new temporary name: on the ext4 disks measured (benchmarks/README.md) creating an inode
costs ~0.6 ms of CPU and allocating fresh blocks makes an O_DIRECT write 4x slower than
one into allocated blocks. A spare is never read: it only ever gets a final name again
after a complete rewrite, and a reader of the old file (another engine) that races the
rewrite fails the header or checksum check.

Every file operation is relative to a descriptor of its directory, opened without following
a symlink, and opens files with `O_NOFOLLOW` (see `kvtier.tiers.disk.root`): a symlink planted
in the namespace directory fails that operation and never leads outside it. Files are created
with `file_mode`.

`ChunkFiles` keeps no index and starts no thread; `kvtier.tiers.disk.tier.DiskTier` decides
what to read, write and delete. Thread-safety: any method may run on any number of
threads at once; `close` once the others are done.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey
from kvtier.tiers.disk.format import BLOCK, O_DIRECT, ChunkFormat, is_aligned, probe_direct_io
from kvtier.tiers.disk.names import (
    SPARE_DIR,
    TmpNames,
    chunk_key,
    chunk_name,
    hh_of,
    is_hh_dir,
    is_tmp,
)
from kvtier.tiers.disk.root import dir_mode_for, open_dir

__all__ = ["BLOCK", "ChunkFiles", "FileScan", "is_aligned", "probe_direct_io"]

# files kept for reuse; the directory exceeds the byte budget by at most this many
MAX_SPARES = 64
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True)
class FileScan:
    """What a scan of the chunk files found: chunk keys newest file first, and what it removed."""

    keys: list[OffloadKey] = field(default_factory=list)
    num_tmp_removed: int = 0
    num_garbage_removed: int = 0


class ChunkFiles:
    """The chunk files of one namespace directory.

    Args:
        directory: `<root>/<namespace id hex>`, for messages.
        dir_fd: a descriptor of it (`root.make_directory`); closed by `close`.
        namespace_id: written into and checked against every header.
        payload_bytes: bytes of one chunk's payload (every rank's buffer).
        direct_io: use O_DIRECT for chunks whose buffers are all aligned.
        fsync: fsync each file before its rename, and the directory after it.
        file_mode: the mode of every chunk file (directories: the same plus search).
    """

    def __init__(
        self,
        directory: str,
        dir_fd: int,
        namespace_id: bytes,
        payload_bytes: int,
        *,
        direct_io: bool,
        fsync: bool,
        file_mode: int = 0o600,
    ):
        self.directory = directory
        self.format = ChunkFormat(namespace_id, payload_bytes)
        self.file_bytes = self.format.file_bytes
        self.direct_io = direct_io
        self.fsync = fsync
        self.file_mode = file_mode
        self.dir_mode = dir_mode_for(file_mode)
        self._names = TmpNames()
        self._fds = [dir_fd]
        self._close = weakref.finalize(self, _close_all, self._fds)
        self._dir_fd = dir_fd
        try:
            self._spare_fd = open_dir(dir_fd, SPARE_DIR, mode=self.dir_mode, create=True)
        except OSError as exc:
            self.close()
            raise ConfigError(
                f"disk tier directory {directory!r}: its spare/ is not a plain directory "
                f"({exc.strerror}); remove it"
            ) from None
        self._fds.append(self._spare_fd)
        # names in spare/; append / popleft are atomic: no lock
        self._spares: deque[str] = deque()

    def close(self) -> None:
        """Close the directories' descriptors (idempotent); no other method may run after it."""
        self._close()

    @contextlib.contextmanager
    def _hh(self, key: OffloadKey, create: bool = False) -> Iterator[tuple[int, str]]:
        """(a descriptor of `key`'s hh directory, the file name of `key` in it)."""
        fd = open_dir(self._dir_fd, hh_of(key), mode=self.dir_mode, create=create)
        try:
            yield fd, chunk_name(key)
        finally:
            os.close(fd)

    def write_tmp(self, key: OffloadKey, buffers: Sequence[memoryview]) -> tuple[str, bool]:
        """Write `key`'s file under a fresh temporary name.

        Returns:
            (the temporary file's name in `key`'s hh directory, whether O_DIRECT was used).
        Raises:
            OSError: the write failed; the temporary file is already removed.
        """
        views = [memoryview(buf).cast("B") for buf in buffers]
        direct = self.direct_io and is_aligned(views)
        with self._hh(key, create=True) as (hh_fd, name):
            tmp = self._names.tmp_name(key)
            fd = self._open_tmp(hh_fd, tmp, direct)
            try:
                self.format.write(fd, key, views, direct)
                if self.fsync:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                _discard(tmp, hh_fd)
                raise
            os.close(fd)
        return tmp, direct

    def publish(self, tmp: str, key: OffloadKey) -> None:
        """Give the complete temporary file its final name (atomically replacing any older one)."""
        with self._hh(key) as (hh_fd, name):
            os.rename(tmp, name, src_dir_fd=hh_fd, dst_dir_fd=hh_fd)
            # the rename itself is durable only once the directory is
            if self.fsync:
                os.fsync(hh_fd)

    def discard_tmp(self, tmp: str, key: OffloadKey) -> None:
        """Remove a temporary file `write_tmp` made (gone already: nothing to do)."""
        with contextlib.suppress(FileNotFoundError), self._hh(key) as (hh_fd, _):
            _discard(tmp, hh_fd)

    def read(self, key: OffloadKey, buffers: Sequence[memoryview]) -> tuple[str | None, bool]:
        """Read `key`'s file straight into `buffers` and check it.

        Returns:
            (why the file is not a valid value of `key`, or None; whether O_DIRECT was used).
        Raises:
            OSError: the file could not be opened or read (FileNotFoundError: it is gone;
                ELOOP: it, or its hh directory, is a symlink).
        """
        views = [memoryview(buf).cast("B") for buf in buffers]
        direct = self.direct_io and is_aligned(views)
        with self._hh(key) as (hh_fd, name):
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | (O_DIRECT if direct else 0), dir_fd=hh_fd)
        try:
            return self.format.read(fd, key, views), direct
        finally:
            os.close(fd)

    def unlink(self, key: OffloadKey) -> None:
        with contextlib.suppress(FileNotFoundError), self._hh(key) as (hh_fd, name):
            _discard(name, hh_fd)

    def retire(self, key: OffloadKey) -> None:
        """Take `key`'s final name away, keeping the file as a spare for a later write."""
        if len(self._spares) >= MAX_SPARES:
            self.unlink(key)
            return
        spare = self._names.unique_suffix()
        with contextlib.suppress(FileNotFoundError), self._hh(key) as (hh_fd, name):
            os.rename(name, spare, src_dir_fd=hh_fd, dst_dir_fd=self._spare_fd)
            self._spares.append(spare)

    def _take_spare(self, hh_fd: int, tmp: str) -> bool:
        """Rename a spare to `tmp` in `hh_fd`; False when there is none left."""
        while True:
            try:
                spare = self._spares.popleft()
            except IndexError:
                return False
            # another engine took it
            with contextlib.suppress(FileNotFoundError):
                os.rename(spare, tmp, src_dir_fd=self._spare_fd, dst_dir_fd=hh_fd)
                return True

    def adopt_spares(self) -> None:
        """Reuse the spares a previous run left (beyond MAX_SPARES they are deleted, and anything
        in spare/ that is not a plain file, such as a planted symlink, too)."""
        for entry in _entries(self._spare_fd):
            if len(self._spares) < MAX_SPARES and entry.is_file(follow_symlinks=False):
                self._spares.append(entry.name)
            else:
                # a directory is left alone: it is never used
                with contextlib.suppress(OSError):
                    _discard(entry.name, self._spare_fd)

    def scan(self) -> FileScan:
        """Every chunk file's key, newest first, from names alone (contents are checked at load).

        Removes temporary files no writer will finish and entries that are not chunk files
        (symlinks included); an hh directory that is a symlink is never entered.
        """
        result = FileScan()
        found: list[tuple[int, OffloadKey]] = []
        for sub in _entries(self._dir_fd):
            if not is_hh_dir(sub.name):
                continue
            try:
                hh_fd = open_dir(self._dir_fd, sub.name, mode=self.dir_mode)
            # a symlink, a file, or gone meanwhile
            except OSError:
                continue
            try:
                for entry in _entries(hh_fd):
                    self._scan_entry(hh_fd, entry, sub.name, found, result)
            finally:
                os.close(hh_fd)
        found.sort(reverse=True)
        result.keys = [key for _, key in found]
        return result

    def _scan_entry(
        self, hh_fd: int, entry: os.DirEntry, hh: str, found: list, result: FileScan
    ) -> None:
        name = entry.name
        # another engine may delete files meanwhile
        with contextlib.suppress(FileNotFoundError):
            key = chunk_key(name, hh)
            if key is not None and entry.is_file(follow_symlinks=False):
                found.append((entry.stat(follow_symlinks=False).st_mtime_ns, key))
            elif is_tmp(name) and not entry.is_symlink():
                if self._names.is_abandoned(entry):
                    os.unlink(name, dir_fd=hh_fd)
                    result.num_tmp_removed += 1
            elif not entry.is_dir(follow_symlinks=False):
                os.unlink(name, dir_fd=hh_fd)
                result.num_garbage_removed += 1

    def _unique_suffix(self) -> str:
        """`<writer>.<pid>.<n>`: a name no other engine sharing the directory makes (`names.TmpNames`)."""
        return self._names.unique_suffix()

    def _open_tmp(self, hh_fd: int, tmp: str, direct: bool) -> int:
        """A file named `tmp` in `hh_fd` to write, of mode `file_mode`: a spare renamed there, else a new file."""
        flags = os.O_WRONLY | _NOFOLLOW | (O_DIRECT if direct else 0)
        if self._take_spare(hh_fd, tmp):
            try:
                fd = os.open(tmp, flags, dir_fd=hh_fd)
            except OSError:
                _discard(tmp, hh_fd)
                raise
            # the spare was a damaged, longer file
            if os.fstat(fd).st_size > self.file_bytes:
                os.ftruncate(fd, self.file_bytes)
        else:
            fd = os.open(tmp, flags | os.O_CREAT | os.O_EXCL, self.file_mode, dir_fd=hh_fd)
        # exact, whatever the umask or a spare's older mode
        os.fchmod(fd, self.file_mode)
        return fd


def _discard(name: str, dir_fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def _entries(dir_fd: int) -> list[os.DirEntry]:
    try:
        with os.scandir(dir_fd) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []
