"""RedisStore against real servers: a single redis-server and a 3-node Redis Cluster.

The contract tests run on both (parametrized); the fault and credential tests on the single
server. Servers come from tests/redis_servers.py and are emptied before each test.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from helpers import HANG_MS, HANG_S
from kvtier.errors import ConfigError
from kvtier.tiers.remote.redis import RedisStore
from kvtier.tiers.remote.redis_wire import read_replies
from redis_servers import ACL_PASSWORD, ACL_USER

KiB = 1 << 10


def value(tag: str, size: int = 1000) -> bytes:
    """Distinct bytes per tag, `size` long."""
    seed = tag.encode()
    return (seed * (size // len(seed) + 1))[:size]


def parts_of(tag: str, sizes: tuple[int, ...] = (128, 300 * KiB, 300 * KiB)) -> list[memoryview]:
    """A value as the tier sends it: a header, then one buffer per rank (large: the socket path)."""
    return [memoryview(value(f"{tag}/{i}", size)) for i, size in enumerate(sizes)]


def joined(parts) -> bytes:
    return b"".join(bytes(part) for part in parts)


@pytest.fixture(params=["single", "cluster"])
def env(request):
    """(store, servers): a RedisStore on an empty single server or cluster, closed afterwards."""
    if request.param == "single":
        servers = request.getfixturevalue("fresh_redis")
        store = RedisStore(servers.url, timeout_ms=HANG_MS)
    else:
        servers = request.getfixturevalue("fresh_redis_cluster")
        store = RedisStore(servers.url, cluster=True, timeout_ms=HANG_MS)
    yield store, servers
    store.close()


def test_put_nx_then_exists_and_get(env):
    store, _ = env
    a, b = parts_of("a"), parts_of("b")
    # two new names → both written
    assert store.put([("t:a", a), ("t:b", b)]) == [True, True]
    # present, present, absent, in the order asked
    assert store.exists(["t:a", "t:c", "t:b"]) == [True, False, True]
    # the values are the parts back to back; an absent name is None
    got = store.get(["t:b", "t:c", "t:a"])
    assert bytes(got[0]) == joined(b) and got[1] is None and bytes(got[2]) == joined(a)
    # a put of an existing name → False, and the old value stays
    assert store.put([("t:a", parts_of("other")), ("t:d", [b"d"])]) == [False, True]
    assert bytes(store.get(["t:a"])[0]) == joined(a)
    # the same name twice in one put → the first wins (commands run in order)
    assert store.put([("t:e", [b"first"]), ("t:e", [b"second"])]) == [True, False]
    assert bytes(store.get(["t:e"])[0]) == b"first"


def test_get_into_fills_the_callers_buffers(env):
    store, _ = env
    a = parts_of("a")
    store.put([("t:a", a), ("t:short", [b"tiny"])])
    # a value of exactly the buffers' size → received straight into them, answered by its size
    # a rank's buffer need not be bytes
    floats = np.zeros(300 * KiB // 4, np.float32)
    dest = [memoryview(bytearray(128)), memoryview(floats), memoryview(bytearray(300 * KiB))]
    other = [memoryview(bytearray(16))]
    assert store.get_into(["t:a", "t:absent", "t:short"], [dest, other, other]) == [
        len(joined(a)),
        None,
        4,
    ]
    assert joined(dest) == joined(a)
    # the value of another size only reported (4 ≠ 16): the reply after it is still in step
    assert store.get_into(["t:short", "t:a"], [other, dest]) == [4, len(joined(a))]


def test_values_larger_than_a_window(env):
    store, _ = env
    # three 5 MiB values, each more than one connection keeps in flight (2 MiB) → each sent alone, in turns
    items = [(f"big:{i}", parts_of(f"big{i}", (128, 5 << 20))) for i in range(3)]
    assert store.put(items) == [True, True, True]
    assert [bytes(got) for got in store.get([name for name, _ in items])] == [
        joined(p) for _, p in items
    ]
    dests = [[memoryview(bytearray(128)), memoryview(bytearray(5 << 20))] for _ in items]
    assert store.get_into([name for name, _ in items], dests) == [128 + (5 << 20)] * 3
    assert [joined(d) for d in dests] == [joined(p) for _, p in items]


def test_parts_of_any_buffer_kind(env):
    store, _ = env
    # bytes, a memoryview of bytes, a float32 array (len() counts items, not bytes), an empty part
    floats = np.arange(1000, dtype=np.float32)
    parts = [b"head", memoryview(b"mid"), memoryview(floats), b""]
    assert store.put([("t:kinds", parts)]) == [True]
    assert bytes(store.get(["t:kinds"])[0]) == b"headmid" + floats.tobytes()
    # empty calls → empty answers, no round trip needed
    assert store.put([]) == [] and store.get([]) == [] and store.exists([]) == []
    store.delete([])


def test_many_names_across_slots(env):
    store, servers = env
    names = [f"kv:ns:{i:04x}" for i in range(300)]
    # 300 names in one put → every one written, spread over every node of a cluster
    assert store.put([(name, [value(name, 200)]) for name in names]) == [True] * 300
    nodes = servers.nodes if hasattr(servers, "nodes") else [servers]
    sizes = [node.client().dbsize() for node in nodes]
    assert sum(sizes) == 300 and all(sizes)
    # every value comes back to its own name
    assert [bytes(got) for got in store.get(names)] == [value(name, 200) for name in names]
    # delete every other one (and a name never written) → exists says which remain
    store.delete(names[::2] + ["kv:ns:absent"])
    assert store.exists(names) == [i % 2 == 1 for i in range(300)]


def test_list_names_by_prefix(env):
    store, _ = env
    names = ["kvt:1:aa", "kvt:1:bb", "kvt:2:aa", "kvt*[1]:aa", "other:1:aa"]
    store.put([(name, [b"x"]) for name in names])
    # a prefix selects only names starting with it
    assert sorted(store.list_names("kvt:1:")) == ["kvt:1:aa", "kvt:1:bb"]
    # glob characters in a prefix are literal: "kvt*" does not match "kvt:…"
    assert sorted(store.list_names("kvt*[1]:")) == ["kvt*[1]:aa"]
    assert len(list(store.list_names(""))) == 5


def test_ttl_is_set_on_every_value_written(env):
    _, servers = env
    store = RedisStore(servers.url, cluster=hasattr(servers, "nodes"), ttl_s=3600)
    forever = RedisStore(servers.url, cluster=hasattr(servers, "nodes"))
    store.put([("ttl:a", [b"a"]), ("ttl:b", parts_of("b"))])
    forever.put([("ttl:c", [b"c"])])
    raw = servers.client()
    # PX 3600000 on the store's values, counting down since the put (for less than HANG_S: a busy
    # machine's put and PTTL may be seconds apart); none on the other store's
    assert all(3_600_000 - HANG_MS < raw.pttl(name) <= 3_600_000 for name in ("ttl:a", "ttl:b"))
    assert raw.ttl("ttl:c") == -1
    store.close()
    forever.close()


def test_ping_and_describe(env):
    store, servers = env
    store.ping()
    assert store.describe().startswith(f"redis://127.0.0.1:{servers.url.rsplit(':', 1)[1]}")


def test_stale_slot_map_follows_the_redirect(fresh_redis_cluster):
    store = RedisStore(fresh_redis_cluster.url, cluster=True)
    store.put([("moved:a", [b"a"])])
    client = store._client()
    slot = client.keyslot("moved:a")
    owner = client.nodes_manager.slots_cache[slot][0]
    wrong = next(node for node in client.get_primaries() if node.name != owner.name)
    # the store believes another node owns the slot → that node answers MOVED
    client.nodes_manager.slots_cache[slot] = [wrong]
    # the command is sent again where the redirect says, and the answer is right
    assert store.exists(["moved:a", "moved:b"]) == [True, False]
    # redis-py followed the MOVED and put the slot's owner back in the map
    assert client.nodes_manager.slots_cache[slot][0].name == owner.name
    # the other operations take the same way round
    for op in (
        lambda: store.put([("moved:a", [b"again"])]) == [False],
        lambda: bytes(store.get(["moved:a"])[0]) == b"a",
        lambda: store.get_into(["moved:a"], [[memoryview(bytearray(1))]]) == [1],
    ):
        client.nodes_manager.slots_cache[slot] = [wrong]
        assert op()
    client.nodes_manager.slots_cache[slot] = [wrong]
    store.delete(["moved:a"])
    assert fresh_redis_cluster.client().exists("moved:a") == 0
    store.close()


def test_server_error_raises_after_reading_every_reply(redis_server_acl):
    server = redis_server_acl.ready()
    with server.client() as admin:
        admin.acl_setuser(
            "limited",
            enabled=True,
            passwords=["+limited-pw"],
            keys=["allowed:*"],
            commands=["+@all"],
        )
    store = RedisStore(server.url, username="limited", password="limited-pw")
    # the middle SET is refused (NOPERM) → put raises ResponseError...
    with pytest.raises(ResponseError, match="NOPERM"):
        store.put([("allowed:1", [b"1"]), ("denied:1", [b"x"]), ("allowed:2", [b"2"])])
    # ...but the commands around it ran, and the same connection still answers in step
    assert store.exists(["allowed:1", "allowed:2"]) == [True, True]
    store.close()


def test_a_paused_server_times_out_and_then_serves_again(fresh_redis):
    store = RedisStore(fresh_redis.url, timeout_ms=200)
    store.put([("t:a", [b"a"])])
    # the server is stopped (SIGSTOP): the read waits out the 200 ms timeout, no longer
    with fresh_redis.paused():
        start = time.monotonic()
        with pytest.raises(Exception) as raised:
            store.get(["t:a"])
        elapsed = time.monotonic() - start
    assert store.is_timeout(raised.value)
    # not sooner than the timeout; and it returns (a read without a timeout never does): the upper
    # bound is one only a hang reaches (3 s was one a CPU hog and this suite's servers could reach)
    assert 0.15 < elapsed < HANG_S
    # resumed → the broken connection was dropped; a new one serves the value
    assert bytes(store.get(["t:a"])[0]) == b"a"
    store.close()


def test_a_killed_server_refuses_and_a_restarted_one_serves(fresh_redis):
    # timeouts only a hang reaches: a refusal is no timeout, however long it takes a busy machine, and
    # the restarted server's first answers may be slow (500 ms was reachable under load)
    store = RedisStore(fresh_redis.url, timeout_ms=HANG_MS, connect_timeout_ms=HANG_MS)
    store.put([("t:a", [b"a"])])
    # killed → the pooled connection is dead and nothing listens: an error, not a timeout
    fresh_redis.kill()
    with pytest.raises(Exception) as raised:
        store.exists(["t:a"])
    assert not store.is_timeout(raised.value)
    # restarted on the same port (empty: nothing is saved) → the same store works again
    fresh_redis.start()
    pid = fresh_redis.proc.pid
    # already running: nothing happens (a second server could not bind the port)
    fresh_redis.start()
    assert fresh_redis.proc.pid == pid
    assert store.exists(["t:a"]) == [False]
    assert store.put([("t:a", [b"b"])]) == [True]
    store.close()


def test_acl_user_works_and_wrong_credentials_raise(redis_server_acl):
    server = redis_server_acl.ready()
    # the ACL user with its password → a working store
    store = RedisStore(server.url, username=ACL_USER, password=ACL_PASSWORD)
    assert store.put([("acl:a", [b"a"])]) == [True]
    assert bytes(store.get(["acl:a"])[0]) == b"a"
    store.close()
    # a wrong password, or none at all (the default user is off) → AuthenticationError
    for password in ("wrong-password", None):
        bad = RedisStore(server.url, username=ACL_USER, password=password)
        with pytest.raises(AuthenticationError) as raised:
            bad.get(["acl:a"])
        assert not bad.is_timeout(raised.value)
        assert "wrong-password" not in str(raised.value)
        bad.close()


def test_tls_with_the_servers_ca(redis_server_tls):
    server = redis_server_tls.ready()
    # rediss:// and the CA that signed the server's certificate → a working store
    store = RedisStore(server.url, ca_file=str(server.tls_ca))
    assert store.put([("tls:a", parts_of("a"))]) == [True]
    assert bytes(store.get(["tls:a"])[0]) == joined(parts_of("a"))
    assert store.describe().startswith("rediss://")
    store.close()
    # the system's CAs do not know the test CA → the handshake fails (an error, not a timeout)
    untrusted = RedisStore(server.url)
    with pytest.raises(RedisConnectionError) as raised:
        untrusted.exists(["tls:a"])
    assert "certificate" in str(raised.value).lower() and not untrusted.is_timeout(raised.value)
    untrusted.close()


def test_no_password_in_describe_or_url():
    planted = "planted-pw-7c1e"
    store = RedisStore(
        "rediss://cache.example:6380/2", username="svc", password=planted, ca_file="/tmp/ca.pem"
    )
    # the endpoint, without the user or the password
    assert store.describe() == "rediss://cache.example:6380/2"
    assert planted not in store.describe() and "svc" not in store.describe()
    assert planted not in repr(store) and planted not in str(vars(store).get("_endpoint"))
    # a password inside the url is refused (it would end up in logs)
    with pytest.raises(ConfigError, match="password"):
        RedisStore(f"redis://svc:{planted}@localhost:6379")
    # not a Redis url, a path that is not a database number, a database in a cluster → refused
    for url, cluster in (
        ("http://localhost:6379", False),
        ("redis://localhost:6379/x", False),
        ("redis://localhost:6379/1", True),
    ):
        with pytest.raises(ConfigError):
            RedisStore(url, cluster=cluster)
    assert (
        RedisStore("redis://[::1]:7000", cluster=True).describe()
        == "redis://[::1]:7000/0 (cluster)"
    )


def test_threads_share_one_store(env):
    _, servers = env
    # 8 threads, more than the store lets run at once (4) → they wait, none fails
    store = RedisStore(servers.url, cluster=hasattr(servers, "nodes"), max_connections=4)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(20):
                names = [f"th:{t}:{i}:{j}" for j in range(4)]
                assert store.put([(name, [value(name, 5000)]) for name in names]) == [True] * 4
                assert [bytes(got) for got in store.get(names)] == [
                    value(name, 5000) for name in names
                ]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    store.close()


# -- values of an unexpected size: refused before they are received ---------------------------------


def traced_peak(fn):
    """(fn(), the most bytes Python and numpy held at once while it ran, above what they held before)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_get_into_drains_a_value_of_another_size_without_allocating_it(env):
    store, _ = env
    a, huge = parts_of("a"), 32 << 20
    store.put([("t:a", a), ("t:huge", [bytes(huge)])])
    dest = [
        memoryview(bytearray(128)),
        memoryview(bytearray(300 * KiB)),
        memoryview(bytearray(300 * KiB)),
    ]
    # 32 MiB where 600 KiB are expected → answered by its size, drained through a small buffer
    sizes, peak = traced_peak(lambda: store.get_into(["t:huge", "t:a"], [dest, dest]))
    assert sizes == [huge, len(joined(a))]
    assert peak < 4 << 20, f"{peak} bytes traced to refuse a {huge}-byte value"
    # the reply after it was still read in step, into the buffers
    assert joined(dest) == joined(a)


def test_a_redirected_get_into_reads_no_more_than_expected(fresh_redis_cluster):
    store = RedisStore(fresh_redis_cluster.url, cluster=True)
    huge = 32 << 20
    store.put([("moved:huge", [bytes(huge)]), ("moved:ok", [b"12345678"])])
    client = store._client()
    # the store believes another node owns each slot → MOVED
    for name in (
        "moved:huge",
        "moved:ok",
    ):
        slot = client.keyslot(name)
        owner = client.nodes_manager.slots_cache[slot][0]
        client.nodes_manager.slots_cache[slot] = [
            next(n for n in client.get_primaries() if n.name != owner.name)
        ]
    dest = [memoryview(bytearray(8))]
    # the redirected reads: the huge one is answered by its size without being read, the other in full
    sizes, peak = traced_peak(
        lambda: [store.get_into([name], [dest])[0] for name in ("moved:huge", "moved:ok")]
    )
    assert sizes == [huge, 8] and bytes(dest[0]) == b"12345678"
    assert peak < 4 << 20, f"{peak} bytes traced to refuse a {huge}-byte value"
    assert store.get_into(["moved:absent"], [dest]) == [None]
    store.close()


class _FakeConnection:
    """What `read_replies` uses of a redis-py connection: its socket, host and port."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self.host, self.port = sock, "fake", 0


def test_a_reply_line_without_an_end_is_refused_before_it_grows_the_buffer():
    ours, theirs = socket.socketpair()
    ours.settimeout(2.0)
    try:
        # a "server" sends 1 MiB of a simple-string line and never ends it (nor closes)
        theirs.setblocking(False)
        sent = 0
        with contextlib.suppress(BlockingIOError):
            while sent < 1 << 20:
                sent += theirs.send(b"+" + b"x" * 65535 if sent == 0 else b"x" * 65536)
        # refused as a broken connection once the line is longer than any reply line, not read on
        with pytest.raises(RedisConnectionError, match="reply line"):
            read_replies(_FakeConnection(ours), 1)
    finally:
        ours.close()
        theirs.close()
