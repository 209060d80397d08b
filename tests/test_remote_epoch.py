"""RemoteTier on a store that cannot list (`RemoteStore.lists` False, memcached-like): its values are
named under the namespace's epoch, a reset starts a new epoch instead of deleting anything, and a
replica sharing the namespace follows it (the rule is in `kvtier.tiers.remote.reset`).

Two such stores: `DictStore`, a tiny in-process store that meets the contract without `list_names`
(replicas share its server), and a real Redis told not to list (a listing would fail the test);
its values have a TTL, so the epoch record's TTL is renewed as it is read.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from helpers import HANG_MS, HANG_S, keys, wait_until
from kvtier.base import LookupResult
from kvtier.errors import ConfigError
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.breaker import CircuitBreaker
from kvtier.tiers.remote.redis import RedisStore
from kvtier.tiers.remote.store import RemoteStore, ValueParts
from kvtier.tiers.remote.tier import RemoteTier
from tier_jobs import Slab, load, store

HIT = LookupResult.HIT
MISS = LookupResult.MISS
RETRY = LookupResult.RETRY
_models = itertools.count()


class DictServer:
    """What every `DictStore` on it sees: names and values, one lock."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()


class DictStore(RemoteStore):
    """The `RemoteStore` contract on a `DictServer`, without `list_names`."""

    medium = "dict"
    lists = False

    def __init__(self, server: DictServer) -> None:
        self.server = server

    def describe(self) -> str:
        return "dict://in-process"

    def exists(self, names: Sequence[str]) -> list[bool]:
        with self.server.lock:
            return [name in self.server.data for name in names]

    def get(self, names: Sequence[str]) -> list[bytes | memoryview | None]:
        with self.server.lock:
            return [self.server.data.get(name) for name in names]

    def put(
        self, items: Sequence[tuple[str, ValueParts]], keep_s: Sequence[float] | None = None
    ) -> list[bool]:
        written = []
        with self.server.lock:
            for name, parts in items:
                is_new = name not in self.server.data
                if is_new:
                    self.server.data[name] = b"".join(bytes(part) for part in parts)
                written.append(is_new)
        return written

    def delete(self, names: Sequence[str]) -> None:
        with self.server.lock:
            for name in names:
                self.server.data.pop(name, None)

    def ping(self) -> None:
        pass


class UnlistedRedisStore(RedisStore):
    """A real Redis that the tier must never list."""

    lists = False

    def list_names(self, prefix: str) -> Iterator[str]:
        raise AssertionError("a store with lists = False was listed")


def namespace() -> Namespace:
    model = f"epoch{next(_models)}-{time.monotonic_ns()}"
    return Namespace(model, "float16", "blocks", 16, 4, "sha256_cbor", 1, 4096)


@pytest.fixture(params=["dict", "redis"])
def make_store(request):
    """A function that makes one more store on the same server (one per replica)."""
    if request.param == "dict":
        server = DictServer()
        return lambda: DictStore(server)
    server = request.getfixturevalue("redis_server").ready()
    return lambda: UnlistedRedisStore(server.url, timeout_ms=HANG_MS, ttl_s=600)


@pytest.fixture
def make_tier():
    tiers: list[RemoteTier] = []

    def make(store: RemoteStore, ns: Namespace, **kwargs: object) -> RemoteTier:
        tier = RemoteTier(store, ns, **kwargs)
        tiers.append(tier)
        # it names nothing before it has read its namespace's epoch
        wait_until(lambda: tier.codec.epoch is not None, "the tier read its namespace's epoch")
        return tier

    yield make
    for tier in tiers:
        tier.close()


def answer(tier: RemoteTier, key: bytes) -> LookupResult:
    """The lookup's answer once its probe has run (RETRY until then)."""
    deadline = time.monotonic() + HANG_S
    result = tier.lookup(key)
    while result is RETRY and time.monotonic() < deadline:
        time.sleep(0.005)
        result = tier.lookup(key)
    return result


def test_a_reset_leaves_no_value_from_before_it_served(make_store, make_tier):
    ns = namespace()
    tier = make_tier(make_store(), ns)
    slab = Slab(2, ns)
    (k,) = keys(1)
    assert not store(tier, slab, [k]).failed_keys
    assert tier.lookup(k) is HIT
    old_epoch = tier.codec.epoch
    old_name = tier.codec.name(k)
    # the value is named under the epoch, beside the epoch record
    assert old_name.startswith(f"kvtier:{ns.id_hex}:{old_epoch}:")
    tier.reset()
    # at once: nothing from before the reset is served
    assert tier.lookup(k) is MISS
    assert tier.drain(HANG_S)
    # a new epoch: the old value is still in the store (nothing could list it to delete it) ...
    assert tier.codec.epoch not in (None, old_epoch)
    assert tier.store.exists([old_name]) == [True]
    # ... and never served: a probe and a load look under the new epoch's name
    assert answer(tier, k) is MISS
    assert load(tier, slab, [k]).failed_keys == frozenset([k])
    # the tier stores and serves again, under the new epoch
    assert not store(tier, slab, [k]).failed_keys
    assert answer(tier, k) is HIT
    assert tier.codec.name(k) != old_name


def test_a_replica_follows_another_replicas_reset(make_store, make_tier):
    ns = namespace()
    a = make_tier(make_store(), ns)
    # b reads the epoch record again every 10 ms (its lookups do not wait for that)
    b = make_tier(make_store(), ns, epoch_check_s=0.01)
    # replicas of one namespace: one epoch, read from the store
    assert a.codec.epoch == b.codec.epoch
    slab = Slab(2, ns)
    k1, k2 = keys(1, 2)
    assert not store(a, slab, [k1]).failed_keys
    # b finds what a stored
    assert answer(b, k1) is HIT
    old_epoch = a.codec.epoch
    a.reset()
    assert a.drain(HANG_S)
    # b follows a's new epoch: it forgets k1 (a value from before the reset) ...
    wait_until(lambda: b.codec.epoch == a.codec.epoch, "b follows a's new epoch")
    assert b.codec.epoch != old_epoch
    assert b.stats().counters["epoch_changes"] == 1
    # ... and finds it absent under the new epoch, although its value is still in the store
    assert answer(b, k1) is MISS
    # what b stores now, a finds
    assert not store(b, slab, [k2]).failed_keys
    assert answer(a, k2) is HIT


def test_a_lost_epoch_record_is_a_new_epoch_never_an_old_one(make_store, make_tier):
    ns = namespace()
    tier = make_tier(make_store(), ns, epoch_check_s=0.01)
    slab = Slab(2, ns)
    (k,) = keys(1)
    assert not store(tier, slab, [k]).failed_keys
    old_epoch = tier.codec.epoch
    # the store evicts the record: the next read makes a new one, with a new token
    tier.store.delete([tier.codec.epoch_name])
    wait_until(lambda: tier.codec.epoch not in (None, old_epoch), "a new epoch")
    assert answer(tier, k) is MISS


def test_an_epoch_record_that_holds_no_token_is_replaced(make_store, make_tier):
    ns = namespace()
    first = make_store()
    name = f"kvtier:{ns.id_hex}:epoch"
    # a record a writer of the store filled with a path, not a token
    first.put([(name, [b"../../elsewhere"])])
    tier = make_tier(first, ns)
    assert len(tier.codec.epoch) == 16
    (record,) = first.get([name])
    assert bytes(record) == tier.codec.epoch.encode()


def test_a_store_that_says_it_lists_must_implement_list_names():
    class Forgetful(DictStore):
        lists = True

    with pytest.raises(TypeError, match="Forgetful: lists = True needs a list_names"):
        Forgetful(DictServer())

    # an abstract base may leave `list_names` to the stores made from it
    class HttpStoreBase(RemoteStore):
        lists = True

    class HttpStore(HttpStoreBase, DictStore):
        lists = True

        def list_names(self, prefix: str) -> Iterator[str]:
            return iter(sorted(n for n in self.server.data if n.startswith(prefix)))

    assert HttpStore(DictServer()).lists


def test_the_epoch_is_read_at_a_bounded_period():
    for bad in (0.0, -1.0, 1e-9, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="epoch_check_s must be at least 0.01 s and finite"):
            RemoteTier(DictStore(DictServer()), namespace(), epoch_check_s=bad)


class FlakyDictStore(DictStore):
    """A `DictStore` whose every call fails while `down`."""

    down = False

    def _reach(self) -> None:
        if self.down:
            raise ConnectionError("the store is down")

    def exists(self, names: Sequence[str]) -> list[bool]:
        self._reach()
        return super().exists(names)

    def get(self, names: Sequence[str]) -> list[bytes | memoryview | None]:
        self._reach()
        return super().get(names)

    def put(
        self, items: Sequence[tuple[str, ValueParts]], keep_s: Sequence[float] | None = None
    ) -> list[bool]:
        self._reach()
        return super().put(items, keep_s)

    def delete(self, names: Sequence[str]) -> None:
        self._reach()
        super().delete(names)

    def ping(self) -> None:
        self._reach()


def test_a_replica_cut_off_during_another_replicas_reset_reads_the_epoch_before_serving_again(
    make_tier,
):
    server = DictServer()
    ns = namespace()
    resetting = make_tier(DictStore(server), ns)
    flaky = FlakyDictStore(server)
    # its periodic epoch check never comes in this test: only the breaker's closing can read it
    breaker = CircuitBreaker(failures=1, retry_s=0.05, max_retry_s=0.05)
    cut_off = make_tier(flaky, ns, breaker=breaker, epoch_check_s=3600.0)
    slab = Slab(2, ns)
    (k,) = keys(1)
    assert not store(resetting, slab, [k]).failed_keys
    assert answer(cut_off, k) is HIT
    old_epoch = cut_off.codec.epoch
    # cut off: a failed load opens its breaker; the other replica resets meanwhile
    flaky.down = True
    load(cut_off, Slab(2, ns), [k])
    assert cut_off.breaker.is_open
    resetting.reset()
    assert resetting.drain(HANG_S)
    wait_until(lambda: resetting.codec.epoch not in (None, old_epoch), "the reset's new epoch")
    flaky.down = False
    wait_until(lambda: not cut_off.breaker.is_open, "the breaker closes")
    # what it knew is of the old epoch: nothing from before the reset is served
    assert cut_off.lookup(k) is not HIT
    assert load(cut_off, Slab(2, ns), [k]).failed_keys == frozenset([k])
    wait_until(lambda: cut_off.codec.epoch == resetting.codec.epoch, "it follows the new epoch")


def test_a_replica_that_follows_another_replicas_reset_announces_what_it_no_longer_holds(
    make_tier,
):
    # a router learnt from this replica's events that it holds k: it must learn that it does not
    server = DictServer()
    ns = namespace()
    resetting = make_tier(DictStore(server), ns)
    following = make_tier(DictStore(server), ns, epoch_check_s=0.01)
    (k,) = keys(1)
    assert not store(following, Slab(2, ns), [k]).failed_keys
    assert [e.removed for e in following.take_events()] == [False]
    resetting.reset()
    assert resetting.drain(HANG_S)
    wait_until(lambda: following.codec.epoch == resetting.codec.epoch, "it follows the new epoch")
    assert [(e.keys, e.removed) for e in following.take_events()] == [([k], True)]
