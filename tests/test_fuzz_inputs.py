"""Bad input, fuzzed with hypothesis: whatever a user, a request or a storage medium hands kvtier.

- `kv_connector_extra_config`: any dict (wrong types, huge values, unknown keys, nested garbage)
  is either a valid `KVTierConfig` or a one-line `ConfigError` naming the key, from
  `KVTierConfig.from_dict` and from the vLLM connector's construction alike; nothing else escapes.
- `kv_transfer_params`: any value is parsed without raising, malformed ones with a short warning,
  and garbage on one request never changes what another request gets from the real scheduler.
- Stored values: a chunk file (DiskTier) or a remote value (Redis, S3) cut short, extended,
  overwritten, bit-flipped, or with a forged header (magic, version, namespace, key, lengths,
  checksum, each with a valid header checksum so that only its own check can catch it) is never
  served: the load fails, is counted `corrupt`, and the value is deleted — unless the bytes that
  changed are padding no reader uses, and then the chunk is served intact.

Example counts keep the whole file well under a minute on two cores; `derandomize` is off, so
each run tries new inputs (a failure prints its input, and hypothesis's database replays it).
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import hypothesis.strategies as st
import pytest
import xxhash
from hypothesis import HealthCheck, assume, example, given, settings

from helpers import HANG_S, key
from kvtier.base import LookupResult
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.scheduler import OffloadParams, parse_kv_transfer_params
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.secondary import _HEADER_CHECK, _LAYOUT, HEADER_BYTES, SecondaryTier
from sched_helpers import make_engine, prompt
from tier_jobs import Slab, load, store

SLOT = 4096
VALID_KEYS = KVTierConfig.valid_keys()
# no deadline (no timed assertions); the tiers and engines a test builds serve all of its examples
FUZZ = settings(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def fuzz(max_examples: int) -> settings:
    return settings(FUZZ, max_examples=max_examples)


# -- kv_connector_extra_config ----------------------------------------------------------------------

huge_ints = st.sampled_from([0, -1, 2**31, 2**63, 2**64, 10**30, -(10**30), 10**400])
# 400 digits: inf
sizes = st.from_regex(r"\d{1,400}(\.\d{1,3})?\s?(GiB|MiB|k|TB|b|)\n?", fullmatch=True)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    huge_ints,
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=8),
    sizes,
)
garbage = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3)
    | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
# values some key accepts, so that valid configurations come up too
plausible = st.sampled_from(
    [
        "4GiB",
        "512 MiB",
        1,
        2,
        64,
        0.5,
        10.0,
        True,
        False,
        "lru",
        "arc",
        "auto",
        "write_through",
        "on_evict",
        "0600",
        "0640",
        "plain",
        "keyed",
        "sync",
        "async",
        "eager",
        "lazy",
        "kvtier",
        "/tmp/kvtier",
        "redis://localhost:6379/0",
        "redis://:hunter2@localhost:6379",
        "rediss://cache",
        "http://s3.local:9000",
        "my-bucket",
        "us-east-1",
        None,
    ]
)
config_keys = st.one_of(st.sampled_from(VALID_KEYS), st.text(max_size=12))
configs = st.dictionaries(config_keys, st.one_of(garbage, plausible), max_size=6)


def check_config(raw) -> KVTierConfig | ConfigError:
    """`from_dict(raw)`: a config, or the ConfigError it raised (any other exception fails the test)."""
    try:
        return KVTierConfig.from_dict(raw)
    except ConfigError as exc:
        return exc


@fuzz(400)
@given(raw=configs)
# 1e400 bytes: a float infinity
@example(raw={"cpu_bytes": "9" * 400 + "GiB"})
# too large for a float
@example(raw={"max_defer_s": 10**400})
# "$" would have matched before the newline
@example(raw={"remote_prefix": "kvtier\n"})
# a (tenant, size) pair whose tenant is a list (dict() raised TypeError)
@example(raw={"disk_tenant_quotas": [([], None)]})
# an unknown key is said first, even beside an extra_tiers that is refused
@example(raw={"extra_tiers": "4GiB", "": "4GiB"})
def test_a_config_dict_is_valid_or_a_config_error_naming_the_key(raw):
    got = check_config(raw)
    if isinstance(got, ConfigError):
        message = str(got)
        unknown = [k for k in raw if k not in VALID_KEYS]
        if unknown:
            assert message.startswith("unknown kvtier config key(s)"), message
        # the first key it names is one that was given
        else:
            assert any(message.startswith(k) for k in raw) or message.startswith(
                "s3_endpoint and s3_bucket"
            ), message
        assert "\n" not in message and len(message) < 2500 + sum(len(str(k)) for k in raw), message
        return
    # a valid config re-validates to itself (what it holds is already normalized)
    again = KVTierConfig.from_dict(got.to_dict())
    assert again == got


@fuzz(50)
@given(raw=st.one_of(garbage, st.lists(st.tuples(st.text(max_size=4), scalars), max_size=2)))
def test_a_config_that_is_not_a_dict_is_a_config_error(raw):
    assume(not isinstance(raw, dict) and raw is not None)
    with pytest.raises(ConfigError, match="kvtier config must be a dict"):
        KVTierConfig.from_dict(raw)


@pytest.fixture(scope="module")
def bare_vllm_config():
    """A VllmConfig with no model (cheap): enough for a connector's construction to reach kvtier's checks."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig

    from kvtier.integrations.vllm import kv_transfer_config

    return VllmConfig(kv_transfer_config=kv_transfer_config())


@fuzz(60)
@given(raw=configs)
def test_the_connector_refuses_a_bad_config_at_construction_as_from_dict_does(
    bare_vllm_config, raw
):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.integrations.vllm.connector import KVTierConnector

    refused = check_config(raw)
    # a valid one would go on to build slabs and tiers
    assume(isinstance(refused, ConfigError))
    # as the engine gets it: through vLLM's own (pydantic) KVTransferConfig
    bare_vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=raw,
    )
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError) as raised:
            KVTierConnector(bare_vllm_config, role, None)
        assert str(raised.value) == str(refused)


# -- kv_transfer_params ------------------------------------------------------------------------------

ours = st.dictionaries(
    st.one_of(st.sampled_from(["load", "store", "max_load_tokens"]), st.text(max_size=6)),
    st.one_of(st.booleans(), st.integers(-2, 40), garbage),
    max_size=3,
)
transfer_params = st.one_of(
    garbage,
    st.dictionaries(
        st.sampled_from(["kvtier", "other_connector"]), st.one_of(ours, garbage), max_size=2
    ),
)


class Records(logging.Handler):
    """The records one logger emits while attached (a real handler on the real logger)."""

    def __init__(self, name: str):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger(name)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Records:
        self.logger.addHandler(self)
        self.old_level = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.old_level)


def expected_params(raw) -> tuple[OffloadParams, bool]:
    """What the params should mean, and whether they are malformed (worth a warning), written
    from the documented format alone: {"kvtier": {"load": bool, "store": bool, "max_load_tokens":
    int from 0 to 2**63 - 1}}."""
    if raw is None:
        return OffloadParams(), False
    if not isinstance(raw, dict):
        return OffloadParams(), True
    mine = raw.get("kvtier")
    if mine is None:
        return OffloadParams(), False
    if not isinstance(mine, dict):
        return OffloadParams(), True
    flags = {name: mine.get(name, True) for name in ("load", "store")}
    cap = mine.get("max_load_tokens")
    is_cap = isinstance(cap, int) and not isinstance(cap, bool) and 0 <= cap < 2**63
    is_bad = (
        any(k not in ("load", "store", "max_load_tokens") for k in mine)
        or any(not isinstance(v, bool) for v in flags.values())
        or (cap is not None and not is_cap)
    )
    return OffloadParams(
        **{n: v if isinstance(v, bool) else True for n, v in flags.items()},
        max_load_tokens=cap if is_cap else None,
    ), is_bad


@fuzz(400)
@given(raw=transfer_params)
# megabytes of garbage
@example(raw={"kvtier": {"load": "x" * 1_000_000, "y" * 100_000: 1}})
@example(raw={"kvtier": {"load": False, "store": 0}})
# past an int64: refused with a warning, as documented
@example(raw={"kvtier": {"max_load_tokens": 2**63}})
def test_kv_transfer_params_never_raise_and_warn_in_a_line(raw):
    with Records("kvtier.scheduler.params") as log:
        params = parse_kv_transfer_params(raw, "req-7")
    wanted, is_bad = expected_params(raw)
    assert params == wanted
    assert bool(log.records) == is_bad
    for record in log.records:
        message = record.getMessage()
        assert (
            record.levelno == logging.WARNING and "req-7" in message and len(message) < 600
        ), message[:200]


# 4 chunks of one 4-token block each
PREFIXES = {
    "victim": prompt(16, seed=11),
    "garbage": prompt(16, seed=12),
}


def serve_with_garbage(params) -> tuple[tuple, tuple]:
    """Two requests in one batch of the real scheduler and worker (the fake engine checking every
    block): one with `params`, and a victim. Each prompt's prefix was stored earlier (and the engine's
    own cache emptied since), and they share nothing, so neither can serve the other."""
    engine = make_engine()
    for name, prefix in PREFIXES.items():
        engine.add_request(f"warm-{name}", prefix + [5], 1)
    engine.run()
    # what comes back now comes from kvtier
    engine.reset_prefix_cache()
    garbage = engine.add_request(
        "garbage", PREFIXES["garbage"] + prompt(8, seed=13), 2, kv_transfer_params=params
    )
    victim = engine.add_request("victim", PREFIXES["victim"] + prompt(8, seed=14), 2)
    engine.run()
    engine.close()
    assert garbage.is_finished and victim.is_finished
    return (
        (victim.num_external_tokens, victim.output),
        (garbage.num_external_tokens, garbage.output),
    )


@pytest.fixture(scope="module")
def reference() -> tuple[tuple, tuple]:
    return serve_with_garbage(None)


@fuzz(40)
@given(raw=transfer_params)
def test_garbage_params_on_one_request_change_nothing_for_another(reference, raw):
    with Records("kvtier.scheduler.params") as log:
        victim, garbage = serve_with_garbage(raw)
    wanted, is_bad = expected_params(raw)
    # the victim gets exactly what it gets next to a request without params
    assert victim == reference[0] and victim[0] == 16
    # the request with garbage is served too, as its params mean (garbage: the defaults)
    # whole 4-token chunks
    loadable = 16 if wanted.max_load_tokens is None else wanted.max_load_tokens // 4 * 4
    assert garbage[0] == (min(16, loadable) if wanted.load else 0) and garbage[1] == reference[1][1]
    assert any("request garbage" in r.getMessage() for r in log.records) == is_bad


# -- stored values: short, long, wrong magic, version, namespace, key, flipped bits --------------------

# the header's bytes its checksum covers; the rest is padding
_CHECKED_HEADER = _LAYOUT.size + _HEADER_CHECK.size
_FIELDS = ("magic", "version", "key_len", "namespace", "payload_bytes", "payload_checksum", "key")
_FIELD_VALUES = {
    "magic": st.binary(min_size=8, max_size=8),
    "version": st.integers(0, 2**16 - 1),
    "key_len": st.integers(0, 2**16 - 1),
    "namespace": st.binary(min_size=16, max_size=16),
    "payload_bytes": st.integers(0, 2**64 - 1),
    "payload_checksum": st.integers(0, 2**64 - 1),
    "key": st.binary(max_size=64),
}


def edits(size: int):
    """One edit of a value of `size` bytes, as data (hypothesis prints it when a test fails)."""
    pos = st.integers(0, size - 1)
    return st.one_of(
        st.tuples(st.just("truncate"), st.integers(0, size - 1)),
        st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
        st.tuples(st.just("flip"), pos, st.integers(0, 7)),
        st.tuples(st.just("write"), pos, st.binary(min_size=1, max_size=32)),
        st.tuples(st.just("replace"), st.binary(min_size=size, max_size=size)),
        st.sampled_from(_FIELDS).flatmap(
            lambda f: st.tuples(st.just("forge"), st.just(f), _FIELD_VALUES[f])
        ),
    )


def apply(value: bytes, edit: tuple) -> bytes:
    """`value` after `edit` (positions wrap around a value an earlier edit shortened)."""
    kind, *args = edit
    if kind == "extend":
        return value + args[0]
    if kind == "replace":
        return args[0]
    if not value:
        return value
    if kind == "truncate":
        return value[: args[0]]
    if kind == "forge":
        return forge(value, *args)
    at = args[0] % len(value)
    if kind == "flip":
        return value[:at] + bytes([value[at] ^ (1 << args[1])]) + value[at + 1 :]
    # write
    return value[:at] + args[1] + value[at + len(args[1]) :]


def forge(value: bytes, field: str, new) -> bytes:
    """`value` with one header field replaced and the header's own checksum made valid again."""
    if len(value) < _CHECKED_HEADER:
        return value
    parts = dict(zip(_FIELDS, _LAYOUT.unpack(value[: _LAYOUT.size]), strict=True))
    parts[field] = new
    if field == "key":
        parts["key_len"] = len(new)
    body = _LAYOUT.pack(*(parts[f] for f in _FIELDS))
    return body + _HEADER_CHECK.pack(xxhash.xxh3_64_intdigest(body)) + value[_CHECKED_HEADER:]


def checked_bytes_changed(before: bytes, after: bytes, payload_at: int) -> bool:
    """Whether `after` differs from `before` anywhere a reader checks: the length, the header's
    checked bytes, or the payload (from `payload_at`)."""
    return (
        len(after) != len(before)
        or after[:_CHECKED_HEADER] != before[:_CHECKED_HEADER]
        or after[payload_at:] != before[payload_at:]
    )


_keys = itertools.count(1000)


def assert_never_served(
    tier: SecondaryTier, slab: Slab, k: bytes, before: bytes, after: bytes, payload_at: int, is_gone
) -> None:
    """Load `k` (stored as `before`, now `after`): served intact, or failed, counted and deleted."""
    corrupt = tier.stats().counters["corrupt"]
    failed = load(tier, slab, [k]).failed_keys == {k}
    assert failed == checked_bytes_changed(before, after, payload_at)
    if failed:
        assert tier.stats().counters["corrupt"] == corrupt + 1
        assert tier.drain(HANG_S) and is_gone() and tier.lookup(k) is not LookupResult.HIT
    else:
        assert slab.holds(0, k)


def namespace(model: str = "fuzz") -> Namespace:
    return Namespace(model, "float16", "blocks", 16, 4, "sha256_cbor", 1, SLOT)


# a header block, then the payload
DISK_FILE_BYTES = 4096 + SLOT
REMOTE_VALUE_BYTES = HEADER_BYTES + SLOT
# each damage the issue names, alone, on every run; hypothesis adds its own (and combinations)
NAMED = [
    ("truncate", 100),
    ("truncate", DISK_FILE_BYTES - 1),
    ("extend", b"\x00"),
    ("flip", 5000, 3),
    ("flip", 0, 0),
    ("forge", "magic", b"NOTKVTIE"),
    ("forge", "version", 2),
    ("forge", "namespace", bytes(16)),
    ("forge", "key", b"another key"),
    ("forge", "key_len", 65),
    ("forge", "payload_bytes", SLOT - 1),
    ("forge", "payload_checksum", 0),
]


def with_named_damages(test):
    for edit in NAMED:
        test = example(edit_list=[edit])(test)
    return test


@pytest.fixture
def disk(tmp_path):
    tier = DiskTier(tmp_path / "disk", namespace(), 1024 * (4096 + SLOT))
    assert tier.wait_scanned(HANG_S)
    yield tier
    tier.close()


@fuzz(60)
@given(edit_list=st.lists(edits(DISK_FILE_BYTES), min_size=1, max_size=3))
@with_named_damages
def test_a_damaged_chunk_file_is_never_served(disk, edit_list):
    slab, k = Slab(1, namespace()), key(next(_keys))
    store(disk, slab, [k])
    path = Path(disk.directory) / k.hex()[:2] / f"{k.hex()}.kv"
    before = path.read_bytes()
    after = before
    for edit in edit_list:
        after = apply(after, edit)
    path.write_bytes(after)
    assert_never_served(disk, slab, k, before, after, 4096, lambda: not path.exists())


def remote_damage_test(tier: RemoteTier, edit_list: list[tuple]) -> None:
    # the tier's namespace has the same shape
    slab, k = Slab(1, namespace()), key(next(_keys))
    store(tier, slab, [k])
    name = tier.codec.name(k)
    before = bytes(tier.store.get([name])[0])
    after = before
    for edit in edit_list:
        after = apply(after, edit)
    tier.store.delete([name])
    assert tier.store.put([(name, [after])]) == [True]
    assert_never_served(
        tier, slab, k, before, after, HEADER_BYTES, lambda: tier.store.exists([name]) == [False]
    )


@pytest.fixture
def redis_tier(redis_server):
    from kvtier.tiers.remote.redis import RedisStore

    tier = RemoteTier(
        RedisStore(redis_server.ready().url), namespace(f"fuzz-{time.monotonic_ns()}")
    )
    yield tier
    tier.reset()
    tier.drain(HANG_S)
    tier.close()


@fuzz(40)
@given(edit_list=st.lists(edits(REMOTE_VALUE_BYTES), min_size=1, max_size=3))
@with_named_damages
def test_a_damaged_redis_value_is_never_served(redis_tier, edit_list):
    remote_damage_test(redis_tier, edit_list)


@pytest.fixture
def s3_tier(s3_server):
    from kvtier.tiers.remote.s3 import S3Store

    store_ = S3Store(
        s3_server.endpoint,
        s3_server.bucket,
        access_key_id=s3_server.access_key_id,
        secret_access_key=s3_server.secret_access_key,
    )
    tier = RemoteTier(store_, namespace(f"fuzz-{time.monotonic_ns()}"))
    yield tier
    tier.reset()
    tier.drain(HANG_S)
    tier.close()


@fuzz(15)
@given(edit_list=st.lists(edits(REMOTE_VALUE_BYTES), min_size=1, max_size=3))
@with_named_damages
def test_a_damaged_s3_value_is_never_served(s3_tier, edit_list):
    remote_damage_test(s3_tier, edit_list)


# -- keyed mode: whoever writes the store without the secret cannot make a value pass ---------------

# + the tag
KEYED_VALUE_BYTES = HEADER_BYTES + SLOT + 32


def reforge(value: bytes, mask: int) -> bytes:
    """`value` with its payload changed and a header made valid for it again (payload and header
    checksums): everything a writer without the secret can do."""
    if len(value) < HEADER_BYTES + SLOT:
        return value
    payload = bytes(b ^ mask for b in value[HEADER_BYTES : HEADER_BYTES + SLOT])
    header = forge(value[:HEADER_BYTES], "payload_checksum", xxhash.xxh3_64_intdigest(payload))
    return header + payload + value[HEADER_BYTES + SLOT :]


@pytest.fixture
def keyed_redis_tier(redis_server):
    from kvtier.tiers.remote.redis import RedisStore

    tier = RemoteTier(
        RedisStore(redis_server.ready().url),
        namespace(f"fuzz-keyed-{time.monotonic_ns()}"),
        key_secret=b"fuzz deployment secret, 32 bytes",
    )
    yield tier
    tier.reset()
    tier.drain(HANG_S)
    tier.close()


@fuzz(30)
@given(
    edit_list=st.lists(
        edits(KEYED_VALUE_BYTES) | st.tuples(st.just("reforge"), st.integers(1, 255)),
        min_size=1,
        max_size=3,
    )
)
@example(edit_list=[("reforge", 0x5A)])
@example(edit_list=[("flip", KEYED_VALUE_BYTES - 1, 0)])
# header padding: covered by the tag too
@example(edit_list=[("flip", HEADER_BYTES - 1, 0)])
def test_a_keyed_value_changed_anywhere_is_never_served(keyed_redis_tier, edit_list):
    tier, slab, k = keyed_redis_tier, Slab(1, namespace()), key(next(_keys))
    store(tier, slab, [k])
    name = tier.codec.name(k)
    before = bytes(tier.store.get([name])[0])
    after = before
    for edit in edit_list:
        after = reforge(after, edit[1]) if edit[0] == "reforge" else apply(after, edit)
    tier.store.delete([name])
    assert tier.store.put([(name, [after])]) == [True]
    # any change at all (the tag covers the header, padding included, and the payload): refused
    corrupt = tier.stats().counters["corrupt"]
    failed = load(tier, slab, [k]).failed_keys == {k}
    assert failed == (after != before)
    if failed:
        assert tier.stats().counters["corrupt"] == corrupt + 1
        assert tier.drain(HANG_S) and tier.store.exists([name]) == [False]
    else:
        assert slab.holds(0, k)
