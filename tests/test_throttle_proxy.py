"""The bandwidth-limited loopback proxy (benchmarks/servers/throttle.py) that makes a shared tier slow on purpose.

Plain sockets through the proxy to an echo server started here, and one redis-server (the
`fresh_redis` fixture of tests/redis_servers.py) behind it. Timing on 2 cores is noisy: the rate
tests assert only lower bounds (the limiter limits), with 40 % slack on the ideal time, never how
fast anything is.
"""

from __future__ import annotations

import contextlib
import random
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# last on the path, as tests/redis_servers.py puts it: a benchmark module never shadows an installed one
sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))

from helpers import HANG_S, wait_until

# benchmarks/servers/, on sys.path above
from servers.throttle import ThrottledProxy

KiB, MiB = 1 << 10, 1 << 20
# a rate test passes when it took at least this share of the ideal time
SLACK = 0.6
# a rate that does not limit these tests
FAST = 256 * MiB


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


class EchoServer:
    """A loopback server that sends back what it reads; at the client's EOF it closes its write end."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            while data := conn.recv(64 * KiB):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self.thread.join(HANG_S)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


def connect(proxy: ThrottledProxy) -> socket.socket:
    return socket.create_connection((proxy.host, proxy.port), timeout=HANG_S)


def read_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(min(size - len(buf), 256 * KiB))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def round_trip(sock: socket.socket, data: bytes) -> bytes:
    """Send `data` from a thread while reading as much back (the echo cannot stall on full buffers)."""
    sender = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
    sender.start()
    received = read_exactly(sock, len(data))
    sender.join(HANG_S)
    return received


def exchange(proxy: ThrottledProxy, data: bytes) -> bytes:
    """One connection: send `data`, close the write end, read everything until EOF."""
    with connect(proxy) as sock:

        def send() -> None:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        # one more than sent: returns at EOF only
        received = read_exactly(sock, len(data) + 1)
        sender.join(HANG_S)
        return received


def test_bytes_round_trip_intact_and_half_close(echo):
    data = payload(1 * MiB)
    with ThrottledProxy(echo.port, FAST) as proxy:
        # 1 MiB of random bytes out and back, then EOF: the client's half-close reached the echo
        # server through the proxy, and the echo server's close came back
        assert exchange(proxy, data) == data
        # both directions counted, every byte once
        assert proxy.bytes_forwarded == 2 * len(data)


def test_rate_limit_holds(echo):
    rate, size = 8 * MiB, 2 * MiB
    data = payload(size)
    with ThrottledProxy(echo.port, rate) as proxy:
        # 2 MiB through an 8 MiB/s link: at least ~0.25 s (both directions pipelined, each limited)
        start = time.monotonic()
        assert exchange(proxy, data) == data
        elapsed = time.monotonic() - start
    assert elapsed >= SLACK * size / rate, f"{size} bytes at {rate} B/s took only {elapsed:.3f} s"


def test_parallel_connections_share_one_budget(echo):
    rate, per_conn, conns = 8 * MiB, 512 * KiB, 4
    results: list[bytes] = [b""] * conns
    with ThrottledProxy(echo.port, rate) as proxy:
        # four connections at once, 512 KiB each: 2 MiB on one 8 MiB/s link takes ~0.25 s
        # (a bucket per connection would let them through in ~0.06 s)
        def run(i: int) -> None:
            results[i] = exchange(proxy, payload(per_conn, seed=i))

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(conns)]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_S)
        elapsed = time.monotonic() - start
    # every connection got its own bytes back
    assert results == [payload(per_conn, seed=i) for i in range(conns)]
    assert (
        elapsed >= SLACK * conns * per_conn / rate
    ), f"{conns} x {per_conn} bytes took only {elapsed:.3f} s"


def test_set_rate_slows_a_running_connection(echo):
    slow, size = 4 * MiB, 1 * MiB
    with ThrottledProxy(echo.port, FAST) as proxy, connect(proxy) as sock:
        # a fast link first: its burst alone (5 MiB) would carry the next step's megabyte at once
        assert round_trip(sock, payload(256 * KiB)) == payload(256 * KiB)
        # made slow on the same open connection: 1 MiB at 4 MiB/s takes at least ~0.25 s
        proxy.set_rate(slow)
        assert proxy.rate == slow
        start = time.monotonic()
        assert round_trip(sock, payload(size, seed=1)) == payload(size, seed=1)
        elapsed = time.monotonic() - start
    assert elapsed >= SLACK * size / slow, f"{size} bytes at {slow} B/s took only {elapsed:.3f} s"


def test_latency_delays_each_way(echo):
    latency = 0.05
    with ThrottledProxy(echo.port, FAST, latency_s=latency) as proxy, connect(proxy) as sock:
        # one byte out and back crosses the link twice: at least 2 x 50 ms
        start = time.monotonic()
        assert round_trip(sock, b"x") == b"x"
        elapsed = time.monotonic() - start
    assert elapsed >= 2 * latency * 0.9


def test_close_while_a_connection_is_active(echo):
    proxy = ThrottledProxy(echo.port, 256 * KiB).start()
    port = proxy.port
    sock = connect(proxy)

    # a client pushes 4 MiB through a 256 KiB/s link (16 s worth) from a thread of its own
    def send() -> None:
        # the proxy goes away mid-send
        with contextlib.suppress(OSError):
            sock.sendall(payload(4 * MiB))

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    deadline = time.monotonic() + HANG_S
    while proxy.bytes_forwarded == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.bytes_forwarded > 0
    # closing the proxy mid-transfer never waits for the transfer: the link forwarded less than the
    # 4 MiB (the rate limits it to 16 s, however fast the machine; a slow one forwards less, not more).
    # Not a bound on close()'s time: on a busy machine that is the scheduler's, not the proxy's.
    proxy.close()
    assert proxy.bytes_forwarded < 4 * MiB
    # a second close does nothing
    proxy.close()
    # the client sees its connection end: EOF after whatever was echoed, or a reset
    with contextlib.suppress(ConnectionResetError):
        while sock.recv(256 * KiB):
            pass
    sock.close()
    sender.join(HANG_S)
    assert not sender.is_alive()
    # none of the proxy's threads outlives it, and its port no longer accepts
    assert not [t for t in threading.enumerate() if t.name.startswith(f"throttle-{port}-")]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=HANG_S).close()


def test_an_error_closes_only_its_connection(echo):
    with ThrottledProxy(echo.port, 1 * MiB) as proxy:
        # a client resets its connection mid-transfer (SO_LINGER 0: RST instead of FIN)
        broken = connect(proxy)
        broken.sendall(payload(256 * KiB))
        broken.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        broken.close()
        # the proxy still serves a new connection, bytes intact
        assert exchange(proxy, payload(64 * KiB, seed=3)) == payload(64 * KiB, seed=3)


def test_a_refused_target_closes_the_client_only():
    # a target port that nothing listens on
    with socket.create_server(("127.0.0.1", 0)) as probe:
        dead_port = probe.getsockname()[1]
    with ThrottledProxy(dead_port, 1 * MiB) as proxy:
        # each client is accepted, then closed (EOF or reset), and the proxy keeps accepting
        for _ in range(2):
            with connect(proxy) as sock, contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""


def test_only_loopback_targets_and_positive_rates():
    # a target off this machine is refused, by address or by name
    for host in ("10.0.0.1", "8.8.8.8", "example.com"):
        with pytest.raises(ValueError, match="loopback"):
            ThrottledProxy(6379, 1 * MiB, target_host=host)
    # loopback addresses are fine (nothing is opened before start())
    ThrottledProxy(6379, 1 * MiB, target_host="::1")
    ThrottledProxy(6379, 1 * MiB, target_host="localhost")
    # a rate must be positive and finite, now and later
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            ThrottledProxy(6379, bad)
    with pytest.raises(ValueError):
        ThrottledProxy(6379, 1 * MiB).set_rate(0)


def test_redis_set_get_through_the_proxy(fresh_redis):
    import redis

    value = payload(1 * MiB, seed=7)
    with ThrottledProxy(fresh_redis.port, 64 * MiB) as proxy:
        # a real redis-server behind the slow link: SET then GET of 1 MiB returns the same bytes
        with redis.Redis(host=proxy.host, port=proxy.port, socket_timeout=HANG_S) as client:
            assert client.set("throttle:value", value)
            assert client.get("throttle:value") == value
        # the value crossed the link twice (plus the commands and replies around it). The proxy
        # counts a piece once it was sent: the client may have read the reply's last piece first
        wait_until(
            lambda: proxy.bytes_forwarded > 2 * len(value), "the proxy counted both crossings"
        )
