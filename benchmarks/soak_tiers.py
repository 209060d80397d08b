"""What the kvtier server of the served soak (benchmarks/soak.py) stores into, besides RAM.

- `RedisProcess`: a `redis-server` on a free loopback port that can be killed and started
  again on the same port (nothing saved: a restarted server is empty).
- `DiskDir`: the disk tier's directory, on a small tmpfs of its own (root only) when the
  disk_full fault must fill its filesystem.

Thread-safety: none. Start and restart Redis from the main thread (`setpriv --pdeathsig`
sends it SIGTERM when the thread that started it ends).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from soak_serving import DIE_WITH_PARENT, free_port

__all__ = ["DiskDir", "RedisProcess"]


class RedisProcess:
    """`redis-server` on a fixed loopback port, nothing saved; `kill` then `start` = a restart."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            raise SystemExit("redis-server not found on PATH: `make test` installs it (apt-get install redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-soak-redis-"))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        cmd = [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
               "--save", "", "--appendonly", "no", "--logfile", str(self.dir / "redis.log")]
        self.proc = subprocess.Popen(DIE_WITH_PARENT + cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def answers(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
        return False

    def kill(self) -> None:
        """SIGKILL: the server and everything it held vanish at once."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def num_keys(self, pattern: str = "*") -> int:
        import redis

        with redis.Redis(port=self.port, socket_timeout=5) as client:
            return sum(1 for _ in client.scan_iter(match=pattern, count=1000))

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class DiskDir:
    """The disk tier's root: a temporary directory, or a tmpfs of `tmpfs_bytes` mounted there
    (root only), which `fill` fills to the last byte and `unfill` frees again."""

    def __init__(self, tmpfs_bytes: int | None = None, parent: str | None = None):
        self.path = Path(tempfile.mkdtemp(prefix="kvtier-soak-disk-", dir=parent))
        self.mounted = False
        self._ballast = self.path / "ballast"  # not a chunk file's name: the tier never reads it
        if tmpfs_bytes is not None:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs_bytes},mode=0700", "tmpfs",
                                   str(self.path)], capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise RuntimeError(f"cannot mount a tmpfs at {self.path}: {done.stderr.strip()}")
            self.mounted = True

    def fill(self) -> int:
        """Write a file until the filesystem is full (ENOSPC); returns the bytes written."""
        written, size = 0, 1 << 20
        fd = os.open(self._ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while size >= 512:
                try:
                    written += os.write(fd, b"\0" * size)
                except OSError:
                    size //= 2  # the last partial MiB, in ever smaller pieces
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
            subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True, timeout=30)
        shutil.rmtree(self.path, ignore_errors=True)
