"""A throwaway `redis-server` for the benchmarks, on a free loopback port.

The tests have their own fixtures (tests/redis_servers.py); tests/ is not a package, so the
few lines needed here are kept here. Nothing is saved (no RDB, no AOF), and the temporary
data folder goes with the server.

Thread-safety: none; one owner starts and stops the server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

__all__ = ["REDIS_MISSING", "RedisProcess", "redis_server"]

# the server gets SIGTERM if the benchmark dies (util-linux's setpriv sets that, then execs it)
_DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
REDIS_MISSING = "redis-server not found on PATH: `make test` installs it (apt-get install -y redis-server)"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(16).startswith(b"+PONG")
    return False


@contextlib.contextmanager
def redis_server(*args: str, timeout_s: float = 10.0) -> Iterator[int]:
    """Start `redis-server` with `args` on a free port; yields the port, stops it afterwards."""
    with RedisProcess(*args, timeout_s=timeout_s) as server:
        yield server.port


class RedisProcess:
    """A `redis-server` on a free loopback port that can be paused, killed and started again on
    the same port (empty: nothing is saved). A context manager: started on entry, stopped on exit."""

    def __init__(self, *args: str, timeout_s: float = 10.0):
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit(REDIS_MISSING)
        self.port, self._binary, self._args, self._timeout_s = _free_port(), binary, args, timeout_s
        self._data = tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-")
        self._proc: subprocess.Popen | None = None
        self.is_paused = False
        # the parent-death signal fires when the *thread* that started the server ends: every start
        # runs on this one thread, which lives until __exit__ (a restart from a short-lived thread
        # would otherwise take the server down with that thread)
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="redis-launcher")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self._launcher.submit(self._start).result()

    def _start(self) -> None:
        data = self._data.name
        self._proc = subprocess.Popen([*_DIE_WITH_PARENT, self._binary, "--port", str(self.port), "--bind", "127.0.0.1",
                                       "--dir", data, "--save", "", "--appendonly", "no",
                                       "--logfile", f"{data}/redis.log", *self._args])
        deadline = time.monotonic() + self._timeout_s
        while not _answers(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections and answers nothing (a hung server)."""
        if self._proc is not None and not self.is_paused:
            os.kill(self._proc.pid, signal.SIGSTOP)
            self.is_paused = True

    def resume(self) -> None:
        if self._proc is not None and self.is_paused:
            os.kill(self._proc.pid, signal.SIGCONT)
            self.is_paused = False

    def stop(self) -> None:
        """Kill the server (its data is lost); `start()` brings up an empty one on the same port."""
        if self._proc is None:
            return
        self.resume()
        self._proc.terminate()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> RedisProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._launcher.shutdown()
        self._data.cleanup()
