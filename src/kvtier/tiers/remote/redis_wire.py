"""RESP2 framing of `RedisStore`'s pipelined commands, on a connection that redis-py opened.

- `set_command(name, parts, options)`: a SET as pieces to send back to back: its RESP
  header, then each part of the value as it is (never joined), then the options.
- `send_pieces(conn, pieces)`: join the small pieces (headers of consecutive commands) and
  `sendall` every piece in order.
- `read_replies(conn, count, into=None)`: `count` replies from the connection's socket. A
  bulk value is received straight into a buffer of its own size, or into the caller's
  buffers (`into`: one copy, from the kernel, and no new memory to fault in; buffers that
  have a `received(piece)` method, as `values.IncomingValue`, are told of each piece as it
  lands, so that they hash it while it is in cache and the next is on its way); an error
  reply is returned as a `ServerError` in its place, never raised, so that the replies after
  it are still read and the connection stays in step.

Whoever can write the store chooses the size of a value. With `into`, a value of any other
size than the caller's buffers is never received into memory of its size: it is read through
a small scratch buffer and dropped (a 500 MB value costs its transfer, not 500 MB per load),
and answered by its size. A reply line (a length, an integer, an error) longer than
`_MAX_LINE` breaks the connection instead of growing the buffer without end.

Only the replies of EXISTS, GET, SET and UNLINK are understood (no arrays, no RESP3).

Thread-safety: none; each function works on one connection that one call holds.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

import numpy as np
from redis.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.tiers.remote.store import ValueParts

__all__ = [
    "WINDOW_BYTES",
    "Reply",
    "ServerError",
    "command",
    "nbytes",
    "read_replies",
    "send_pieces",
    "set_command",
    "windows",
]

# Value bytes one connection has in flight at most (at least one command). The server copies every
# reply of a window into its output buffer before it writes the first byte, while the client's
# thread waits: at 8 MiB a load thread spent a third of its time waiting for replies' first bytes
# (1 MiB values, 2 threads). bench_remote --quick, RemoteTier loads / redis-benchmark GET, lowest
# over 1, 2, 4 MiB values, runs taking turns (issue 22): 8 MiB windows 0.60 and 0.42 (1 MiB
# values), 4 MiB 0.73, 0.86 and 0.74, 2 MiB 0.86 and 0.84 (stores 0.84 and 0.79, against
# 0.71 and 0.67 at 8 MiB). A larger value is sent alone.
WINDOW_BYTES = 2 << 20
# pieces shorter than this are joined before sending: one send for many headers
_SMALL = 1 << 16
# what one receive asks for while looking for the end of a reply's first line
_RECV_BYTES = 1 << 16
# longest reply line accepted (the server's error messages are far shorter)
_MAX_LINE = 1 << 16


class ServerError(str):
    """An error reply (`ERR …`, `MOVED 3999 10.0.0.5:6379`, `NOPERM …`), without its `-`."""


# one reply: simple string, bulk, integer, error, nil
Reply = bytes | memoryview | int | ServerError | None


def nbytes(buf: bytes | memoryview) -> int:
    """Bytes in `buf` (a memoryview's `len` counts items, not bytes)."""
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def _arg(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def command(*args: bytes) -> bytes:
    """One command, all its arguments small, packed whole."""
    return b"*%d\r\n%s" % (len(args), b"".join(map(_arg, args)))


def set_command(
    name: bytes, parts: ValueParts, options: tuple[bytes, ...]
) -> list[bytes | memoryview]:
    """`SET name <parts back to back> NX *options` as pieces; the parts are not copied."""
    size = sum(map(nbytes, parts))
    head = b"*%d\r\n%s%s$%d\r\n" % (4 + len(options), _arg(b"SET"), _arg(name), size)
    tail = b"\r\n" + b"".join(map(_arg, (b"NX", *options)))
    return [head, *parts, tail]


def send_pieces(conn: Connection, pieces: list[bytes | memoryview]) -> None:
    """Send the pieces in order (redis-py's `send_packed_command`: connects, maps its errors)."""
    batched: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = []
    for piece in pieces:
        if nbytes(piece) < _SMALL:
            small.append(piece)
            continue
        if small:
            batched.append(b"".join(small))
            small = []
        batched.append(piece)
    if small:
        batched.append(b"".join(small))
    conn.send_packed_command(batched, check_health=False)


def read_replies(
    conn: Connection, count: int, into: Sequence[Sequence[memoryview]] | None = None
) -> list[Reply]:
    """The next `count` replies on `conn`; raises redis-py's TimeoutError / ConnectionError.

    With `into`, a bulk reply i whose size is the bytes of `into[i]` is received straight into
    those buffers, in order, and answered by its size; one of any other size is answered by
    its size too, its bytes read through a small buffer and dropped.

    redis-py keeps the socket in `Connection._sock`; its own parser holds nothing unread
    here, since every command it sent on this connection had its reply read in full.
    """
    sock = getattr(conn, "_sock", None)
    if sock is None:
        raise RedisConnectionError(
            f"{conn.host}:{conn.port}: connection closed before its replies were read"
        )
    replies = _Replies(sock)
    try:
        out = [replies.read(None if into is None else into[i]) for i in range(count)]
    # socket.timeout
    except TimeoutError as exc:
        raise RedisTimeoutError(f"Timeout reading from {conn.host}:{conn.port}") from exc
    except OSError as exc:
        raise RedisConnectionError(
            f"Error while reading from {conn.host}:{conn.port}: {exc}"
        ) from exc
    if not replies.is_drained():
        raise RedisConnectionError(f"{conn.host}:{conn.port}: more data than the replies expected")
    return out


class _Replies:
    """RESP2 replies read from one socket, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        # received, not yet parsed from `_pos` on
        self._buf = bytearray()
        self._pos = 0

    def is_drained(self) -> bool:
        """Whether every byte received so far has been parsed."""
        return self._pos == len(self._buf)

    def read(self, into: Sequence[memoryview] | None = None) -> Reply:
        """The next reply (a bulk one into `into` when given and of its size: see `read_replies`)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            if into is None:
                value = self._new_buffer(size)
                self._receive_into(value)
                self._skip_crlf()
                return value
            if size == sum(map(nbytes, into)):
                # an IncomingValue hashes each piece as it lands
                report = getattr(into, "received", None)
                for buf in into:
                    self._receive_into(buf.cast("B") if buf.format != "B" else buf, report)
            else:
                self._drop(size)
            self._skip_crlf()
            return size
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest
        if kind == b"-":
            return ServerError(rest.decode("utf-8", "replace"))
        raise RedisConnectionError(f"unexpected reply type {kind!r}")

    @staticmethod
    def _new_buffer(size: int) -> memoryview:
        # Not bytearray(size): it zero-fills first. numpy leaves the pages untouched, and asks
        # for huge pages at >= 4 MiB, halving the page faults that dominate a fresh value's
        # cost (get at 4 MiB: 1.0 -> 1.5 GB/s, one thread).
        return memoryview(np.empty(size, np.uint8))

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n", self._pos)) < 0:
            if len(self._buf) - self._pos > _MAX_LINE:
                raise RedisConnectionError(
                    f"a reply line longer than {_MAX_LINE} bytes: not a Redis server's reply"
                )
            self._receive()
        line = bytes(self._buf[self._pos : end])
        self._pos = end + 2
        return line

    def _receive(self) -> None:
        chunk = self._sock.recv(_RECV_BYTES)
        if not chunk:
            raise RedisConnectionError("connection closed by the server")
        del self._buf[: self._pos]
        self._pos = 0
        self._buf += chunk

    def _receive_into(
        self, dest: memoryview, report: Callable[[memoryview], None] | None = None
    ) -> None:
        """Fill `dest`: first from what is already received, then straight from the socket;
        `report(piece)` each piece once written (while it is still in cache)."""
        size = len(dest)
        have = min(size, len(self._buf) - self._pos)
        # a bytearray's slice would be one more copy
        with memoryview(self._buf) as received:
            dest[:have] = received[self._pos : self._pos + have]
        self._pos += have
        if report is not None and have:
            report(dest[:have])
        while have < size:
            got = self._sock.recv_into(dest[have:])
            if not got:
                raise RedisConnectionError("connection closed by the server")
            if report is not None:
                report(dest[have : have + got])
            have += got

    def _drop(self, size: int) -> None:
        """Read `size` bytes and keep none: through a scratch buffer of at most `_RECV_BYTES`."""
        have = min(size, len(self._buf) - self._pos)
        self._pos += have
        scratch = memoryview(bytearray(min(size - have, _RECV_BYTES)))
        while have < size:
            got = self._sock.recv_into(scratch[: size - have])
            if not got:
                raise RedisConnectionError("connection closed by the server")
            have += got

    def _skip_crlf(self) -> None:
        while len(self._buf) - self._pos < 2:
            self._receive()
        self._pos += 2


def windows(indices: list[int], weights: Sequence[int] | None) -> list[list[int]]:
    """`indices` cut into runs of at most `WINDOW_BYTES` of weight (at least one index each)."""
    if weights is None:
        return [indices]
    runs: list[list[int]] = [[]]
    load = 0
    for i in indices:
        if runs[-1] and load + weights[i] > WINDOW_BYTES:
            runs.append([])
            load = 0
        runs[-1].append(i)
        load += weights[i]
    return runs
