"""A real `redis-server` on a loopback port, for the tests (tests/redis_servers.py's fixtures),
the benchmarks (bench_remote.py), the stack fuzzer and the served soak.

`RedisServer` is one server process on a fixed port: started, paused (SIGSTOP), killed and
started again on the same port, empty (nothing is saved: no RDB, no AOF). Its data folder is
`dir`; `RedisServer.temporary()` makes one on a free port and a temporary folder, which
`close()` (or leaving its `with` block) removes.

Thread-safety: one owner at a time starts, pauses, kills and stops a server, from any thread.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .ports import MIN_PORT, ephemeral_low

# redis-py is imported when a server is first asked something
if TYPE_CHECKING:
    import redis

__all__ = ["HOST", "REDIS_MISSING", "RedisServer", "find_redis_server", "free_port"]

HOST = "127.0.0.1"
REDIS_MISSING = (
    "redis-server not found on PATH: `make test` installs it (apt-get install -y redis-server)"
)
STOP_TIMEOUT_S = 5.0
# A server gets SIGTERM when its owner dies, so a killed pytest or benchmark leaves none behind
# (util-linux's setpriv sets the parent-death signal, then execs the server).
_DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []


def find_redis_server() -> str:
    """The `redis-server` binary on PATH; FileNotFoundError (saying how to install it) if none."""
    path = shutil.which("redis-server")
    if path is None:
        raise FileNotFoundError(REDIS_MISSING)
    return path


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port that is free, and whose cluster bus port (+10000) is free too; both below
    the ephemeral range (see servers/ports.py), so that a server restarted on them finds them free."""
    # the bus port too
    low, high = MIN_PORT, ephemeral_low() - 10000
    # a host whose ephemeral range starts low: any port, as a last resort
    if high - low < 1000:
        low, high = 20000, 50000
    for _ in range(200):
        port = random.randrange(low, high)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair found")


@dataclass
class RedisServer:
    """One `redis-server` process on a fixed loopback port (restartable on the same port).

    Args:
        port, dir: where it listens and keeps its log (`redis.log`); `dir` must exist.
        args: more `redis-server` options (a cluster node's, an ACL, TLS ports).
        username, password: what `client()` logs in with.
        tls_ca: the CA that signed the server's certificate: the server speaks only TLS.
        start_timeout_s: how long `start()` waits for the first PONG.
    """

    port: int
    dir: Path
    args: list[str] = field(default_factory=list)
    username: str | None = None
    password: str | None = None
    tls_ca: Path | None = None
    host: str = HOST
    start_timeout_s: float = 10.0
    proc: subprocess.Popen | None = None
    is_paused: bool = False

    @classmethod
    def temporary(cls, *args: str, prefix: str = "kvtier-redis-", **options) -> RedisServer:
        """A server (not started) on a free port, its folder a new temporary one that `close()` removes."""
        return cls(free_port(), Path(tempfile.mkdtemp(prefix=prefix)), list(args), **options)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls_ca else 'redis'}://{self.host}:{self.port}"

    def client(self, **kwargs) -> redis.Redis:
        """A raw redis-py client (with this server's credentials unless given)."""
        import redis

        kwargs.setdefault("username", self.username)
        kwargs.setdefault("password", self.password)
        kwargs.setdefault("socket_timeout", 5.0)
        if self.tls_ca is not None:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls_ca))
        return redis.Redis(host=self.host, port=self.port, **kwargs)

    def start(self) -> None:
        """Start the server (again) on its port unless it runs; returns once it answers PING."""
        if self.is_running():
            # a second server could not bind the port, and the running one would be lost
            return
        cmd = [
            find_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(self.dir / "redis.log"),
            "--enable-debug-command",
            "local",
            *self.args,
        ]
        self.proc = _launch(_DIE_WITH_PARENT + cmd, name=f"redis-server-{self.port}")
        self.is_paused = False
        deadline = time.monotonic() + self.start_timeout_s
        # its own answer: a server another process started on the port meanwhile (picked as free
        # while ours was down) would answer PING too, while ours exits unable to bind it
        while not (self.answers() and self._logged_ready()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")
            time.sleep(0.02)

    def _logged_ready(self) -> bool:
        """Whether this process (its pid starts each of its log lines) logged that it listens."""
        prefix = f"{self.proc.pid}:"
        with contextlib.suppress(OSError):
            text = (self.dir / "redis.log").read_text(errors="replace")
            return any(
                line.startswith(prefix) and "Ready to accept connections" in line
                for line in text.splitlines()
            )
        return False

    def answers(self) -> bool:
        with (
            contextlib.suppress(Exception),
            self.client(socket_timeout=0.5, socket_connect_timeout=0.5) as client,
        ):
            return bool(client.ping())
        return False

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM, wait a bounded time, then SIGKILL (nothing is saved: a started one is empty)."""
        if self.proc is None:
            return
        # a paused server cannot act on SIGTERM
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever (its data with it: nothing is saved)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)
            self.proc = None
            self.is_paused = False

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung server)."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.is_paused = True

    def resume(self) -> None:
        """SIGCONT (sent even when this object did not pause it: harmless to a running server)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
        self.is_paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Paused for the block, resumed after it."""
        assert self.proc is not None, "the server is not running"
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def ready(self) -> RedisServer:
        """Running, answering and empty (for a test that follows a fault test)."""
        self.resume()
        if not self.is_running():
            self.start()
        self.flush()
        return self

    def flush(self) -> None:
        with self.client() as client:
            client.flushall()

    def num_keys(self, pattern: str = "*") -> int:
        with self.client() as client:
            return sum(1 for _ in client.scan_iter(match=pattern, count=1000))

    def close(self) -> None:
        """Stop the server and remove its folder."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _launch(cmd: list[str], name: str) -> subprocess.Popen:
    """Start `cmd` from a thread of its own that lives as long as the process.

    The parent-death signal fires when the *thread* that started the process ends, not the
    process: started from a short-lived thread (the stack fuzzer restarts Redis from the thread
    running one configuration), the server would go down with that thread.
    """
    started: Future[subprocess.Popen] = Future()

    def run() -> None:
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(proc)
        proc.wait()

    threading.Thread(target=run, name=name, daemon=True).start()
    return started.result()
