"""Redis servers for the tests (single, with an ACL user, a 3-node cluster), started on free loopback ports.

Every server is a real `redis-server` started by the test process, never one assumed to be
running; its data lives in a temporary folder (no RDB, no AOF) that goes when the session ends.

Fixtures:
- `redis_server` (session): a `RedisServer` (`.host`, `.port`, `.url`, `.client()` a raw
  `redis.Redis`, `.kill()`, `.start()` on the same port, `.restart()`, `.paused()` a
  context manager that SIGSTOPs it, `.flush()`).
- `redis_server_acl` (session): a `RedisServer` whose default user is off; ACL user
  `ACL_USER` with password `ACL_PASSWORD` may do anything (`.username`, `.password`).
- `redis_server_tls` (session): a `RedisServer` that speaks only TLS (`.url` is `rediss://…`),
  its certificate (for 127.0.0.1) signed by the test CA in `.tls_ca`.
- `redis_cluster` (session): a `RedisClusterServers`: three primaries (`.nodes`), every slot
  assigned, `cluster_state:ok`; `.url` names the first node, `.client()` is a raw
  `redis.cluster.RedisCluster`, `.flush()` empties every node.
- `fresh_redis`, `fresh_redis_cluster` (function): the same servers, running, not paused and
  empty at the start of the test (a fault test may leave its server killed or stopped); a
  test of another session server calls its `.ready()` for the same.

Thread-safety: none; the test's own thread starts, pauses, kills and flushes the servers.
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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # redis-py is imported when a server is first used: collecting other tests never needs it
    import redis
    from redis.cluster import RedisCluster

ACL_USER = "kvtier"
ACL_PASSWORD = "acl-secret-3f9b2e"
HOST = "127.0.0.1"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
# A server gets SIGTERM when the test process dies, so a killed pytest leaves none behind
# (util-linux's setpriv sets the parent-death signal, then execs the server).
_DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
MISSING = "redis-server not found on PATH: `make test` installs it (apt-get install -y redis-server)"


def _redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.fail(MISSING)
    return path


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port that is free, and whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 50000)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair found")


@dataclass
class RedisServer:
    """One `redis-server` process on a fixed loopback port (restartable on the same port)."""

    port: int
    dir: Path
    args: list[str] = field(default_factory=list)
    username: str | None = None
    password: str | None = None
    tls_ca: Path | None = None  # the CA that signed the server's certificate: the server speaks only TLS
    host: str = HOST
    proc: subprocess.Popen | None = None

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
        """Start the server (again) on its port unless it runs; returns once it answers PING.

        Call it from the test's main thread: the server is sent SIGTERM when the thread that
        started it ends (so that a killed pytest leaves no server behind).
        """
        if self.is_running():
            return  # a second server could not bind the port, and the running one would be lost
        cmd = [_redis_server_binary(), "--port", str(self.port), "--bind", self.host, "--dir", str(self.dir),
               "--save", "", "--appendonly", "no", "--logfile", str(self.dir / "redis.log"),
               "--enable-debug-command", "local", *self.args]
        self.proc = subprocess.Popen(_DIE_WITH_PARENT + cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        with contextlib.suppress(Exception), self.client(socket_timeout=0.5, socket_connect_timeout=0.5) as client:
            return bool(client.ping())
        return False

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM, wait a bounded time, then SIGKILL."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
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

    def restart(self) -> None:
        self.kill()
        self.start()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP the server for the block: connections open, nothing answered."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def ready(self) -> RedisServer:
        """Running, answering and empty (for a test that follows a fault test)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
        if not self.is_running():
            self.start()
        self.flush()
        return self

    def flush(self) -> None:
        with self.client() as client:
            client.flushall()


@dataclass
class RedisClusterServers:
    """Three cluster-enabled primaries holding every hash slot between them."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def client(self, **kwargs) -> RedisCluster:
        from redis.cluster import RedisCluster

        return RedisCluster(host=HOST, port=self.nodes[0].port, **kwargs)

    def flush(self) -> None:
        for node in self.nodes:
            node.flush()

    def ready(self) -> RedisClusterServers:
        for node in self.nodes:
            if not node.is_running():
                raise RuntimeError(f"cluster node {node.port} was stopped by a test; restart it there")
        self.flush()
        return self

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Until every node says `cluster_state:ok` (bounded)."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            while _cluster_state(node) != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster node {node.port} not ok after {timeout_s} s: {_cluster_state(node)}")
                time.sleep(0.05)


def _cluster_state(node: RedisServer) -> str:
    with node.client() as client:
        return str(client.cluster("INFO").get("cluster_state"))  # redis-py parses CLUSTER INFO into a dict


@contextlib.contextmanager
def _servers(count: int, args: list[str], port: int | None = None, **options) -> Iterator[list[RedisServer]]:
    root = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
    servers = []
    try:
        for i in range(count):
            (root / str(i)).mkdir()
            servers.append(RedisServer(port or free_port(), root / str(i), list(args), **options))
            servers[-1].start()
        yield servers
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One plain server (no password) for the session."""
    with _servers(1, []) as (server,):
        yield server


@pytest.fixture(scope="session")
def redis_server_acl() -> Iterator[RedisServer]:
    """A server whose only user is `ACL_USER` / `ACL_PASSWORD` (the default user is off)."""
    acl = ["--user", "default", "off", "--user", ACL_USER, "on", f">{ACL_PASSWORD}", "~*", "&*", "+@all"]
    with _servers(1, acl, username=ACL_USER, password=ACL_PASSWORD) as (server,):
        yield server


def _make_certificates(folder: Path) -> dict[str, Path]:
    """A throwaway CA, and a certificate for 127.0.0.1 that it signs (openssl, EC keys: fast)."""
    files = {name: folder / name for name in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt", "san")}
    files["san"].write_text(f"subjectAltName=IP:{HOST}\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (["req", "-x509", *ec, "-keyout", files["ca.key"], "-out", files["ca.crt"], "-days", "2",
                 "-subj", "/CN=kvtier test CA"],
                ["req", *ec, "-keyout", files["server.key"], "-out", files["server.csr"], "-subj", f"/CN={HOST}"],
                ["x509", "-req", "-in", files["server.csr"], "-CA", files["ca.crt"], "-CAkey", files["ca.key"],
                 "-CAcreateserial", "-out", files["server.crt"], "-days", "2", "-extfile", files["san"]]):
        subprocess.run(["openssl", *map(str, cmd)], check=True, capture_output=True, timeout=30)
    return files


@pytest.fixture(scope="session")
def redis_server_tls() -> Iterator[RedisServer]:
    """A server on TLS only, its certificate signed by `server.tls_ca`."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl not found on PATH (it makes the TLS test's certificates): apt-get install -y openssl")
    certs = _make_certificates(Path(tempfile.mkdtemp(prefix="kvtier-redis-tls-")))
    port = free_port()
    tls = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs["server.crt"]),
           "--tls-key-file", str(certs["server.key"]), "--tls-ca-cert-file", str(certs["ca.crt"]),
           "--tls-auth-clients", "no"]
    with _servers(1, tls, port=port, tls_ca=certs["ca.crt"]) as (server,):
        yield server
    shutil.rmtree(certs["ca.crt"].parent, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """Three primaries, slots spread by `redis-cli --cluster create`, waited for until ok."""
    args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]
    with _servers(3, args) as nodes:
        addresses = [f"{HOST}:{node.port}" for node in nodes]
        subprocess.run([shutil.which("redis-cli") or "redis-cli", "--cluster", "create", *addresses,
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        cluster = RedisClusterServers(nodes)
        cluster.wait_ok()
        yield cluster


@pytest.fixture
def fresh_redis(redis_server: RedisServer) -> RedisServer:
    """The session's single server, running, answering and empty."""
    return redis_server.ready()


@pytest.fixture
def fresh_redis_cluster(redis_cluster: RedisClusterServers) -> RedisClusterServers:
    """The session's cluster, empty."""
    return redis_cluster.ready()
