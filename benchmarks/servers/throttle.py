"""A bandwidth-limited loopback TCP proxy: a slow network link in front of a real server.

`ThrottledProxy(target_port, bytes_per_s)` listens on a free loopback port and forwards every
connection it accepts to the target (a `redis-server` of servers/redis.py, say), so a test or a
benchmark meets a shared tier that is slow on purpose. Each direction of the link has one token
bucket that ALL connections share: a client's pool of parallel connections gets the link's
bandwidth between them, not once each. The bucket holds a small burst (20 ms of the rate, at
least 64 KiB) and pieces are forwarded no larger than it, so the limit holds at the scale of a
few milliseconds. `set_rate()` changes the rate while connections run (a link made fast, then
slow); `latency_s` delays every piece by that much one way, as a pipe does (pieces read while
earlier ones wait are queued, up to `MAX_QUEUED` bytes a direction, so the delay costs no
bandwidth).

A connection forwards with one thread per direction. A side that closes its write end has the
other side's write end shut down (half-close); when both directions are done, both sockets are
closed. An error on a connection (a reset, a refused target) closes that connection only.
`close()` stops accepting, closes every connection and joins every thread within a bounded time.
Loopback only: a target elsewhere is refused. Nothing here is part of kvtier; stdlib only.

Thread-safety: `set_rate()`, `bytes_forwarded` and `close()` may be called from any thread while
connections run; one owner starts and closes a proxy.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import select
import socket
import threading
import time
from collections import deque

__all__ = ["MAX_QUEUED", "MIN_BURST", "ThrottledProxy"]

HOST = "127.0.0.1"
# bytes: the smallest bucket (and largest piece) at any rate
MIN_BURST = 64 << 10
# the bucket holds this many seconds of the rate when that is more than MIN_BURST
BURST_S = 0.02
# a recv() never asks for more (a fast link's burst would be tens of MB)
MAX_PIECE = 1 << 20
# bytes a direction holds while `latency_s` delays them
MAX_QUEUED = 8 << 20
CONNECT_TIMEOUT_S = 5.0
# how often the accept loop looks at the stop flag (close() also wakes it)
ACCEPT_POLL_S = 0.2
# close() waits at most this long for all its threads together: only a hang reaches it (on a busy 2-core
# machine 5 s was reachable, and a thread still alive after close() failed the test that it ends)
JOIN_TIMEOUT_S = 60.0


def _check_rate(bytes_per_s: float) -> float:
    rate = float(bytes_per_s)
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"bytes_per_s must be a positive finite number, got {bytes_per_s!r}")
    return rate


def _check_loopback(host: str) -> str:
    """`host` if it is a loopback address (or "localhost"); ValueError otherwise."""
    if host == "localhost":
        return host
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"target_host must be a loopback address, got {host!r}") from None
    if not address.is_loopback:
        raise ValueError(f"target_host must be a loopback address, got {host!r}")
    return host


class _TokenBucket:
    """One direction's bandwidth, shared by every connection: reserve bytes, then sleep the debt.

    A reservation may drive the bucket below zero; the reserver sleeps until its own bytes are
    paid for, so concurrent reservers queue one behind another (their total stays at the rate)
    and nobody sleeps holding the lock.
    """

    def __init__(self, rate: float) -> None:
        self._lock = threading.Lock()
        self._rate = rate
        self._burst = self._burst_of(rate)
        # a fresh link starts with a full burst
        self._tokens = float(self._burst)
        self._stamp = time.monotonic()

    @staticmethod
    def _burst_of(rate: float) -> int:
        return max(MIN_BURST, int(rate * BURST_S))

    def set_rate(self, rate: float) -> None:
        with self._lock:
            # bytes earned so far are earned at the old rate
            self._refill(time.monotonic())
            self._rate = rate
            self._burst = self._burst_of(rate)
            self._tokens = min(self._tokens, self._burst)

    def piece_size(self) -> int:
        """The most bytes one forwarded piece may hold now."""
        with self._lock:
            return min(self._burst, MAX_PIECE)

    def reserve(self, n: int) -> float:
        """Take `n` bytes from the bucket; the seconds the caller must wait before sending them."""
        with self._lock:
            self._refill(time.monotonic())
            self._tokens -= n
            return max(0.0, -self._tokens / self._rate)

    def _refill(self, now: float) -> None:
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now


class _Link:
    """One accepted connection and its connection to the target; the last direction out closes both."""

    def __init__(self, client: socket.socket, target: socket.socket) -> None:
        self.client = client
        self.target = target
        self._lock = threading.Lock()
        self._open_directions = 2
        self._closed = False

    def abort(self) -> None:
        """Wake both directions (a blocked recv or sendall returns) so that they finish."""
        for sock in (self.client, self.target):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def direction_done(self) -> bool:
        """One direction finished; True when it was the last (both sockets are closed then)."""
        with self._lock:
            self._open_directions -= 1
            last = self._open_directions == 0
        if last:
            self.close()
        return last

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for sock in (self.client, self.target):
            with contextlib.suppress(OSError):
                sock.close()


class ThrottledProxy:
    """A loopback TCP proxy to `target_host:target_port` whose link carries `bytes_per_s` each way.

    Args:
        target_port: the server's port.
        bytes_per_s: the link's bandwidth in each direction (all connections together).
        target_host: the server's address; loopback only (ValueError otherwise).
        latency_s: one-way delay added to every forwarded piece (0: none).
    """

    def __init__(
        self,
        target_port: int,
        bytes_per_s: float,
        *,
        target_host: str = HOST,
        latency_s: float = 0.0,
    ) -> None:
        if not (math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"latency_s must be a finite number >= 0, got {latency_s!r}")
        self.target_host = _check_loopback(target_host)
        self.target_port = int(target_port)
        self.latency_s = float(latency_s)
        self.host = HOST
        rate = _check_rate(bytes_per_s)
        # client -> target
        self._up = _TokenBucket(rate)
        # target -> client
        self._down = _TokenBucket(rate)
        self._rate = rate
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._threads: list[threading.Thread] = []
        self._bytes_forwarded = 0
        self._listener: socket.socket | None = None
        self._port: int | None = None

    # -- the owner's side ---------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the proxy is not started")
        return self._port

    @property
    def rate(self) -> float:
        """The link's bandwidth, bytes per second in each direction."""
        return self._rate

    @property
    def bytes_forwarded(self) -> int:
        """Bytes delivered so far, both directions and all connections together."""
        with self._lock:
            return self._bytes_forwarded

    def set_rate(self, bytes_per_s: float) -> None:
        """A new bandwidth for both directions, from the next piece on (the running ones too)."""
        rate = _check_rate(bytes_per_s)
        self._up.set_rate(rate)
        self._down.set_rate(rate)
        self._rate = rate

    def start(self) -> ThrottledProxy:
        """Listen on a free loopback port and accept connections from a thread of its own."""
        if self._stop.is_set():
            raise RuntimeError("a closed proxy cannot start again")
        if self._listener is not None:
            return self
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, 0))
        listener.listen(64)
        listener.settimeout(ACCEPT_POLL_S)
        self._listener = listener
        self._port = listener.getsockname()[1]
        self._spawn(self._thread(self._accept_loop, f"throttle-{self._port}-accept"))
        return self

    def close(self) -> None:
        """Stop accepting, close every connection, join every thread (bounded; a second call does nothing)."""
        if self._stop.is_set():
            return
        # also wakes every direction sleeping for tokens or latency
        self._stop.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                # wakes a blocked accept() on Linux
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            links = list(self._links)
            threads = list(self._threads)
        for link in links:
            link.abort()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        # a thread that did not finish in time still leaves no socket open
        for link in links:
            link.close()

    def __enter__(self) -> ThrottledProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the threads ----------------------------------------------------------------------------

    def _spawn(self, *threads: threading.Thread, link: _Link | None = None) -> bool:
        """Register and start `threads` (and `link`) at once; False, starting none, once closing.

        All under the lock that close() takes to list what it joins: a connection accepted while
        close() runs has either both its threads joined, or neither started (close() set the flag
        first). Registering one direction's thread, then the other's, let close() list the first
        and miss the second, which then outlived the proxy.
        """
        with self._lock:
            if self._stop.is_set():
                return False
            if link is not None:
                self._links.add(link)
            # the list stays as long as the live ones
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.extend(threads)
            for thread in threads:
                thread.start()
        return True

    @staticmethod
    def _thread(target, name: str, *args: object) -> threading.Thread:
        return threading.Thread(target=target, args=args, name=name, daemon=True)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        count = 0
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                # the listener was closed
                return
            count += 1
            try:
                self._open_link(client, count)
            # the target refused or vanished: this connection only
            except OSError:
                with contextlib.suppress(OSError):
                    client.close()

    def _open_link(self, client: socket.socket, count: int) -> None:
        client.settimeout(None)
        target = socket.create_connection(
            (self.target_host, self.target_port), timeout=CONNECT_TIMEOUT_S
        )
        target.settimeout(None)
        # the proxy already sends in pieces: Nagle would only add delay
        for sock in (
            client,
            target,
        ):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = _Link(client, target)
        name = f"throttle-{self._port}-{count}"
        up = self._thread(self._forward, f"{name}-up", link, client, target, self._up)
        down = self._thread(self._forward, f"{name}-down", link, target, client, self._down)
        # close() ran while we connected: it will not see this link
        if not self._spawn(up, down, link=link):
            link.close()

    def _forward(
        self, link: _Link, src: socket.socket, dst: socket.socket, bucket: _TokenBucket
    ) -> None:
        """One direction of one connection, until its source's EOF, an error or close()."""
        try:
            if self._pump(src, dst, bucket):
                with contextlib.suppress(OSError):
                    # half-close: the other side reads EOF, may still answer
                    dst.shutdown(socket.SHUT_WR)
        except OSError:
            # a reset or a broken pipe ends the connection (both directions), nothing else
            link.abort()
        finally:
            if link.direction_done():
                with self._lock:
                    self._links.discard(link)

    def _pump(self, src: socket.socket, dst: socket.socket, bucket: _TokenBucket) -> bool:
        """Forward `src` to `dst` through the bucket; True at the source's EOF, False when closed.

        Pieces wait in `pending` until `latency_s` after they were read (at once when it is 0),
        then for their tokens; the source is read meanwhile, so the delay is a pipe's.
        """
        pending: deque[tuple[float, bytes]] = deque()
        queued = 0
        at_eof = False
        poller = select.poll()
        poller.register(src, select.POLLIN)
        while not self._stop.is_set():
            now = time.monotonic()
            if pending and pending[0][0] <= now:
                piece = pending.popleft()[1]
                queued -= len(piece)
                wait = bucket.reserve(len(piece))
                if wait > 0 and self._stop.wait(wait):
                    return False
                dst.sendall(piece)
                with self._lock:
                    self._bytes_forwarded += len(piece)
                continue
            # nothing more to read (now): wait for the head's time
            if at_eof or queued >= MAX_QUEUED:
                if not pending:
                    return True
                self._stop.wait(pending[0][0] - now)
                continue
            timeout_ms = None if not pending else max(0, math.ceil((pending[0][0] - now) * 1000))
            if not poller.poll(timeout_ms):
                continue
            piece = src.recv(bucket.piece_size())
            if not piece:
                at_eof = True
                continue
            pending.append((time.monotonic() + self.latency_s, piece))
            queued += len(piece)
        return False
