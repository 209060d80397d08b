"""RemoteTier: the secondary-tier contract on real shared stores — a single Redis, a 3-node Redis
Cluster and an S3 server (SeaweedFS), each started by the test fixtures on loopback ports.

Chunks are small (4 KiB per rank); every test uses a namespace of its own (a fresh model
name), so tests sharing a server never see each other's values.
"""

from __future__ import annotations

import itertools
import time

import pytest

from helpers import keys
from kvtier.base import LookupResult
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_store import RemoteStore
from kvtier.tiers.secondary import HEADER_BYTES, ValueHeader
from tier_jobs import Slab, load, store

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
SLOT = 4096
_models = itertools.count()


def namespace(world_size: int = 1, model: str | None = None) -> Namespace:
    return Namespace(model or f"m{next(_models)}-{time.monotonic_ns()}", "float16", "blocks", 16, 4, "sha256_cbor",
                     world_size, SLOT)


def answer(tier: RemoteTier, key: bytes, timeout: float = 5.0) -> LookupResult:
    """The lookup's answer once its probe has run (RETRY until then)."""
    deadline = time.monotonic() + timeout
    while (result := tier.lookup(key)) is RETRY and time.monotonic() < deadline:
        time.sleep(0.005)
    return result


@pytest.fixture(params=["redis", "redis_cluster", "s3"])
def backend(request):
    """(the server's fixture object, a function that builds a fresh RemoteStore on it)."""
    if request.param == "s3":
        from kvtier.tiers.s3 import S3Store

        server = request.getfixturevalue("s3_server")  # shared: each test's names use a namespace of its own
        return server, lambda **kw: S3Store(server.endpoint, server.bucket, access_key_id=server.access_key_id,
                                            secret_access_key=server.secret_access_key, **kw)
    from kvtier.tiers.redis import RedisStore

    fixture = {"redis": "redis_server"}.get(request.param, request.param)
    server = request.getfixturevalue(fixture).ready()  # running (after a fault test) and empty
    return server, lambda **kw: RedisStore(server.url, cluster=request.param == "redis_cluster", **kw)


@pytest.fixture
def make_tier(backend):
    tiers: list[RemoteTier] = []
    _, make_store = backend

    def make(ns: Namespace | None = None, store: RemoteStore | None = None, **kwargs) -> RemoteTier:
        tier = RemoteTier(store or make_store(), ns or namespace(), **kwargs)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.reset()  # leave nothing behind on the shared server
        tier.drain(10)
        tier.close()


# -- the contract ----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
def test_store_probe_load_round_trip(make_tier, world_size):
    ns = namespace(world_size)
    tier, slab = make_tier(ns), Slab(8, ns)
    ks = keys(1, 2, 3)
    # unknown keys: a probe starts, the lookup waits (RETRY), then the store says MISS
    assert tier.lookup(ks[0]) is RETRY
    assert answer(tier, ks[0]) is MISS
    # stored: the tier knows them at once (no probe needed)
    assert store(tier, slab, ks).failed_keys == frozenset()
    assert all(tier.lookup(k) is HIT for k in ks)
    assert load(tier, slab, ks).failed_keys == frozenset()
    assert all(slab.holds(row, k) for row, k in enumerate(ks))
    stats = tier.stats()
    assert stats.counters["store_chunks"] == 3 and stats.counters["load_chunks"] == 3


def test_a_second_engine_finds_what_the_first_stored(make_tier):
    ns = namespace()
    first, second, slab = make_tier(ns), make_tier(ns), Slab(4, ns)
    ks = keys(10, 11)
    store(first, slab, ks)
    # the other engine never stored them: it learns of them through a probe
    assert second.lookup(ks[0]) is RETRY
    assert answer(second, ks[0]) is HIT and answer(second, ks[1]) is HIT
    assert load(second, slab, ks).failed_keys == frozenset()
    assert slab.holds(0, ks[0]) and slab.holds(1, ks[1])


def test_a_store_of_a_present_key_does_not_rewrite_it(make_tier):
    ns = namespace()
    first, second, slab = make_tier(ns), make_tier(ns), Slab(4, ns)
    k = keys(20)
    store(first, slab, k)
    # the second engine stores other bytes under the same key: the value stays the first one's
    slab.rows[0] = 7
    assert second.submit_store(slab.job(True, k, [0])) is None
    assert second.drain(10) and second.get_finished()[0].failed_keys == frozenset()
    assert second.stats().counters["store_existing"] == 1
    assert load(second, slab, k).failed_keys == frozenset() and slab.holds(0, k[0])


def test_another_namespace_never_hits(make_tier):
    slab_ns = namespace()
    tier, other, slab = make_tier(slab_ns), make_tier(namespace()), Slab(4, slab_ns)
    k = keys(30)
    store(tier, slab, k)
    assert answer(other, k[0]) is MISS


def test_keyed_names_differ_from_plain_ones_and_do_not_read_each_other(make_tier, backend):
    ns = namespace()
    plain, keyed = make_tier(ns), make_tier(ns, key_secret=b"a deployment secret of 32 bytes!")
    slab = Slab(4, ns)
    k = keys(40)
    store(plain, slab, k)
    store(keyed, slab, k)
    names = sorted(plain.store.list_names(plain.codec.name_prefix))
    assert len(names) == 2 and plain.codec.name(k[0]) in names and keyed.codec.name(k[0]) in names
    assert k[0].hex() not in keyed.codec.name(k[0])  # listing the store reveals no block hash
    # an engine without the secret cannot tell what a keyed name holds, and a keyed engine
    # without the value under its own name finds nothing
    plain.store.delete([keyed.codec.name(k[0])])
    fresh_keyed = make_tier(ns, key_secret=b"a deployment secret of 32 bytes!")
    assert answer(fresh_keyed, k[0]) is MISS


# -- bad values: a miss, counted, deleted -------------------------------------------------------


def _garbage(tier, name, value):
    return b"\x00not a kvtier value" * 100


def _truncated(tier, name, value):
    return value[:-100]


def _flipped_payload_byte(tier, name, value):
    return value[:HEADER_BYTES + 5] + bytes([value[HEADER_BYTES + 5] ^ 0xFF]) + value[HEADER_BYTES + 6:]


def _another_namespace(tier, name, value):
    header = ValueHeader.unpack(value[:HEADER_BYTES])
    forged = ValueHeader(namespace().id, header.key, header.payload_bytes, header.payload_checksum)
    return forged.pack() + value[HEADER_BYTES:]


@pytest.mark.parametrize("damage", [_garbage, _truncated, _flipped_payload_byte, _another_namespace])
def test_a_damaged_value_is_a_counted_miss_and_is_deleted(make_tier, damage):
    ns = namespace()
    tier, slab = make_tier(ns), Slab(4, ns)
    k = keys(50)
    store(tier, slab, k)
    name = tier.codec.name(k[0])
    value = bytes(tier.store.get([name])[0])
    tier.store.delete([name])
    assert tier.store.put([(name, [damage(tier, name, value)])]) == [True]
    # the load fails (never serves the bytes), counts it, deletes the value, forgets the key
    assert load(tier, slab, k).failed_keys == frozenset(k)
    assert tier.stats().counters["corrupt"] == 1
    assert tier.store.exists([name]) == [False]
    assert answer(tier, k[0]) is MISS


def test_a_value_the_server_dropped_is_a_failed_load_and_forgotten(make_tier):
    ns = namespace()
    tier, slab = make_tier(ns), Slab(4, ns)
    k = keys(60)
    store(tier, slab, k)
    tier.store.delete([tier.codec.name(k[0])])  # maxmemory eviction or a TTL on the server
    assert tier.lookup(k[0]) is HIT  # the tier cannot know yet
    assert load(tier, slab, k).failed_keys == frozenset(k)
    assert tier.stats().counters["load_missing"] == 1
    assert answer(tier, k[0]) is MISS


# -- reset ---------------------------------------------------------------------------------------


def test_reset_deletes_the_namespace_and_nothing_else(make_tier):
    ns, other_ns = namespace(), namespace()
    tier, other = make_tier(ns), make_tier(other_ns)
    slab, other_slab = Slab(4, ns), Slab(4, other_ns)
    ks = keys(70, 71)
    store(tier, slab, ks)
    store(other, other_slab, ks)
    tier.reset()
    assert tier.lookup(ks[0]) is MISS  # at once: nothing from before the reset is served
    assert tier.drain(10)
    assert list(tier.store.list_names(tier.codec.name_prefix)) == []
    assert len(list(other.store.list_names(other.codec.name_prefix))) == 2
    assert answer(tier, ks[0]) is MISS


# -- the circuit breaker -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["redis", "s3"], indirect=True)  # one server each (the cluster: three)
def test_a_dead_server_opens_the_breaker_and_a_restarted_one_closes_it(make_tier, backend):
    server, make_store = backend
    ns = namespace()
    tier = make_tier(ns, store=make_store(connect_timeout_ms=200, timeout_ms=500),
                     breaker=CircuitBreaker(failures=2, retry_s=0.1, max_retry_s=0.2))
    slab = Slab(4, ns)
    ks = keys(80, 81)
    store(tier, slab, ks[:1])
    server.stop()
    try:
        # loads fail within the timeouts; two failures in a row open the breaker
        started = time.monotonic()
        for _ in range(2):
            assert load(tier, slab, ks[:1]).failed_keys == frozenset(ks[:1])
        assert time.monotonic() - started < 5.0
        assert tier.breaker.is_open
        # open: lookups answer MISS at once, jobs fail without I/O
        assert tier.lookup(ks[0]) is MISS
        assert load(tier, slab, ks[:1]).failed_keys == frozenset(ks[:1])
        assert tier.stats().gauges["breaker_open"] == 1.0
    finally:
        server.start()
    # the probe thread pings until the server answers, then the tier serves again
    deadline = time.monotonic() + 20
    while tier.breaker.is_open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tier.breaker.is_open
    assert store(tier, slab, ks[1:]).failed_keys == frozenset()
    assert load(tier, slab, ks[1:]).failed_keys == frozenset() and slab.holds(0, ks[1])
    counters = tier.stats().counters
    assert counters["breaker_opens"] == 1 and counters["breaker_closes"] == 1 and counters["breaker_rejects"] >= 1
