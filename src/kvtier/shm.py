"""POSIX shared-memory segments, one file each in `/dev/shm`: their names, how one is created or
joined, whose it may be, and how a segment nobody maps any more is found and removed.

A segment is `kvtier-<instance>-dp<dp rank>-r<rank>` (`slab_name`), of `num_slots x slot_bytes`
bytes; what maps it and how is `kvtier.slab.HostSlab`.

- **Create or open**: whoever comes first creates it; the second checks that its size is what
  it computed itself. Both sides open this way because vLLM builds the workers' connectors
  (and registers their KV caches) *before* the scheduler's. A creator sizes and allocates the
  segment under a temporary name and publishes it with a hard link, so nobody ever maps one
  half made; if two race, the first link wins and the other joins it.
- **Ownership**: segments are created 0600; one that is a symlink or that another user made is
  refused (`ConfigError`): whoever owns it could read and write the KV bytes requests load.
- **Liveness**: every process that maps a segment holds `flock(LOCK_SH)` on it until it closes
  it; `remove_stale_slabs` unlinks the segments nobody holds (a SIGKILLed engine's, a crashed
  creator's temporary file). Between open and lock a cleaner may unlink the file: after
  locking, the fd's inode must still be the one at the path, or the open starts over.

Thread-safety: any function may run on any thread and in any process; `SegmentOpener.open` is
safe against rivals and cleaners in other processes (see above).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import stat
from dataclasses import dataclass
from typing import NamedTuple

from kvtier.errors import ConfigError

__all__ = [
    "SHM_DIR",
    "SLAB_PREFIX",
    "OpenedSegment",
    "SegmentOpener",
    "remove_stale_slabs",
    "shm_free_bytes",
    "slab_name",
]

SHM_DIR = "/dev/shm"
SLAB_PREFIX = "kvtier-"
# each one lost only to a cleaner or a rival creator in between: start over
_OPEN_ATTEMPTS = 8

logger = logging.getLogger(__name__)


def slab_name(instance_id: str, dp_rank: int, rank: int) -> str:
    """The segment name of one worker rank of one engine instance (vLLM's `instance_id`)."""
    if not instance_id:
        raise ConfigError(
            "the engine has no instance id, so its host slabs would have no unique name"
        )
    return f"{SLAB_PREFIX}{re.sub(r'[^A-Za-z0-9_.-]', '_', instance_id)}-dp{dp_rank}-r{rank}"


def shm_free_bytes(directory: str = SHM_DIR) -> int:
    """Bytes an unprivileged process can still allocate in `directory`'s filesystem."""
    fs = os.statvfs(directory)
    return fs.f_bavail * fs.f_frsize


class OpenedSegment(NamedTuple):
    """A segment this process holds: its fd (locked shared: see "Liveness" above) and mapping."""

    # whether this process created and published it (False: it joined one already there)
    is_creator: bool
    fd: int
    mm: mmap.mmap


@dataclass(frozen=True)
class SegmentOpener:
    """Creates or joins the segment at `path` of `num_slots x slot_bytes` bytes (see the module
    docstring); `kvtier.slab.HostSlab` maps what `open` returns.

    Args:
        path: the segment's file (`<directory>/<slab_name>`).
        num_slots, slot_bytes: the shape; an existing segment must hold exactly their product.
    """

    path: str
    num_slots: int
    slot_bytes: int

    @property
    def num_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def open(self) -> OpenedSegment:
        """Join the published segment, or create, publish and join one; again if a cleaner or a
        rival creator got in between.

        Raises:
            ConfigError: a segment of another size, another user's or a symlink at the path, no
                room for a new one, or a path that kept disappearing.
        """
        for _ in range(_OPEN_ATTEMPTS):
            joined = self._join()
            if joined is not None:
                return OpenedSegment(False, *joined)
            published_fd = self._create()
            if published_fd is None:
                continue
            try:
                # by its final name, so /proc/<pid>/maps and lsof show that name
                joined = self._join()
            finally:
                # only now: our lock kept cleaners off it until the join's lock
                os.close(published_fd)
            if joined is not None:
                return OpenedSegment(True, *joined)
        raise ConfigError(
            f"could not open the host slab {self.path}: it kept disappearing while being opened"
        )

    def _join(self) -> tuple[int, mmap.mmap] | None:
        """Lock and map the segment at the path; None if there is none (or it was swept before we held it)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        # ELOOP: a symlink planted under the segment's name
        except OSError as e:
            raise ConfigError(
                f"cannot open the host slab {self.path}: {e.strerror}; remove it"
            ) from None
        try:
            _check_owner(fd, self.path)
            _lock_shared(fd)
            if not _is_at_path(fd, self.path):
                os.close(fd)
                return None
            size = os.fstat(fd).st_size
            if size != self.num_bytes:
                raise ConfigError(
                    f"the host slab {self.path} holds {size} bytes but this process computed "
                    f"{self.num_slots} slots x {self.slot_bytes} bytes = {self.num_bytes}: the "
                    "scheduler and the workers disagree on the slab's shape (same cpu_bytes, "
                    "blocks_per_chunk and KV-cache layout everywhere?)"
                )
            return fd, mmap.mmap(
                fd, self.num_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(fd)
            raise

    def _create(self) -> int | None:
        """Allocate the segment under a temporary name, then publish it whole (a hard link), so
        nobody ever maps one half made. Returns the fd, still locked, of the published segment;
        None if a rival published first or a cleaner swept ours."""
        # under the prefix: swept if we crash
        temp = f"{self.path}.new-{os.getpid()}-{os.urandom(4).hex()}"
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        published = False
        try:
            _lock_shared(fd)
            if _is_at_path(fd, temp):
                self._allocate(fd)
                # a rival published first: we join theirs
                with contextlib.suppress(FileExistsError):
                    os.link(temp, self.path)
                    published = True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            if not published:
                os.close(fd)
        return fd if published else None

    def _allocate(self, fd: int) -> None:
        """Size the file and allocate its pages now: a full /dev/shm fails here, clearly, instead
        of as a SIGBUS in the middle of a copy."""
        directory = os.path.dirname(self.path)
        free = shm_free_bytes(directory)
        if self.num_bytes > free:
            raise ConfigError(
                f"the host slab {self.path} needs {self.num_bytes} bytes ({self.num_slots} slots x "
                f"{self.slot_bytes} bytes) but {directory} has {free} free; lower cpu_bytes or "
                "enlarge it (docker: --shm-size)"
            )
        os.ftruncate(fd, self.num_bytes)
        try:
            os.posix_fallocate(fd, 0, self.num_bytes)
        except OSError as e:
            # not supported: pages come with _populate
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise ConfigError(
                    f"could not allocate the host slab {self.path} ({self.num_bytes} bytes): "
                    f"{e.strerror}; lower cpu_bytes or enlarge {directory}"
                ) from None


def remove_stale_slabs(prefix: str = SLAB_PREFIX, directory: str = SHM_DIR) -> list[str]:
    """Unlink every segment under `prefix` that no live process maps (a crashed engine's).

    A process that maps a segment holds a shared lock on it; one whose lock can be taken
    exclusively has no such process left. Thread-safety: any thread, any process.
    Returns:
        The names removed.
    """
    removed = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(prefix))
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        # gone already, or not ours to open
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if stat.S_ISREG(os.fstat(fd).st_mode) and _is_at_path(fd, path):
                os.unlink(path)
                removed.append(name)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.ENOENT):
                logger.warning("kvtier: could not check the segment %s: %s", path, e)
        finally:
            os.close(fd)
    if removed:
        logger.info(
            "kvtier: removed %d stale host slab(s) of engines that are gone: %s",
            len(removed),
            removed,
        )
    return removed


def _check_owner(fd: int, path: str) -> None:
    """Refuse a segment another user made: its owner could read every tenant's KV in it and
    write bytes that requests would load (slab rows carry no checksum)."""
    uid = os.fstat(fd).st_uid
    if uid != os.geteuid():
        raise ConfigError(
            f"the host slab {path} belongs to uid {uid}, not to this process's user "
            f"(uid {os.geteuid()}): another user made it; remove it"
        )


def _lock_shared(fd: int) -> None:
    """Mark the segment live for as long as `fd` is open (a cleaner holds LOCK_EX only for a moment)."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def _is_at_path(fd: int, path: str) -> bool:
    """True when `fd` is still the file named `path` (a cleaner may have unlinked it)."""
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (at_path.st_dev, at_path.st_ino)
