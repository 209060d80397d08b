"""The disk tier's directory of the served soak's kvtier server (its Redis server is
benchmarks/servers/redis.py's `RedisServer`).

- `DiskDir`: a temporary directory, on a small tmpfs of its own (root only) when the
  disk_full fault must fill its filesystem.

Thread-safety: none; the soak's main thread uses it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["DiskDir"]


class DiskDir:
    """The disk tier's root: a temporary directory, or a tmpfs of `tmpfs_bytes` mounted there
    (root only), which `fill` fills to the last byte and `unfill` frees again."""

    def __init__(self, tmpfs_bytes: int | None = None, parent: str | None = None):
        self.path = Path(tempfile.mkdtemp(prefix="kvtier-soak-disk-", dir=parent))
        self.mounted = False
        # not a chunk file's name: the tier never reads it
        self._ballast = self.path / "ballast"
        if tmpfs_bytes is not None:
            done = subprocess.run(
                [
                    "mount",
                    "-t",
                    "tmpfs",
                    "-o",
                    f"size={tmpfs_bytes},mode=0700",
                    "tmpfs",
                    str(self.path),
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if done.returncode != 0:
                raise RuntimeError(f"cannot mount a tmpfs at {self.path}: {done.stderr.strip()}")
            self.mounted = True

    def fill(self) -> int:
        """Write a file until the filesystem is full (ENOSPC); returns the bytes written."""
        written = 0
        size = 1 << 20
        fd = os.open(self._ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while size >= 512:
                try:
                    written += os.write(fd, b"\0" * size)
                except OSError:
                    # the last partial MiB, in ever smaller pieces
                    size //= 2
        finally:
            os.close(fd)
        return written

    def free_bytes(self) -> int:
        fs = os.statvfs(self.path)
        return fs.f_bavail * fs.f_frsize

    def unfill(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._ballast.unlink()

    def close(self) -> None:
        if self.mounted:
            subprocess.run(
                ["umount", "-l", str(self.path)], check=False, capture_output=True, timeout=30
            )
        shutil.rmtree(self.path, ignore_errors=True)
