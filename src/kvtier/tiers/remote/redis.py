"""`RedisStore`: the remote-store operations on one Redis / Valkey server or a Redis Cluster.

redis-py owns the connections: the pool, AUTH (password or ACL user), TLS, the connect and
read timeouts, and in cluster mode the slot map. The hot commands (EXISTS, GET, SET NX,
PEXPIRE, UNLINK) are framed and parsed here (`redis_wire`) on redis-py's connections instead,
because redis-py copies a value several times on its way (benchmarks/bench_remote.py
--clients, same server, same run; figures in benchmarks/README.md):

- put: redis-py with hiredis turns a memoryview into bytes and packs the whole command into
  one new buffer, after the caller has joined the parts: three copies of each value. Here
  only each SET's RESP header is packed; the parts go to `sendall` as they are. One thread,
  4 MiB: 0.55 GB/s with `pipeline().set(name, b"".join(parts))`, 1.75 GB/s here; with two
  threads both meet the server's own limit at 1 MiB (it faults in fresh memory for each new
  value: `redis-benchmark` SET of new keys reaches the same), and at 4 MiB 0.8 vs 1.8 GB/s.
- get: redis-py reads 64 KiB at a time into hiredis, which copies into its own buffer and
  then into a new bytes object; here each value is received straight into a buffer of its
  own (1 MiB, two threads: 2.3 GB/s vs 2.8), or with `get_into` into the caller's (3.4).
- valkey-glide's sync client (`valkey-glide-sync`, a separate package) was slower on both
  (1 MiB: put 1.5, get 2.0 GB/s) and cannot send a value as parts.

Pipelining: a call's commands to one node go out in windows of at most `redis_wire.WINDOW_BYTES`
of values; every node's window is sent before any reply is read. A name goes to the primary
that owns its hash slot (redis-py's cached slot map); a MOVED or ASK reply (a slot being
moved) sends that one command again through redis-py's cluster client, which follows the
redirect and refreshes the map for the next calls.

Thread-safety: every method may be called from several threads at once. A call holds at
most one connection per node, and at most `max_connections` calls run at once (the others
wait); `ping` and `list_names` use redis-py's client (two more connections per node at most).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import Connection, ConnectionPool
from redis.exceptions import ResponseError
from redis.retry import Retry

from kvtier.errors import ConfigError
from kvtier.tiers.remote import redis_wire
from kvtier.tiers.remote.redis_wire import (
    Reply,
    ServerError,
    command,
    nbytes,
    read_replies,
    send_pieces,
    set_command,
)
from kvtier.tiers.remote.store import RemoteStore, ValueParts

__all__ = ["RedisStore"]

# names per SCAN page
_SCAN_COUNT = 1000
_REDIRECTS = ("MOVED ", "ASK ")


class RedisStore(RemoteStore):
    """Byte operations on a Redis / Valkey server (`redis://`, `rediss://` for TLS) or cluster.

    Args:
        url: `redis[s]://host:port[/db]`, without a password (cluster: any one node, db 0).
        cluster: the url names a node of a Redis Cluster; names spread over its primaries.
        username, password: an ACL user and its password (or only a password: `requirepass`).
        ca_file: the CA bundle that signs the server's certificate (`rediss://` only).
        connect_timeout_ms, timeout_ms: for opening a connection; for each send or receive.
        ttl_s: every value expires this many seconds after it was last written, read or found
            present by a write (None: never).
        max_connections: the most calls running at once, so the most connections per node.
    """

    medium = "redis"
    separator = ":"

    def __init__(
        self,
        url: str,
        *,
        cluster: bool = False,
        username: str | None = None,
        password: str | None = None,
        ca_file: str | None = None,
        connect_timeout_ms: int = 500,
        timeout_ms: int = 2000,
        ttl_s: float | None = None,
        max_connections: int = 16,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise ConfigError(
                f"redis url must look like redis://host:port or rediss://host:port, got {parts.scheme}://…"
            )
        if parts.password:
            raise ConfigError(
                "redis url must not hold a password: give it in a file (redis_password_file)"
            )
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"redis ttl_s must be > 0 seconds or None, got {ttl_s}")
        db_text = parts.path.strip("/") or "0"
        if not db_text.isdigit() or (cluster and db_text != "0"):
            raise ConfigError(
                f"redis url path must be a database number (0 for a cluster), got /{db_text}"
            )
        db = int(db_text)
        port = parts.port or 6379
        host = parts.hostname
        if ":" in host:
            # an IPv6 address
            host = f"[{host}]"
        self._endpoint = f"{parts.scheme}://{host}:{port}/{db}"
        if cluster:
            self._endpoint += " (cluster)"
        self._kwargs: dict = dict(
            host=parts.hostname,
            port=port,
            username=username or parts.username,
            password=password,
            socket_connect_timeout=connect_timeout_ms / 1000,
            socket_timeout=timeout_ms / 1000,
            # two more than the calls that may run at once: for ping() and a list_names() beside them
            max_connections=max_connections + 2,
            # no retries: the tier decides
            retry=Retry(NoBackoff(), 0),
            # redis-py 8 speaks RESP3 by default; redis_wire parses RESP2 replies
            protocol=2,
        )
        if parts.scheme == "rediss":
            self._kwargs.update(ssl=True, ssl_ca_certs=ca_file)
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._calls = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._cluster: RedisCluster | None = None
        # bytes of the largest value the last get() read
        self._value_hint = 0
        # A cluster client reads the slot map when made: made on first use, so that a store
        # (and the engine holding it) can start while the cluster is down.
        self._single: redis.Redis | None = None
        if not cluster:
            self._single = redis.Redis(db=db, **self._kwargs)

    def describe(self) -> str:
        """The endpoint, e.g. `rediss://10.0.0.5:6379/0 (cluster)`: never a user or password."""
        return self._endpoint

    def exists(self, names: Sequence[str]) -> list[bool]:
        """Whether each name is present: one pipelined EXISTS per name, per node."""
        replies = self._run(
            names,
            [[command(b"EXISTS", name.encode())] for name in names],
            lambda i: self._client().exists(names[i]),
        )
        return [reply == 1 for reply in replies]

    def get(self, names: Sequence[str]) -> list[bytes | memoryview | None]:
        """Each name's value (None when absent): one pipelined GET per name, per node."""
        replies = self._run(
            names,
            [[command(b"GET", name.encode())] for name in names],
            lambda i: self._client().get(names[i]),
            weights=[self._value_hint] * len(names),
        )
        sizes = [len(value) for value in replies if isinstance(value, (bytes, memoryview))]
        if sizes:
            # a GET's reply size is known only once read: the last is the guess
            self._value_hint = max(sizes)
        return replies  # type: ignore[return-value]  (GET answers a bulk value or nil)

    def get_into(
        self, names: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        """Each name's value received straight into `buffers[i]` (back to back), without a new buffer.

        Returns each value's size, None when absent. Where the size equals the bytes of
        `buffers[i]` the value fills them; any other size leaves them unspecified (a value
        that is not what the caller expects), and its bytes are never held in memory of their
        size (whoever writes the store chooses it): see `redis_wire`, and `_get_one_into` for
        a command sent again after a redirect.
        """
        return self._run(
            names,
            [[command(b"GET", name.encode())] for name in names],  # type: ignore[return-value]
            lambda i: self._get_one_into(names[i], buffers[i]),
            into=buffers,
            weights=[sum(buf.nbytes for buf in bufs) for bufs in buffers],
        )

    def _get_one_into(self, name: str, buffers: Sequence[memoryview]) -> int | None:
        """`get_into` of one name through redis-py (which follows a redirect): STRLEN, then GETRANGE
        of no more than the buffers hold, so that a value of another size is never read. A value
        replaced between the two commands may come back mixed: the caller's checks refuse it."""
        client = self._client()
        expected = sum(buf.nbytes for buf in buffers)
        size = client.strlen(name)
        if size == 0 and not client.exists(name):
            return None
        # GETRANGE 0 -1 would be the whole value
        if size != expected or expected == 0:
            return size
        value = client.getrange(name, 0, expected - 1)
        if len(value) != expected:
            # shortened meanwhile
            return len(value)
        offset = 0
        for buf in buffers:
            buf.cast("B")[:] = value[offset : offset + buf.nbytes]
            offset += buf.nbytes
        return expected

    def put(
        self, items: Sequence[tuple[str, ValueParts]], keep_s: Sequence[float] | None = None
    ) -> list[bool]:
        """SET NX (with PX when the store has a TTL: the longer of it and the item's `keep_s`) per
        item; the parts are sent without copying."""
        names = [name for name, _ in items]
        ttl_ms = self._ttls(len(items), keep_s)
        commands = [
            set_command(name.encode(), parts, () if ttl is None else (b"PX", b"%d" % ttl))
            for (name, parts), ttl in zip(items, ttl_ms, strict=True)
        ]

        def put_one(i: int) -> object:
            return self._client().set(names[i], b"".join(items[i][1]), nx=True, px=ttl_ms[i])

        weights = [sum(map(nbytes, parts)) for _, parts in items]
        return [reply is not None for reply in self._run(names, commands, put_one, weights=weights)]

    @property
    def expires(self) -> bool:
        return self._ttl_ms is not None

    def renew(self, names: Sequence[str], keep_s: Sequence[float] | None = None) -> None:
        """PEXPIRE … GT per name (Redis >= 7, Valkey): a longer TTL, or none, is left as it is."""
        if self._ttl_ms is not None and names:
            ttls = self._ttls(len(names), keep_s)
            commands = [
                [command(b"PEXPIRE", n.encode(), b"%d" % t, b"GT")]
                for n, t in zip(names, ttls, strict=True)
            ]
            self._run(names, commands, lambda i: self._client().pexpire(names[i], ttls[i], gt=True))

    def _ttls(self, n: int, keep_s: Sequence[float] | None) -> list[int | None]:
        """The TTL in ms of n values (None: none), never shorter than each one's `keep_s`."""
        if keep_s is None or self._ttl_ms is None:
            return [self._ttl_ms] * n
        return [max(self._ttl_ms, math.ceil(1000 * keep)) for keep in keep_s]

    def delete(self, names: Sequence[str]) -> None:
        """UNLINK each name (the server frees large values off its main thread)."""
        self._run(
            names,
            [[command(b"UNLINK", name.encode())] for name in names],
            lambda i: self._client().unlink(names[i]),
        )

    def list_names(self, prefix: str) -> Iterator[str]:
        """Every name starting with `prefix`: SCAN MATCH on every primary, page by page."""
        pattern = _glob_escape(prefix) + "*"
        for client in self._node_clients():
            for name in client.scan_iter(match=pattern, count=_SCAN_COUNT):
                yield name.decode()

    def ping(self) -> None:
        """PING every primary; raises when any cannot serve."""
        for client in self._node_clients():
            client.ping()

    def is_timeout(self, exc: BaseException) -> bool:
        """redis-py's TimeoutError (connect, send, receive) or a bare socket timeout."""
        return isinstance(exc, (redis.exceptions.TimeoutError, TimeoutError))

    def close(self) -> None:
        """Close every pooled connection; idempotent (a later call would connect again)."""
        with self._lock:
            clients = [self._single, self._cluster]
            self._cluster = None
        for client in clients:
            if client is not None:
                client.close()

    # --- routing and pipelining ---

    def _client(self) -> redis.Redis | RedisCluster:
        """redis-py's client for everything not on the hot path (and for redirected commands)."""
        if self._single is not None:
            return self._single
        with self._lock:
            if self._cluster is None:
                self._cluster = RedisCluster(require_full_coverage=True, **self._kwargs)
            return self._cluster

    def _node_clients(self) -> list[redis.Redis]:
        """One client per primary (the single server's client when not a cluster)."""
        client = self._client()
        if isinstance(client, redis.Redis):
            return [client]
        return [client.get_redis_connection(node) for node in client.get_primaries()]

    def _pools(self, names: Sequence[str]) -> dict[ConnectionPool, list[int]]:
        """The indices of `names` grouped by the connection pool of the node that owns them."""
        client = self._client()
        if isinstance(client, redis.Redis):
            return {client.connection_pool: list(range(len(names)))}
        groups: dict[ConnectionPool, list[int]] = {}
        for i, name in enumerate(names):
            node = client.nodes_manager.get_node_from_slot(client.keyslot(name))
            groups.setdefault(client.get_redis_connection(node).connection_pool, []).append(i)
        return groups

    def _run(
        self,
        names: Sequence[str],
        commands: Sequence[list[bytes | memoryview]],
        redirected: Callable[[int], object],
        *,
        into: Sequence[Sequence[memoryview]] | None = None,
        weights: Sequence[int] | None = None,
    ) -> list[Reply]:
        """Send command i (its pieces) for names[i] to the node owning it, and read its reply.

        Each node gets its commands in windows of at most `WINDOW_BYTES` of `weights` (the
        value bytes each command moves); every node's window is sent before any reply is
        read, so the nodes work at once. A server error raises `ResponseError` (after every
        reply of the window has been read, so that the connections stay usable); a redirect
        runs `redirected(i)` instead. `into`: see `redis_wire.read_replies`.
        """
        if not names:
            return []
        with self._calls:
            replies = self._pipelined(names, commands, into, weights)
        return self._follow_redirects(replies, redirected)

    def _pipelined(
        self,
        names: Sequence[str],
        commands: Sequence[list[bytes | memoryview]],
        into: Sequence[Sequence[memoryview]] | None,
        weights: Sequence[int] | None,
    ) -> list[Reply]:
        """Every reply, in order: one connection per node, held for the whole call, and the nodes'
        windows taking turns (see `_run`)."""
        replies: list[Reply] = [None] * len(names)
        held = []
        try:
            for pool, indices in self._pools(names).items():
                held.append((pool, pool.get_connection(), redis_wire.windows(indices, weights)))
            for step in range(max(len(windows) for _, _, windows in held)):
                sent = [(conn, windows[step]) for _, conn, windows in held if step < len(windows)]
                _exchange(sent, commands, into, replies)
        except BaseException:
            for _, conn, _ in held:
                # a half-read pipeline must never serve another call
                conn.disconnect()
            raise
        finally:
            for pool, conn, _ in held:
                pool.release(conn)
        return replies

    def _follow_redirects(
        self, replies: list[Reply], redirected: Callable[[int], object]
    ) -> list[Reply]:
        """`replies` with each redirect replaced by `redirected(i)`; another server error raises."""
        for i, reply in enumerate(replies):
            if not isinstance(reply, ServerError):
                continue
            if not reply.startswith(_REDIRECTS):
                raise ResponseError(f"{self._endpoint}: {reply}")
            replies[i] = redirected(i)
        return replies


def _exchange(
    sent: list[tuple[Connection, list[int]]],
    commands: Sequence[list[bytes | memoryview]],
    into: Sequence[Sequence[memoryview]] | None,
    replies: list[Reply],
) -> None:
    """One window per connection: every window's commands sent, then each one's replies read
    into `replies` (by the commands' indices)."""
    for conn, window in sent:
        send_pieces(conn, [piece for i in window for piece in commands[i]])
    for conn, window in sent:
        dests = None if into is None else [into[i] for i in window]
        for i, reply in zip(window, read_replies(conn, len(window), dests), strict=True):
            replies[i] = reply


def _glob_escape(text: str) -> str:
    """`text` as a literal in a SCAN MATCH pattern."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
