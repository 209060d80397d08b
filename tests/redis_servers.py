"""Redis servers for the tests (single, with an ACL user, a 3-node cluster), started on free loopback ports.

Every server is a real `redis-server` started by the test process, never one assumed to be
running; its data lives in a temporary folder (no RDB, no AOF) that goes when the session ends.
The launcher, `RedisServer`, is benchmarks/servers/redis.py's (the benchmarks start theirs with it too).

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
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# last on the path: a benchmark module never shadows an installed one
sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))

from helpers import HANG_S

# benchmarks/servers/, on sys.path above
from servers.redis import (
    HOST,
    find_redis_server,
    free_port,
)
from servers.redis import RedisServer as Launcher
from servers.tls import make_certificates

# redis-py is imported when a server is first used: collecting other tests never needs it
if TYPE_CHECKING:
    import redis
    from redis.cluster import RedisCluster

__all__ = ["ACL_PASSWORD", "ACL_USER", "RedisClusterServers", "RedisServer", "free_port"]

ACL_USER = "kvtier"
ACL_PASSWORD = "acl-secret-3f9b2e"


@dataclass
class RedisServer(Launcher):
    """The benchmarks' launcher with the tests' ceilings: its start waits for the first PONG, and a raw
    client's command for its answer, up to HANG_S (the launcher's 10 s and 5 s are bounds a busy
    machine's server, descheduled for seconds, could reach)."""

    start_timeout_s: float = HANG_S

    def client(self, **kwargs) -> redis.Redis:
        kwargs.setdefault("socket_timeout", HANG_S)
        return super().client(**kwargs)


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
                raise RuntimeError(
                    f"cluster node {node.port} was stopped by a test; restart it there"
                )
        self.flush()
        return self

    def wait_ok(self, timeout_s: float = HANG_S) -> None:
        """Until every node says `cluster_state:ok` (bounded)."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            while _cluster_state(node) != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"cluster node {node.port} not ok after {timeout_s} s: {_cluster_state(node)}"
                    )
                time.sleep(0.05)


def _cluster_state(node: RedisServer) -> str:
    with node.client() as client:
        # redis-py parses CLUSTER INFO into a dict
        return str(client.cluster("INFO").get("cluster_state"))


@contextlib.contextmanager
def _servers(
    count: int, args: list[str], port: int | None = None, **options
) -> Iterator[list[RedisServer]]:
    try:
        find_redis_server()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
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
    acl = [
        "--user",
        "default",
        "off",
        "--user",
        ACL_USER,
        "on",
        f">{ACL_PASSWORD}",
        "~*",
        "&*",
        "+@all",
    ]
    with _servers(1, acl, username=ACL_USER, password=ACL_PASSWORD) as (server,):
        yield server


@pytest.fixture(scope="session")
def redis_server_tls() -> Iterator[RedisServer]:
    """A server on TLS only, its certificate signed by `server.tls_ca`."""
    if shutil.which("openssl") is None:
        pytest.fail(
            "openssl not found on PATH (it makes the TLS test's certificates): apt-get install -y openssl"
        )
    certs = Path(tempfile.mkdtemp(prefix="kvtier-redis-tls-"))
    make_certificates(certs)
    port = free_port()
    tls = [
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(certs / "server.pem"),
        "--tls-key-file",
        str(certs / "server.key"),
        "--tls-ca-cert-file",
        str(certs / "ca.pem"),
        "--tls-auth-clients",
        "no",
    ]
    with _servers(1, tls, port=port, tls_ca=certs / "ca.pem") as (server,):
        yield server
    shutil.rmtree(certs, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """Three primaries, slots spread by `redis-cli --cluster create`, waited for until ok."""
    # a node starved of CPU past the node timeout is marked failed by the others, and with no
    # replicas the cluster then refuses every command for seconds: no test here wants a failover
    args = [
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-node-timeout",
        "60000",
    ]
    with _servers(3, args) as nodes:
        addresses = [f"{HOST}:{node.port}" for node in nodes]
        subprocess.run(
            [
                shutil.which("redis-cli") or "redis-cli",
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
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
