"""Disaggregated prefill through a shared tier (`kvtier.scheduler.handoff`), without vLLM: two fake
engines — a producer (prefill) and a consumer (decode) — each drive the real OffloadScheduler, a
TieredManager and the real worker, over one directory that both engines' real disk tiers use.
The fake engines check every block a token attends to, so a hand-off that brought the wrong
bytes raises ContentMismatch.

The producer's writes to the shared directory are held (`HeldTier`) where a test needs the
consumer to ask before they land: what the consumer sees then does not depend on timing. The
consumer's disk tier never rescans on its own (`rescan_s=None`): only the hand-off's fresh check
(`recheck`) can show it what the producer wrote. Its deadline runs on a fake clock.

Block size 4 tokens, chunks of 1 block; prompts of 8 whole chunks and a 2-token tail.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable

import pytest

from helpers import HANG_S
from kvtier.build import build_manager
from kvtier.config import KVTierConfig
from kvtier.keys import OFFLOAD_KEY_BYTES
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.scheduler.config import GroupKind
from kvtier.scheduler.params import for_role, parse_kv_transfer_params
from kvtier.sim import FakeEngine, KVCache
from kvtier.sim.fake_engine import make_slab
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.disk.tier import _RECHECK_EVERY_S, DiskTier
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.redis import RedisStore
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.secondary import SecondaryTier
from kvtier.tiers.tiered import TieredManager
from sched_helpers import UNBOUNDED_DEFERRALS, FakeClock, close_after_test, prompt, run_until_done
from tier_helpers import HeldTier

NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS = 64, 4, 32
PROMPT_TOKENS = 8 * BLOCK_SIZE + 2
# what a decode engine can load of it: whole chunks, at most num_tokens - 1 tokens
PROMISED_CHUNKS = (PROMPT_TOKENS - 1) // BLOCK_SIZE
MARKER = {"do_remote_decode": True}
# the producer's own write-down never writes a chunk: only the hand-off can
NO_WRITE_DOWN = TierRules(write_mode="on_evict", min_offers=3)


class Side:
    """One engine of the pair: the fake engine, its manager and its tier."""

    def __init__(self, engine: FakeEngine, manager: TieredManager, tier):
        self.engine = engine
        self.manager = manager
        self.tier = tier
        self.stats = engine.scheduler.stats

    def close(self) -> None:
        if isinstance(self.tier, HeldTier):
            self.tier.release()
        self.manager.close()
        self.engine.close()


def namespace(slot_bytes: int) -> Namespace:
    return Namespace("sim", "float32", "sim", BLOCK_SIZE, 1, "sha256", 1, slot_bytes)


def side(
    root,
    role: str,
    clock: FakeClock,
    rules: TierRules | None = None,
    hold: bool = False,
    tier: Callable[[Namespace], SecondaryTier] | None = None,
    groups: tuple[GroupSpec, ...] = (GroupSpec(tokens_per_block=BLOCK_SIZE),),
    quota: int | None = None,
    **config,
) -> Side:
    """One engine over a disk tier in `root` (held: `hold`) unless `tier` is given (a function of
    the namespace); `quota`: the CPU slots a request of tenant "t" may hold."""
    slab = make_slab(KVCache(len(groups), NUM_BLOCKS, BLOCK_SIZE), 1, NUM_SLOTS)
    row_bytes = slab.rows.shape[1]
    if tier is None:
        disk = DiskTier(root, namespace(row_bytes), 256 * (row_bytes + 4096), rescan_s=None)
        assert disk.wait_scanned(HANG_S)
        built: SecondaryTier = HeldTier(disk) if hold else disk
    else:
        built = tier(namespace(row_bytes))
    quotas = None if quota is None else {"t": quota}
    manager = TieredManager(
        CPUTierManager(
            NUM_SLOTS, store_threshold=config.pop("store_threshold", 1), tenant_quotas=quotas
        ),
        [slab.rows],
        [(built, rules or TierRules())],
        job_timeout_s=HANG_S,
        # the directory is shared: the tests' engines run side by side
        handoff_tier=built.medium,
    )
    scheduler_config = SchedulerOffloadConfig(
        groups=groups, max_deferrals=UNBOUNDED_DEFERRALS, role=role, **config
    )
    engine = FakeEngine(
        OffloadScheduler(scheduler_config, manager, clock=clock),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        clock=clock,
        slab=slab,
    )
    return close_after_test(Side(engine, manager, built))


def prefill(producer: Side, req_id: str, tokens: list[int], **kw) -> dict:
    req = producer.engine.add_request(req_id, tokens, 1, kv_transfer_params=dict(MARKER), **kw)
    run_until_done(producer.engine)
    return req.returned_params


def step_a_while(engine: FakeEngine, num_steps: int = 30) -> None:
    for _ in range(num_steps):
        engine.step()


def handoff_of(params: dict) -> dict:
    return params["kvtier"]["handoff"]


def test_the_consumer_waits_for_what_it_was_promised_and_loads_it(tmp_path):
    clock = FakeClock()
    producer = side(tmp_path, "kv_producer", clock, rules=NO_WRITE_DOWN, hold=True)
    consumer = side(tmp_path, "kv_consumer", clock)
    tokens = prompt(PROMPT_TOKENS, seed=1)
    params = prefill(producer, "p", tokens)
    promise = handoff_of(params)
    assert promise["chunks"] == PROMISED_CHUNKS
    assert promise["tokens"] == PROMISED_CHUNKS * BLOCK_SIZE
    assert promise["tier"] == "disk"
    # the race a store connector alone loses: sent at once, without the promise, nothing is there
    plain = consumer.engine.add_request("plain", tokens, 2)
    run_until_done(consumer.engine)
    assert plain.num_external_tokens == 0
    consumer.engine.reset_prefix_cache()
    # with it, the request waits while the writes are held ...
    req = consumer.engine.add_request("c", tokens, 2, kv_transfer_params=params)
    step_a_while(consumer.engine)
    assert req.num_cached_tokens is None and not req.is_finished
    # ... and loads every promised chunk once they land (the fake engine checks their bytes)
    producer.tier.release()
    run_until_done(consumer.engine)
    assert req.num_external_tokens == PROMISED_CHUNKS * BLOCK_SIZE
    assert consumer.stats.handoff_waits == 1
    assert consumer.stats.handoff_timeouts == 0
    # a consumer stores nothing by default; the producer wrote each promised chunk once
    assert consumer.stats.store_jobs == 0
    assert producer.manager.drain(HANG_S)
    counters = producer.manager.tier_stats()[0].counters
    assert counters["handoff_chunks"] == PROMISED_CHUNKS
    assert counters["handoff_failures"] == 0
    assert counters["cascaded_chunks"] == 0
    assert producer.stats.handoff_promises == 1


def test_past_its_deadline_the_consumer_recomputes_what_did_not_come(tmp_path):
    clock = FakeClock()
    producer = side(tmp_path, "kv_producer", clock, rules=NO_WRITE_DOWN, hold=True)
    consumer = side(tmp_path, "kv_consumer", clock, handoff_wait_s=3.0)
    tokens = prompt(PROMPT_TOKENS, seed=2)
    params = prefill(producer, "p", tokens)
    req = consumer.engine.add_request("c", tokens, 2, kv_transfer_params=params)
    step_a_while(consumer.engine)
    assert req.num_cached_tokens is None
    clock.now += 3.0
    run_until_done(consumer.engine)
    assert req.num_external_tokens == 0
    assert consumer.stats.handoff_timeouts == 1
    # its budget is spent: nothing else makes it wait again
    assert consumer.engine.scheduler.request_state("c") is None


def test_the_wait_is_the_shorter_of_the_consumers_and_the_producers(tmp_path):
    clock = FakeClock()
    producer = side(tmp_path, "kv_producer", clock, rules=NO_WRITE_DOWN, hold=True)
    consumer = side(tmp_path, "kv_consumer", clock, handoff_wait_s=1000.0)
    tokens = prompt(PROMPT_TOKENS, seed=3)
    params = prefill(producer, "p", tokens)
    handoff_of(params)["deadline_s"] = 2.0
    req = consumer.engine.add_request("c", tokens, 2, kv_transfer_params=params)
    step_a_while(consumer.engine)
    clock.now += 2.0
    run_until_done(consumer.engine)
    assert req.num_external_tokens == 0
    assert consumer.stats.handoff_timeouts == 1


def test_a_promise_for_another_prompt_or_tenant_is_not_awaited(tmp_path):
    clock = FakeClock()
    producer = side(tmp_path, "kv_producer", clock, rules=NO_WRITE_DOWN, hold=True)
    consumer = side(tmp_path, "kv_consumer", clock)
    tokens = prompt(PROMPT_TOKENS, seed=4)
    params = prefill(producer, "p", tokens)
    salted = consumer.engine.add_request(
        "salted", tokens, 2, kv_transfer_params=params, cache_salt="another"
    )
    other = consumer.engine.add_request(
        "other", prompt(PROMPT_TOKENS, seed=5), 2, kv_transfer_params=params
    )
    shorter = consumer.engine.add_request("short", tokens[:9], 2, kv_transfer_params=params)
    # nobody waits: the writes stay held, and the fake clock never moves
    run_until_done(consumer.engine)
    assert [r.num_external_tokens for r in (salted, other, shorter)] == [0, 0, 0]
    assert consumer.stats.handoff_mismatches == 3
    assert consumer.stats.handoff_waits == 0


def test_a_promise_from_an_engine_of_another_namespace_is_not_awaited(tmp_path):
    clock = FakeClock()
    producer = side(tmp_path, "kv_producer", clock, rules=NO_WRITE_DOWN, namespace_id="aa" * 16)
    consumer = side(tmp_path, "kv_consumer", clock, namespace_id="bb" * 16)
    tokens = prompt(PROMPT_TOKENS, seed=8)
    params = prefill(producer, "p", tokens)
    assert handoff_of(params)["namespace"] == "aa" * 16
    req = consumer.engine.add_request("c", tokens, 2, kv_transfer_params=params)
    run_until_done(consumer.engine)
    assert req.num_external_tokens == 0
    assert consumer.stats.handoff_mismatches == 1


def test_an_unreachable_tier_ends_the_wait_at_once(tmp_path):
    clock = FakeClock()
    producer = side(tmp_path, "kv_producer", clock, rules=NO_WRITE_DOWN, hold=True)
    consumer = side(tmp_path, "kv_consumer", clock, tier=_dead_redis)
    tokens = prompt(PROMPT_TOKENS, seed=6)
    params = prefill(producer, "p", tokens)
    handoff_of(params)["tier"] = "redis"
    req = consumer.engine.add_request("c", tokens, 2, kv_transfer_params=params)
    run_until_done(consumer.engine)
    assert req.num_external_tokens == 0
    assert consumer.stats.handoff_unreachable == 1
    assert consumer.stats.handoff_timeouts == 0


def test_a_hand_off_passes_ram_admission_and_keeps_a_prefix_ram_held_before(tmp_path):
    clock = FakeClock()
    # RAM admits a chunk on its third offer: the hand-off request's own chunks go in anyway
    producer = side(tmp_path, "kv_producer", clock, rules=NO_WRITE_DOWN, store_threshold=3)
    consumer = side(tmp_path, "kv_consumer", clock)
    tokens = prompt(PROMPT_TOKENS, seed=7)
    params = prefill(producer, "p", tokens)
    assert handoff_of(params)["chunks"] == PROMISED_CHUNKS
    # a second hand-off of the same prompt finds it in the engine's cache and kvtier's RAM
    again = prefill(producer, "p2", tokens)
    assert handoff_of(again)["chunks"] == PROMISED_CHUNKS
    req = consumer.engine.add_request("c", tokens, 2, kv_transfer_params=again)
    run_until_done(consumer.engine)
    assert req.num_external_tokens == PROMISED_CHUNKS * BLOCK_SIZE


def test_without_a_shared_tier_the_promise_is_empty_and_nobody_waits(tmp_path):
    clock = FakeClock()
    slab = make_slab(KVCache(1, NUM_BLOCKS, BLOCK_SIZE), 1, NUM_SLOTS)
    config = SchedulerOffloadConfig(
        groups=(GroupSpec(tokens_per_block=BLOCK_SIZE),), role="kv_producer"
    )
    engine = close_after_test(
        FakeEngine(
            OffloadScheduler(config, CPUTierManager(NUM_SLOTS), clock=clock),
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            clock=clock,
            slab=slab,
        )
    )
    req = engine.add_request("p", prompt(PROMPT_TOKENS), 1, kv_transfer_params=dict(MARKER))
    run_until_done(engine)
    promise = handoff_of(req.returned_params)
    assert promise["chunks"] == 0
    assert promise["key"] == ""
    assert parse_kv_transfer_params(req.returned_params, "d").handoff.chunks == 0


def test_requests_without_the_marker_return_nothing(tmp_path):
    clock = FakeClock()
    producer = side(tmp_path, "kv_both", clock)
    req = producer.engine.add_request("p", prompt(PROMPT_TOKENS), 1)
    # vLLM's marker on a kv_both engine is a transfer connector's beside kvtier (NIXL)
    nixl = producer.engine.add_request("n", prompt(PROMPT_TOKENS, 1), 1, kv_transfer_params=MARKER)
    ours = producer.engine.add_request(
        "o", prompt(PROMPT_TOKENS, 2), 1, kv_transfer_params={"kvtier": {"remote_decode": True}}
    )
    run_until_done(producer.engine)
    assert req.returned_params is None
    assert nixl.returned_params is None
    assert handoff_of(ours.returned_params)["chunks"] == PROMISED_CHUNKS
    assert producer.stats.handoff_promises == 1


A_PROMISE = {"chunks": 1, "tokens": 4, "tier": "redis", "key": "ab"}


@pytest.mark.parametrize(
    ("role", "raw", "load", "store", "remote_decode", "waits"),
    [
        ("kv_both", MARKER, True, True, False, False),
        ("kv_both", {"kvtier": {"remote_decode": True}}, True, True, True, False),
        ("kv_producer", MARKER, True, True, True, False),
        ("kv_producer", {"kvtier": {"remote_decode": True}}, True, True, True, False),
        ("kv_consumer", MARKER, True, False, False, False),
        ("kv_consumer", {"kvtier": {"store": True}}, True, False, False, False),
        ("kv_both", {"kvtier": {"handoff": A_PROMISE}}, True, True, False, True),
        ("kv_producer", {"kvtier": {"handoff": A_PROMISE}}, True, True, False, False),
    ],
)  # fmt: skip
def test_roles_decide_what_a_request_does(role, raw, load, store, remote_decode, waits):
    params = for_role(parse_kv_transfer_params(raw, "r"), role, consumer_stores=False)
    assert (params.load, params.store, params.remote_decode) == (load, store, remote_decode)
    assert (params.handoff is not None) == waits


def test_a_consumer_may_be_told_to_store():
    params = for_role(parse_kv_transfer_params(None, "r"), "kv_consumer", consumer_stores=True)
    assert params.store


@pytest.mark.parametrize(
    "promise",
    [
        "all of it",
        {"chunks": -1, "tokens": 4, "tier": "redis", "key": "ab"},
        {"chunks": 1, "tokens": 4.0, "tier": "redis", "key": "ab"},
        {"chunks": True, "tokens": 4, "tier": "redis", "key": "ab"},
        {"chunks": 1, "tokens": 4, "tier": None, "key": "ab"},
        {"chunks": 1, "tokens": 4, "tier": "redis", "key": "not hex"},
        {"chunks": 1, "tokens": 4, "tier": "redis", "key": ""},
        {"chunks": 1, "tokens": 4, "tier": "redis", "key": "ab" * 65},
        {"chunks": 1, "tokens": 4, "tier": "redis", "key": "ab", "deadline_s": -1},
        {"chunks": 1, "tokens": 4, "tier": "redis", "key": "ab", "deadline_s": float("nan")},
        {"chunks": 2**63, "tokens": 4, "tier": "redis", "key": "ab"},
        {"chunks": 1, "tokens": 4, "tier": "redis", "key": "ab", "namespace": 7},
    ],
)
def test_a_malformed_promise_is_ignored_with_a_warning(promise, caplog):
    params = parse_kv_transfer_params({"kvtier": {"handoff": promise}}, "r")
    assert params.handoff is None
    assert params.load and params.store
    assert "no hand-off is awaited" in caplog.text


# -- a seeded walk over the real stack --------------------------------------------------


def _walk(tmp_path, seed: int) -> None:
    """Prefills and decodes of random prompts (shared heads, tails, salts), the producer's writes
    held and released at random points, the consumer's clock moved at random. Checked: the fake
    engines' block contents (every byte the consumer loads is the producer's KV of that prefix),
    that no decode request loads more than it was promised nor waits past its deadline, and
    that one whose promised writes all landed before its deadline loads all of it."""
    rng = random.Random(seed)
    clock = FakeClock()
    producer = side(tmp_path, "kv_producer", clock, rules=NO_WRITE_DOWN, hold=True)
    consumer = side(tmp_path, "kv_consumer", clock, handoff_wait_s=5.0)
    heads = [prompt(rng.choice([8, 16, 24]), seed=rng.randrange(1000)) for _ in range(3)]
    for i in range(8):
        tokens = rng.choice(heads) + prompt(rng.randrange(1, 12), seed=rng.randrange(1000))
        salt = rng.choice([None, None, "t"])
        params = prefill(producer, f"p{i}", tokens, cache_salt=salt)
        promised = handoff_of(params)["tokens"]
        assert promised <= len(tokens) - 1 and promised % BLOCK_SIZE == 0
        released = rng.random() < 0.7
        if released:
            producer.tier.release()
        consumer.engine.reset_prefix_cache()
        req = consumer.engine.add_request(
            f"c{i}", tokens, 2, kv_transfer_params=params, cache_salt=salt
        )
        step_a_while(consumer.engine, rng.randrange(1, 10))
        if not released:
            clock.now += 5.0
        run_until_done(consumer.engine)
        assert req.num_external_tokens <= promised
        if released:
            assert req.num_external_tokens == promised, (seed, i)
    producer.tier.release()
    assert consumer.stats.handoff_timeouts <= 8


@pytest.mark.parametrize("seed", range(6))
def test_seeded_walks_of_prefills_and_decodes(tmp_path, seed):
    _walk(tmp_path, seed)


# -- review findings ----------------------------------------------------------------------


def _disk(root, num_files: int) -> Callable[[Namespace], DiskTier]:
    """A disk tier in `root` of `num_files` chunk files, as `side` builds it."""

    def make(ns: Namespace) -> DiskTier:
        # a chunk file of these tests takes 8 KiB
        disk = DiskTier(root, ns, num_files * 8192, rescan_s=None)
        assert disk.wait_scanned(HANG_S)
        assert disk.capacity_files == num_files
        return disk

    return make


def _decode(consumer: Side, req_id: str, tokens: list[int], params: dict, **kw):
    """A decode request, stepped until it ends or its tiers had every chance to show it the
    promised chunks: each step's fresh look (at most one a `_RECHECK_EVERY_S`) ends before the
    next step."""
    req = consumer.engine.add_request(req_id, tokens, 2, kv_transfer_params=params, **kw)
    for _ in range(30):
        if req.is_finished:
            break
        consumer.engine.step()
        assert consumer.tier.drain(HANG_S)
        time.sleep(_RECHECK_EVERY_S)
    return req


def _handed_off(producer: Side) -> None:
    """The producer's stores end, and its hand-off writes with them."""
    step_a_while(producer.engine)
    assert producer.manager.drain(HANG_S)
    producer.manager.stats()
    assert producer.manager.drain(HANG_S)


def test_a_consumer_whose_disk_index_is_full_still_sees_new_hand_offs(tmp_path):
    """A decode engine's disk tier adopted other engines' files only into free room, and forgets
    none whose file another engine deleted: once it had adopted `capacity` files of earlier
    hand-offs (which the producer evicts as it writes new ones), it never saw a new hand-off, and
    every later decode request waited its whole deadline and recomputed the prompt."""
    clock = FakeClock()
    # both engines' directories hold 10 chunk files; a prompt hands off 8
    producer = side(tmp_path, "kv_producer", clock, rules=NO_WRITE_DOWN, tier=_disk(tmp_path, 10))
    consumer = side(tmp_path, "kv_consumer", clock, handoff_wait_s=5.0, tier=_disk(tmp_path, 10))
    for i in range(3):
        tokens = prompt(PROMPT_TOKENS, seed=20 + i)
        params = prefill(producer, f"p{i}", tokens)
        assert handoff_of(params)["chunks"] == PROMISED_CHUNKS
        _handed_off(producer)
        req = _decode(consumer, f"c{i}", tokens, params)
        # (a consumer that never saw the chunks is still waiting: its deadline passes now)
        clock.now += 5.0
        run_until_done(consumer.engine)
        assert req.num_external_tokens == PROMISED_CHUNKS * BLOCK_SIZE, f"prompt {i}"
    assert consumer.stats.handoff_timeouts == 0


def _dead_redis(ns: Namespace) -> RemoteTier:
    """A Redis tier of a port nobody listens on, its breaker open."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    return RemoteTier(RedisStore(f"redis://127.0.0.1:{dead}"), ns, start_open=True)


def test_a_hand_off_tier_that_is_down_when_the_request_ends_empties_the_promise(tmp_path):
    """Defect: the docs say a tier that is down when the request ends shortens the promise; the
    producer promised every chunk RAM held, to a tier whose breaker was open, so a decode engine
    that still reaches the tier waits its whole deadline for writes that were refused at once."""
    clock = FakeClock()
    producer = side(tmp_path, "kv_producer", clock, tier=_dead_redis)
    params = prefill(producer, "p", prompt(PROMPT_TOKENS, seed=30))
    assert handoff_of(params)["tier"] == "redis"
    assert handoff_of(params)["chunks"] == 0


HYBRID = (
    GroupSpec(tokens_per_block=BLOCK_SIZE),
    GroupSpec(GroupKind.SLIDING_WINDOW, BLOCK_SIZE, sliding_window=8),
)


def hybrid_side(
    root, role: str, clock: FakeClock, quota: int | None = None, tier=None, **config
) -> Side:
    """A side whose model has a full-attention and a sliding-window KV-cache group, whose own
    write-down writes nothing (only hand-offs reach the tier)."""
    return side(
        root, role, clock, rules=NO_WRITE_DOWN, tier=tier, groups=HYBRID, quota=quota, **config
    )


def test_a_shortened_promise_of_a_hybrid_model_brings_its_window_too(tmp_path):
    """Defect: a promise cut short at chunk c (here: RAM's quota kept the tenant's last chunks
    out) promised c chunks, but the sliding-window group's chunks were handed off only for the
    whole prompt's window: those in the window before chunk c, which a decode engine needs to
    load c chunks, never came, and it waited its whole deadline to load nothing."""
    clock = FakeClock()
    # RAM holds 10 chunks of tenant "t": the first 5 chunks of both groups
    producer = hybrid_side(tmp_path, "kv_producer", clock, quota=10)
    consumer = hybrid_side(tmp_path, "kv_consumer", clock, handoff_wait_s=5.0)
    tokens = prompt(PROMPT_TOKENS, seed=40)
    params = prefill(producer, "p", tokens, cache_salt="t")
    promised = handoff_of(params)["chunks"]
    assert 0 < promised < PROMISED_CHUNKS
    _handed_off(producer)
    req = _decode(consumer, "c", tokens, params, cache_salt="t")
    clock.now += 5.0
    run_until_done(consumer.engine)
    assert req.num_external_tokens == promised * BLOCK_SIZE
    assert consumer.stats.handoff_timeouts == 0


def test_a_hybrid_models_wait_looks_afresh_for_its_window_chunks_too(tmp_path, redis_server):
    """Defect: each step of a wait made the tiers look afresh for the full-attention groups' chunks
    only: a sliding-window chunk found absent when the request first asked stayed absent in the
    shared tier's memory (`absent_ttl_s`), and the request waited its whole deadline."""
    server = redis_server.ready()
    clock = FakeClock()

    def redis(ns: Namespace, **kw) -> RemoteTier:
        return RemoteTier(RedisStore(server.url), ns, **kw)

    held = []

    def producer_tier(ns: Namespace) -> HeldTier:
        held.append(HeldTier(redis(ns), hold_stores=False))
        return held[0]

    producer = hybrid_side(tmp_path, "kv_producer", clock, tier=producer_tier)
    # an absence is remembered longer than any wait here
    consumer = hybrid_side(
        tmp_path, "kv_consumer", clock, tier=lambda ns: redis(ns, absent_ttl_s=1e6)
    )
    tokens = prompt(PROMPT_TOKENS, seed=50)
    # a longer prompt of the same head first: the consumer's RAM gets every full-attention chunk
    # of `tokens` and the window of the longer one, not `tokens`' own window
    longer = tokens[: 8 * BLOCK_SIZE] + prompt(BLOCK_SIZE + 2, seed=51)
    first = _decode(consumer, "c0", longer, prefill(producer, "p0", longer))
    run_until_done(consumer.engine)
    assert first.num_external_tokens == 9 * BLOCK_SIZE
    consumer.engine.reset_prefix_cache()
    # the hand-off of `tokens` is held: its window chunk the consumer lacks is absent when it asks
    held[0].hold_stores = True
    params = prefill(producer, "p", tokens)
    assert handoff_of(params)["chunks"] == PROMISED_CHUNKS
    req = consumer.engine.add_request("c", tokens, 2, kv_transfer_params=params)
    for _ in range(5):
        consumer.engine.step()
        assert consumer.tier.drain(HANG_S)
    assert req.num_cached_tokens is None
    # it lands; each step now looks afresh (a probe and a read a chunk, in the background)
    held[0].release()
    _handed_off(producer)
    deadline = time.monotonic() + HANG_S
    while not req.is_finished and time.monotonic() < deadline:
        consumer.engine.step()
        assert consumer.tier.drain(HANG_S)
    clock.now += 5.0
    run_until_done(consumer.engine)
    assert req.num_external_tokens == PROMISED_CHUNKS * BLOCK_SIZE
    assert consumer.stats.handoff_timeouts == 0


@pytest.mark.parametrize(("handoff_tier", "medium"), [(None, None), ("disk", "disk")])
def test_a_local_disk_is_the_hand_off_tier_only_when_named(tmp_path, handoff_tier, medium):
    """Defect: with no shared tier configured, hand-offs went to the first tier, an engine's own
    `disk_path` (the docs: "the first shared tier"; "a manager without a shared tier hands nothing
    off"). A prefill engine promised every prompt there, and a decode engine with a disk of its
    own waited its whole deadline each time for chunks written to another machine's disk."""
    slab = make_slab(KVCache(1, NUM_BLOCKS, BLOCK_SIZE), 1, NUM_SLOTS)
    raw = {"disk_path": str(tmp_path), "disk_bytes": 64 * 8192}
    if handoff_tier is not None:
        raw["handoff_tier"] = handoff_tier
    cfg = KVTierConfig.from_dict(raw)
    ns = namespace(slab.rows.shape[1])
    manager = build_manager(cfg, NUM_SLOTS, OFFLOAD_KEY_BYTES, [slab.rows], ns)
    try:
        assert manager.handoff_medium == medium
    finally:
        manager.close()
        slab.close()


def test_a_hand_off_that_does_not_store_promises_only_what_is_stored(tmp_path):
    """Defect: a request whose load was still in flight when it ended had every chunk not in RAM
    counted as coming, also when it stores nothing ({"store": false}): the promise named chunks
    that were never written, and its decode engine waited its whole deadline for them."""
    clock = FakeClock()
    producer = side(tmp_path, "kv_producer", clock)
    head = prompt(4 * BLOCK_SIZE, seed=60)
    tokens = head + prompt(4 * BLOCK_SIZE + 2, seed=61)
    # the head is in RAM; the engine's own cache forgets it, so the next request loads it
    prefill(producer, "p0", head + [1])
    producer.engine.reset_prefix_cache()
    req = producer.engine.add_request(
        "p", tokens, 1, kv_transfer_params={"kvtier": {"remote_decode": True, "store": False}}
    )
    run_until_done(producer.engine)
    assert req.num_external_tokens == 4 * BLOCK_SIZE
    assert handoff_of(req.returned_params)["chunks"] == 4


def test_a_request_preempted_after_its_hand_off_came_does_not_wait_for_it_again(tmp_path):
    """Defect: a decode request that had loaded its hand-off, preempted past its deadline and
    asked again while the chunks were being read back into RAM, counted a hand-off timeout (and
    spent its whole waiting budget) although its hand-off had come."""
    clock = FakeClock()
    producer = side(tmp_path, "kv_producer", clock, rules=NO_WRITE_DOWN)
    consumer = side(tmp_path, "kv_consumer", clock, handoff_wait_s=5.0)
    tokens = prompt(PROMPT_TOKENS, seed=70)
    params = prefill(producer, "p", tokens)
    _handed_off(producer)
    req = consumer.engine.add_request("c", tokens, 3, kv_transfer_params=params)
    # it loads every promised chunk, then decodes a token
    while not req.output:
        consumer.engine.step()
        assert consumer.tier.drain(HANG_S)
    assert req.num_external_tokens == PROMISED_CHUNKS * BLOCK_SIZE
    # preempted past its deadline; RAM and the engine's cache forgot the prompt, the disk did not
    consumer.engine.preempt("c")
    consumer.engine.reset_prefix_cache()
    consumer.manager.primary.reset()
    clock.now += 10.0
    run_until_done(consumer.engine)
    assert consumer.stats.handoff_timeouts == 0


def test_a_hand_off_rides_on_a_write_down_in_flight_instead_of_writing_twice(tmp_path):
    clock = FakeClock()
    # the producer's write-down writes every chunk as it becomes READY; its writes are held
    producer = side(tmp_path, "kv_producer", clock, hold=True)
    consumer = side(tmp_path, "kv_consumer", clock)
    tokens = prompt(PROMPT_TOKENS, seed=9)
    params = prefill(producer, "p", tokens)
    assert handoff_of(params)["chunks"] == PROMISED_CHUNKS
    # one write of each chunk waits for the tier: the write-down's (a shared store moved each
    # chunk's bytes twice when the hand-off wrote them again)
    held = [key for job in producer.tier._held for key in job.keys]
    assert sorted(held) == sorted(set(held))
    assert len(held) == PROMISED_CHUNKS
    producer.tier.release()
    req = consumer.engine.add_request("c", tokens, 2, kv_transfer_params=params)
    run_until_done(consumer.engine)
    assert req.num_external_tokens == PROMISED_CHUNKS * BLOCK_SIZE
    assert producer.manager.drain(HANG_S)
    # the results are applied at the manager's next call
    producer.manager.tier_stats()
    counters = producer.manager.tier_stats()[0].counters
    # each chunk was written once, by the write-down; the hand-off rode on it
    assert counters["cascaded_chunks"] == PROMISED_CHUNKS
    assert counters["handoff_chunks"] == PROMISED_CHUNKS
    assert counters["handoff_failures"] == 0
