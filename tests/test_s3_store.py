"""S3Store against a real SeaweedFS (the `s3_server` fixture): no-overwrite puts, values made of
parts, batches (one ends only once every request of it has), delete, paged listings by prefix,
a hung server, a wrong secret, a restart, HTTPS with a private CA, and an endpoint description
that never shows a secret.

Every test writes under a prefix of its own (the bucket is shared by the session).
"""

from __future__ import annotations

import itertools
import socket
import threading
import time

import numpy as np
import pytest

import kvtier.tiers.remote.store as store_contract
from helpers import HANG_MS, HANG_S
from kvtier.errors import ConfigError
from kvtier.tiers.remote.s3 import S3Store, S3StoreError

_prefixes = itertools.count()


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """Names of this test start with it: `<test name>-<n>/`."""
    return f"{request.node.name.replace('[', '-').rstrip(']')}-{next(_prefixes)}/"


@pytest.fixture
def make_store(s3_server):
    stores: list[S3Store] = []

    def make(endpoint: str | None = None, bucket: str | None = None, **kwargs) -> S3Store:
        args = dict(
            access_key_id=s3_server.access_key_id,
            secret_access_key=s3_server.secret_access_key,
            timeout_ms=HANG_MS,
        )
        store = S3Store(
            endpoint or s3_server.endpoint, bucket or s3_server.bucket, **(args | kwargs)
        )
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def store(make_store) -> S3Store:
    return make_store()


def values(store: S3Store, names: list[str]) -> list[bytes | None]:
    return [None if v is None else bytes(v) for v in store.get(names)]


def test_put_writes_new_names_and_never_overwrites(store, prefix):
    a, b = prefix + "a", prefix + "b"
    # two new names → both written
    assert store.put([(a, [b"first a"]), (b, [b"first b"])]) == [True, True]
    # a again with other bytes, c new → a is left as it was, c is written
    assert store.put([(a, [b"second a"]), (prefix + "c", [b"c"])]) == [False, True]
    assert values(store, [a, b, prefix + "c"]) == [b"first a", b"first b", b"c"]
    # a single item takes the same path (it runs in the calling thread)
    assert store.put([(b, [b"second b"])]) == [False]
    assert values(store, [b]) == [b"first b"]


def test_a_value_is_its_parts_back_to_back(store, prefix):
    header = b"H" * 128
    # 1 MiB, a buffer of 2-byte items (cast, not copied)
    rank0 = np.arange(1 << 19, dtype=np.uint16)
    rank1 = bytearray(b"\x07" * 3000)
    # header + two ranks' buffers + an empty part → one object, exactly their concatenation
    assert store.put([(prefix + "v", [header, memoryview(rank0), memoryview(rank1), b""])]) == [
        True
    ]
    (value,) = store.get([prefix + "v"])
    assert isinstance(value, memoryview)
    assert value.nbytes == 128 + rank0.nbytes + 3000
    assert bytes(value) == header + rank0.tobytes() + bytes(rank1)
    # the parts were read, not kept: changing them now changes nothing stored
    rank1[:] = b"\x00" * 3000
    assert bytes(store.get([prefix + "v"])[0])[-3000:] == b"\x07" * 3000


def test_exists_and_get_answer_in_order_with_absent_names(store, prefix):
    store.put([(prefix + "2", [b"two"]), (prefix + "4", [b"four"])])
    names = [prefix + str(i) for i in range(1, 6)]
    # 1, 3, 5 were never written → False / None in their places
    assert store.exists(names) == [False, True, False, True, False]
    assert values(store, names) == [None, b"two", None, b"four", None]
    assert store.exists([]) == [] and store.get([]) == [] and store.put([]) == []


def test_many_names_at_once(store, prefix):
    # 48 values of 64 KiB in one batch → all written, all present, each its own bytes
    items = [(f"{prefix}{i:03d}", [bytes([i]) * (64 << 10)]) for i in range(48)]
    assert store.put(items) == [True] * 48
    names = [name for name, _ in items]
    assert store.exists(names) == [True] * 48
    assert values(store, names) == [parts[0] for _, parts in items]


def test_delete_removes_names_and_ignores_absent_ones(store, prefix):
    store.put([(prefix + n, [n.encode()]) for n in "abc"])
    # delete a, c and a name never written → only b is left
    store.delete([prefix + "a", prefix + "c", prefix + "never"])
    assert store.exists([prefix + n for n in "abc"]) == [False, True, False]
    # nothing to do, no request
    store.delete([])
    # a deleted name can be written again
    assert store.put([(prefix + "a", [b"again"])]) == [True]


def test_list_names_by_prefix(store, prefix):
    names = [prefix + n for n in ("a/1", "a/2", "ab/3", "b/4")]
    store.put([(name, [b"x"]) for name in names])
    # a whole segment → what is under it
    assert sorted(store.list_names(prefix + "a/")) == names[:2]
    # a prefix that ends mid-segment → "a/…" and "ab/…" both start with it
    assert sorted(store.list_names(prefix + "a")) == names[:3]
    assert sorted(store.list_names(prefix)) == names
    assert list(store.list_names(prefix + "zzz")) == []


def test_list_names_pages_through_more_names_than_one_page(store, prefix):
    # 1,050 names: S3 lists 1,000 a page → two pages, every name once
    names = [f"{prefix}{i:04d}" for i in range(1050)]
    assert all(store.put([(name, [b""]) for name in names]))
    assert sorted(store.list_names(prefix)) == names
    # one delete call for all of them (DeleteObjects takes 1,000 a request)
    store.delete(names)
    assert list(store.list_names(prefix)) == []


def test_a_hung_server_times_out_within_the_timeout(make_store, s3_server, prefix):
    timeout_s, batch = 1.0, 32
    store = make_store(timeout_ms=int(timeout_s * 1000), max_connections=batch)
    store.put([(prefix + "a", [b"a"])])
    s3_server.pause()
    try:
        # a batch of 32 → its requests wait side by side: one timeout (1 s), not 32 (32 s), nor more
        # retries than one. The bound is half of 32: 15 s of slack for a busy machine's late timers
        # (a batch of 8 under a 4 s bound left 3 s; a 0.3 s timeout under 1.5 s left 1.2 s, which a
        # CPU hog could take). A passing batch still takes one timeout.
        started = time.perf_counter()
        with pytest.raises(S3StoreError) as caught:
            store.get([prefix + str(i) for i in range(batch)])
        assert time.perf_counter() - started < batch / 2 * timeout_s
        assert store.is_timeout(caught.value) and "timed out" in str(caught.value)
        # ping and put time out the same way
        for call in (store.ping, lambda: store.put([(prefix + "b", [b"b"])])):
            with pytest.raises(S3StoreError) as caught:
                call()
            assert store.is_timeout(caught.value)
    finally:
        s3_server.resume()
    # the server answers again → so does the store, on fresh connections
    assert values(store, [prefix + "a"]) == [b"a"]


def test_a_refused_connection_raises_at_once_and_is_no_timeout(s3_server):
    # a port with nothing listening on it
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # timeouts only a hang reaches: a refusal that waited for them (or retried until them) would take
    # HANG_S; one raised at once takes a small part of it, however busy the machine
    store = S3Store(
        f"http://127.0.0.1:{port}",
        "kvtier",
        access_key_id="k",
        secret_access_key="s",
        connect_timeout_ms=HANG_MS,
        timeout_ms=HANG_MS,
    )
    started = time.perf_counter()
    with pytest.raises(S3StoreError) as caught:
        store.exists(["x"])
    assert time.perf_counter() - started < HANG_S / 2
    assert not store.is_timeout(caught.value)
    store.close()


def test_a_wrong_secret_is_refused(make_store, store, prefix):
    store.put([(prefix + "a", [b"a"])])
    intruder = make_store(secret_access_key="not-the-secret")
    # every operation raises (a refused get is not a miss), and none of it is a timeout
    for call in (
        intruder.ping,
        lambda: intruder.get([prefix + "a"]),
        lambda: intruder.exists([prefix + "a"]),
        lambda: intruder.put([(prefix + "b", [b"b"])]),
        lambda: list(intruder.list_names(prefix)),
    ):
        with pytest.raises(S3StoreError) as caught:
            call()
        assert not intruder.is_timeout(caught.value)
    assert "SignatureDoesNotMatch" in str(caught.value)
    assert store.exists([prefix + "b"]) == [False]


def test_a_missing_bucket_is_an_error_not_a_miss(make_store):
    store = make_store(bucket="no-such-bucket")
    # ping, get and list say so (exists cannot: a HEAD's 404 has no body, so it answers False)
    for call in (store.ping, lambda: store.get(["a"]), lambda: list(store.list_names("a/"))):
        with pytest.raises(S3StoreError, match="NoSuchBucket"):
            call()


def test_describe_and_errors_never_show_the_secret(s3_server, make_store):
    planted = "PLANTED-secret-7f3a9c"
    store = make_store(secret_access_key=planted)
    # the endpoint and the bucket, nothing else
    assert store.describe() == f"{s3_server.endpoint}/{s3_server.bucket}"
    assert planted not in repr(store) and planted not in repr(vars(store))
    # the server refuses the planted secret: its error message does not carry it either
    with pytest.raises(S3StoreError) as caught:
        store.ping()
    assert planted not in str(caught.value) and planted not in repr(caught.value.__cause__)


def test_the_store_survives_a_server_restart(store, s3_server, prefix):
    store.put([(prefix + "a", [b"kept"])])
    # SIGKILL and start again (same ports and data) → the value is still there, read on new connections
    s3_server.restart()
    assert values(store, [prefix + "a"]) == [b"kept"]
    assert store.put([(prefix + "b", [b"b"])]) == [True]


def test_https_trusts_the_ca_file_and_nothing_else(s3_server, make_store, prefix):
    if s3_server.https_endpoint is None:
        pytest.skip("no `openssl` command to make a certificate with")
    # the CA that signed the server's certificate → served over TLS
    trusting = make_store(endpoint=s3_server.https_endpoint, ca_file=s3_server.ca_file)
    assert trusting.put([(prefix + "a", [b"over tls"])]) == [True]
    assert values(trusting, [prefix + "a"]) == [b"over tls"]
    # the system's roots alone → the certificate is refused, and the error says why
    doubting = make_store(endpoint=s3_server.https_endpoint)
    with pytest.raises(S3StoreError, match="InvalidCertificate"):
        doubting.exists([prefix + "a"])


@pytest.mark.parametrize(
    ("endpoint", "kwargs", "message"),
    [
        ("ftp://host", {}, "must look like"),
        ("http://user:pw@host:9000", {}, "must not hold credentials"),
        ("http://host:9000", {"access_key_id": "k"}, "both"),
        ("http://host:9000", {"timeout_ms": 0}, "> 0"),
        ("https://host", {"ca_file": "/nonexistent/ca.pem"}, "ca_file"),
    ],
)
def test_bad_arguments_say_what_to_change(endpoint, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        S3Store(endpoint, "bucket", **kwargs)


def test_close_is_idempotent_and_final(make_store, prefix):
    store = make_store()
    store.close()
    store.close()
    with pytest.raises(S3StoreError, match="closed"):
        store.get([prefix + "a", prefix + "b"])


def test_get_into_fills_buffers_and_never_reads_a_body_of_another_size(store, prefix, monkeypatch):
    import obstore

    value, huge = bytes(range(256)) * 64, 8 << 20
    store.put([(prefix + "ok", [value]), (prefix + "huge", [bytes(huge)])])
    bodies_read: list[str] = []
    real_get = obstore.get

    class Watched:
        """obstore's GetResult, noting whose body is read."""

        def __init__(self, result) -> None:
            self._result = result
            self.meta = result.meta

        def bytes(self):
            bodies_read.append(self.meta["path"])
            return self._result.bytes()

        def stream(self, *args, **kwargs):
            bodies_read.append(self.meta["path"])
            return self._result.stream(*args, **kwargs)

    monkeypatch.setattr(obstore, "get", lambda *args, **kwargs: Watched(real_get(*args, **kwargs)))
    dests = [
        [memoryview(bytearray(128)), memoryview(np.zeros((len(value) - 128) // 4, np.float32))]
        for _ in range(3)
    ]
    # the right size → into the buffers; another size → its size, its body never read; absent → None
    sizes = store.get_into([prefix + "ok", prefix + "huge", prefix + "absent"], dests)
    assert sizes == [len(value), huge, None]
    assert b"".join(bytes(d) for d in dests[0]) == value
    assert bodies_read == [prefix + "ok"]


def test_get_into_reports_every_piece_so_the_value_is_verified_as_it_is_copied(store, prefix):
    from kvtier.tiers.namespace import Namespace
    from kvtier.tiers.remote.values import ValueCodec

    # a value of 1 MiB and a bit: more than one piece is copied (and hashed) into the rows
    payload_bytes = (1 << 20) + 4096 + 5
    codec = ValueCodec(
        Namespace("s3-incoming", "float16", "blocks", 16, 4, "sha256_cbor", 1, payload_bytes),
        "kvtier",
        "/",
    )
    key = bytes(range(36))
    payload = np.random.default_rng(3).integers(0, 256, payload_bytes, np.uint8)
    store.put([(prefix + "v", codec.pack(key, [memoryview(payload)]))])
    rows = [
        memoryview(np.zeros(4096, np.uint8)),
        memoryview(np.zeros(payload_bytes - 4096, np.uint8)),
    ]
    incoming = codec.receiving_parts(rows)
    assert store.get_into([prefix + "v"], [incoming]) == [codec.value_bytes]
    # every byte was reported as it landed: the check uses that digest, and it is the payload's
    assert (
        incoming.num_received == codec.value_bytes
        and codec.check(key, codec.value_bytes, incoming) is None
    )
    assert b"".join(bytes(r) for r in rows) == payload.tobytes()


# -- a batch ends only once every request of it has ended (issue 32, defect 4) ---------------------


@pytest.mark.parametrize("op", ["put", "get_into"])
def test_a_failed_request_ends_its_batch_only_once_the_others_have_ended(
    store, make_store, prefix, monkeypatch, op
):
    """A PUT reads the caller's buffers until its request ends, a GET copies into them: a batch
    that raised at its first failure let the caller hand them on while another request still
    used them (the next owner's bytes uploaded under the old name, or overwritten by the old value)."""
    from held_requests import CEILING_S, HeldRequests, first_of, logged

    failing, held = prefix + "fails", prefix + "held"
    value, next_owner = bytes(range(256)) * 16, b"\x5a" * 4096
    if op == "get_into":
        store.put([(held, [value])])
    # the first request fails at once (the old code raised it without waiting for the second), the second is held
    requests = HeldRequests(
        monkeypatch, "put" if op == "put" else "get", held=held, failing=failing, fails_after=1
    )
    rows = [bytearray(value), bytearray(value if op == "put" else bytes(len(value)))]
    outcome: list[object] = []
    returned = threading.Event()

    def call() -> None:
        try:
            if op == "put":
                outcome.append(
                    store.put([(failing, [memoryview(rows[0])]), (held, [memoryview(rows[1])])])
                )
            else:
                outcome.append(
                    store.get_into([failing, held], [[memoryview(rows[0])], [memoryview(rows[1])]])
                )
        except Exception as exc:
            outcome.append(exc)
        finally:
            returned.set()

    caller = threading.Thread(target=call)
    with logged("kvtier.tiers.remote.s3", "still running") as batch_waits:
        caller.start()
        assert requests.has_failed.wait(CEILING_S) and requests.is_held.wait(CEILING_S)
        # the call either ends now, its held request still running, or says it waits for it
        first = first_of({"returned": returned.is_set, "waits": batch_waits.is_set})
    # the caller hands its buffer to another owner as soon as the call is over
    if first == "returned":
        rows[1][:] = next_owner
    requests.release()
    caller.join(CEILING_S)
    if first != "returned":
        rows[1][:] = next_owner
    # waits for any request still running on the pool
    store.close()
    if op == "put":
        (stored,) = values(make_store(), [held])
        damage = (
            None if stored == value else "the next owner's bytes were uploaded under the held name"
        )
    else:
        damage = None if rows[1] == next_owner else "the held GET overwrote the next owner's bytes"
    assert (first, damage) == (
        "waits",
        None,
    ), f"the batch ended with {outcome} while its held request ran"
    # the failure is reported for its item only; the other's result is there
    (failed,) = outcome
    assert isinstance(failed, store_contract.ItemsFailed) and list(failed.errors) == [0]
    assert isinstance(failed.first, S3StoreError) and "injected" in str(failed.first)
    assert failed.results == [None, True if op == "put" else len(value)]


def test_a_partly_failed_batch_reports_each_item_and_a_wholly_failed_one_raises_the_first_error(
    store, prefix, monkeypatch
):
    from held_requests import HeldRequests

    HeldRequests(monkeypatch, "put", failing=prefix + "b", fails_after=2)
    # a, b, c → b fails once a and c are sent, and they are written: each item's outcome, the failure by index
    with pytest.raises(store_contract.ItemsFailed) as caught:
        store.put([(prefix + n, [n.encode()]) for n in "abc"])
    assert caught.value.results == [True, None, True] and list(caught.value.errors) == [1]
    assert store.exists([prefix + n for n in "abc"]) == [True, False, True]
    assert not store.is_timeout(caught.value)
    # every item fails (two of the one failing name) → the first failure itself, as a single item's would be
    HeldRequests(monkeypatch, "put", failing=prefix + "d")
    with pytest.raises(S3StoreError, match="injected"):
        store.put([(prefix + "d", [b"d"]), (prefix + "d", [b"d again"])])
