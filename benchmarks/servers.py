"""A throwaway `redis-server` for the benchmarks, on a free loopback port.

The tests have their own fixtures (tests/redis_servers.py); tests/ is not a package, so the
few lines needed here are kept here. Nothing is saved (no RDB, no AOF), and the temporary
data folder goes with the server.

Thread-safety: none; one owner starts and stops the server.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

__all__ = ["REDIS_MISSING", "redis_server"]

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
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(REDIS_MISSING)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-") as data:
        proc = subprocess.Popen([*_DIE_WITH_PARENT, binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", data,
                                 "--save", "", "--appendonly", "no", "--logfile", f"{data}/redis.log", *args])
        try:
            deadline = time.monotonic() + timeout_s
            while not _answers(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}")
                time.sleep(0.02)
            yield port
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
