"""Lazy (evict-time) stores belong to the request that computed the chunks: its tenant's quota, its
hints (issue 32, defects 1 and 3).

In `store_mode="lazy"` a chunk is stored when the engine is about to evict its blocks, often after
the request that computed it ended. The store must still count for that request's tenant (quotas
in the CPU and disk tiers) and carry its hints (retain_s, priority, next_turn_s, session,
end_session; a shared store's TTL), exactly as the same chunk stored at once ("eager") would:
each scenario runs both modes, eager being the reference. The fake engine drives the real
scheduler, tiers and worker. Block size 4 tokens, chunks of one block: a 17-token prompt is 4 chunks.
"""

from __future__ import annotations

import random

import pytest

from helpers import HANG_S
from kvtier.base import ChunkState, ReqContext
from kvtier.keys import OffloadKey, make_offload_key
from kvtier.policies.retention import ORDINARY
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import FakeEngine, KVCache
from kvtier.sim.fake_engine import make_slab
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.tiered import TieredManager
from sched_helpers import UNBOUNDED_DEFERRALS, FakeClock, close_after_test, prompt, run_until_done

BLOCK = 4
# the engine's own cache: two prompts' worth
NUM_BLOCKS = 8
# 4 whole chunks
PROMPT_TOKENS = 4 * BLOCK + 1
MODES = ("eager", "lazy")
KEEP = {"kvtier": {"retain_s": 3600, "priority": 5}}


def make_engine(
    manager,
    mode: str,
    *,
    slab=None,
    max_tokens_per_step: int = 64,
    evict_lookahead: int | None = NUM_BLOCKS,
    clock: FakeClock | None = None,
) -> FakeEngine:
    """The fake engine over `manager`; with a lookahead of the whole engine cache, a lazy store
    mode stores a request's chunks in the step after it ended."""
    clock = clock or FakeClock()
    config = SchedulerOffloadConfig(
        groups=(GroupSpec(tokens_per_block=BLOCK),),
        store_mode=mode,
        max_defer_s=60.0,
        max_deferrals=UNBOUNDED_DEFERRALS,
    )
    engine = FakeEngine(
        OffloadScheduler(config, manager, clock=clock),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        max_tokens_per_step=max_tokens_per_step,
        clock=clock,
        slab=slab,
        evict_lookahead=evict_lookahead,
    )
    return close_after_test(engine)


def serve(
    engine: FakeEngine, req_id: str, seed: int, tenant: str | None = None, params=None
) -> None:
    engine.add_request(
        req_id, prompt(PROMPT_TOKENS, seed=seed), cache_salt=tenant, kv_transfer_params=params
    )
    run_until_done(engine)


def run_pending_stores(engine: FakeEngine) -> None:
    """Run the steps of a request that stores nothing: a lazy store mode stores the chunks the
    engine is about to evict in the step after it learned of them, so the last request's stores
    run in these steps."""
    engine.add_request(
        f"flush-{len(engine.requests)}",
        prompt(PROMPT_TOKENS, seed=999),
        max_new_tokens=1,
        kv_transfer_params={"kvtier": {"store": False}},
    )
    run_until_done(engine)


def chunk_keys(engine: FakeEngine, req_id: str) -> list[OffloadKey]:
    """The keys of the whole chunks of `req_id`'s prompt (the engine hashed them with its tenant's salt)."""
    req = engine.requests[req_id]
    return [make_offload_key(h, 0) for h in req.block_hashes[: len(req.prompt) // BLOCK]]


def num_readable(primary: CPUTierManager, engine: FakeEngine, req_id: str) -> int:
    return sum(primary.is_readable(k) for k in chunk_keys(engine, req_id))


def held_per_tenant(primary: CPUTierManager, engine: FakeEngine) -> dict[str, int]:
    """How many chunks each tenant holds in RAM, by which tenant's request computed them."""
    tenant_of = {
        k: req.cache_salt or ""
        for rid, req in engine.requests.items()
        for k in chunk_keys(engine, rid)
    }
    held: dict[str, int] = {}
    for key in primary.ready_keys():
        held[tenant_of[key]] = held.get(tenant_of[key], 0) + 1
    return held


def check_lazy_path_ran(engine: FakeEngine, mode: str) -> None:
    """In lazy mode, what the test saw was stored at eviction time (not at the request's end)."""
    stats = engine.scheduler.stats
    assert (stats.lazy_offered_chunks > 0) == (mode == "lazy")


# -- defect 1: quotas -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_tenants_burst_evicts_only_its_own_chunks_in_either_store_mode(mode):
    """Issue 32, defect 1: with lazy stores charged to no tenant, every tenant shared the "*"
    quota and A's burst evicted all of B's chunks."""
    primary = CPUTierManager(8, policy="lru", tenant_quotas={"*": 4})
    engine = make_engine(primary, mode)
    # tenant B stores its 4 chunks
    serve(engine, "b", seed=1, tenant="B")
    # tenant A's burst: 6 new prefixes, 24 chunks through the 8-slot tier; A may hold 4 of them
    for i in range(6):
        serve(engine, f"a{i}", seed=10 + i, tenant="A")
    run_pending_stores(engine)
    # A replaced its own chunks, never B's: both hold their quota
    assert held_per_tenant(primary, engine) == {"A": 4, "B": 4}
    assert num_readable(primary, engine, "b") == 4
    check_lazy_path_ran(engine, mode)
    primary.check()


@pytest.mark.parametrize("mode", MODES)
def test_a_tenant_at_its_disk_quota_replaces_its_own_files_in_either_store_mode(mode, tmp_path):
    """Issue 32, defect 1 in the disk tier: a file's tenant is the one its RAM store noted; a lazy
    store noted none, so every tenant shared the disk's "*" quota too."""
    from kvtier.base import LookupResult
    from kvtier.tiers.disk.format import ChunkFormat
    from kvtier.tiers.disk.tier import DiskTier

    slab = make_slab(KVCache(1, NUM_BLOCKS, BLOCK), 1, 8)
    # a header block and the aligned payload
    file_bytes = ChunkFormat(b"", slab.rows.shape[1]).file_bytes
    namespace = Namespace(
        "sim-disk-quotas", "float32", "sim", BLOCK, 1, "sha256", 1, slab.rows.shape[1]
    )
    disk = DiskTier(tmp_path, namespace, 8 * file_bytes, tenant_quotas={"*": 4 * file_bytes})
    assert disk.wait_scanned(HANG_S)
    manager = TieredManager(
        CPUTierManager(8, policy="lru"), [slab.rows], [(disk, TierRules())], job_timeout_s=HANG_S
    )
    # closed after the engine (last given, first closed): its tier threads stop
    close_after_test(manager)
    engine = make_engine(manager, mode, slab=slab)
    # tenant B's 4 chunks are written through to disk
    serve(engine, "b", seed=1, tenant="B")
    for i in range(6):
        # tenant A's burst: 24 chunks pass through RAM and disk (8 files); A may hold 4 files
        serve(engine, f"a{i}", seed=10 + i, tenant="A")
        assert disk.drain(HANG_S)
    run_pending_stores(engine)
    assert disk.drain(HANG_S)
    on_disk = [disk.lookup(k) is LookupResult.HIT for k in chunk_keys(engine, "b")]
    assert on_disk == [True] * 4
    check_lazy_path_ran(engine, mode)


# -- defect 3: hints ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_hinted_requests_chunks_outlive_unhinted_traffic_in_either_store_mode(mode):
    """Issue 32, defect 3: lazy stores carried no hints, so a request's `retain_s` and `priority`
    left ordinary chunks, which 6 unhinted requests then evicted."""
    primary = CPUTierManager(8, policy="lru")
    engine = make_engine(primary, mode)
    # a request asks to keep its 4 chunks for an hour, at priority 5
    serve(engine, "h", seed=1, params=KEEP)
    # 6 unhinted requests (24 chunks) pass through the 8-slot tier: they evict only one another
    for i in range(6):
        serve(engine, f"u{i}", seed=10 + i)
    run_pending_stores(engine)
    assert num_readable(primary, engine, "h") == 4
    assert {primary.retention.rank(k, 0.0) for k in chunk_keys(engine, "h")} == {(2, 5)}
    check_lazy_path_ran(engine, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "hints,rank",
    [
        # retained, at its priority
        ({"retain_s": 3600, "priority": 5}, (2, 5)),
        # expected: the session's next turn comes within a minute
        ({"next_turn_s": 60}, (1, 0)),
        # a batch job's: goes before ordinary chunks
        ({"priority": -3}, (0, -3)),
        ({"session": "s", "retain_s": 60}, (2, 0)),
        (
            {"session": "s", "end_session": True},
            (-1, 0),
            # its session ended (before they were stored, lazily)
        ),
        # a request without a session ends what it alone used
        ({"end_session": True}, (-1, 0)),
    ],
)
def test_a_chunk_stored_lazily_ranks_as_its_requests_hints_say(mode, hints, rank):
    clock = FakeClock(now=100.0)
    primary = CPUTierManager(16, policy="lru")
    engine = make_engine(primary, mode, clock=clock)
    serve(engine, "h", seed=1, params={"kvtier": hints})
    # the next request's steps run the lazy stores of h's chunks (the engine is about to evict them)
    serve(engine, "u", seed=2)
    assert num_readable(primary, engine, "h") == 4
    assert [primary.retention.rank(k, clock.now) for k in chunk_keys(engine, "h")] == [rank] * 4
    assert [primary.retention.rank(k, clock.now) for k in chunk_keys(engine, "u")] == [ORDINARY] * 4
    check_lazy_path_ran(engine, mode)


def test_a_lazily_stored_sessions_chunks_go_first_once_the_session_ended():
    """The session's last turn ended before its chunks were stored: they still go before older,
    ordinary chunks (its end is applied when they are stored)."""
    primary = CPUTierManager(8, policy="lru")
    engine = make_engine(primary, "lazy")
    serve(engine, "old", seed=1)
    serve(engine, "last-turn", seed=2, params={"kvtier": {"session": "s", "end_session": True}})
    serve(engine, "u0", seed=3)
    # the 8 slots hold old's and last-turn's chunks; u0's 4 need room: the ended session's go, although
    # the older ordinary ones were used before them
    run_pending_stores(engine)
    assert [num_readable(primary, engine, r) for r in ("old", "last-turn", "u0")] == [4, 0, 4]


def test_a_lazily_stored_chunk_lives_in_redis_as_long_as_its_request_asked(fresh_redis):
    """Issue 32, defect 3: a shared store's TTL comes from the hints the retention book keeps for a
    chunk; a lazy store noted none, so a `retain_s` of 10 minutes got the store's 30 s."""
    from kvtier.tiers.remote.redis import RedisStore
    from kvtier.tiers.remote.tier import RemoteTier

    slab = make_slab(KVCache(1, NUM_BLOCKS, BLOCK), 1, 8)
    namespace = Namespace(
        "sim-redis-ttl", "float32", "sim", BLOCK, 1, "sha256", 1, slab.rows.shape[1]
    )
    redis_tier = RemoteTier(RedisStore(fresh_redis.url, ttl_s=30), namespace)
    manager = TieredManager(
        CPUTierManager(8, policy="lru"),
        [slab.rows],
        [(redis_tier, TierRules())],
        job_timeout_s=HANG_S,
    )
    close_after_test(manager)
    engine = make_engine(manager, "lazy", slab=slab)
    serve(engine, "h", seed=1, params={"kvtier": {"retain_s": 600}})
    # its steps run h's lazy stores, written through to Redis
    serve(engine, "u", seed=2)
    assert redis_tier.drain(HANG_S)
    raw = fresh_redis.client()
    ttl_ms = [raw.pttl(redis_tier.codec.name(k)) for k in chunk_keys(engine, "h")]
    assert all(ttl > 30_000 for ttl in ttl_ms), ttl_ms
    check_lazy_path_ran(engine, "lazy")


# -- the owner of a lazy store ----------------------------------------------------------------------


def test_kvtiers_own_context_acts_for_a_request_only_when_it_says_so():
    """A write-down's pins are kvtier's own use; a lazy store's is its request's."""
    assert ReqContext("r").user_id == "r"
    assert ReqContext("\x00kvtier:cascade").user_id is None
    assert ReqContext("\x00kvtier:evictions:3:r", on_behalf_of="r").user_id == "r"
    with pytest.raises(Exception, match="on_behalf_of"):
        # an engine request acts for itself only
        ReqContext("r", on_behalf_of="q")


def test_lazy_owners_end_with_their_stores():
    """Each step's lazy stores have one owner per request they store for; every owner ends (and
    releases what it held in the tier) once its store is reported."""
    primary = CPUTierManager(16, policy="lru")
    engine = make_engine(primary, "lazy")
    # two tenants' 2-chunk prompts (3 blocks each) run side by side and end in the same step
    engine.add_request("a", prompt(2 * BLOCK + 1, seed=1), cache_salt="A")
    engine.add_request("b", prompt(2 * BLOCK + 1, seed=2), cache_salt="B")
    run_until_done(engine)
    assert engine.num_steps == 1
    # the next steps store both requests' chunks, each under an owner of its own
    run_pending_stores(engine)
    assert engine.scheduler.stats.lazy_offered_chunks == 4
    assert held_per_tenant(primary, engine) == {"A": 2, "B": 2}
    assert not engine.scheduler.has_jobs_in_flight()
    assert not [rid for rid in engine.scheduler._requests if rid.startswith("\x00")]
    assert primary.stats().pinned_slots == 0
    primary.check()


# -- random traffic: several tenants, quotas and hints, checked at every step ------------------------


class _WatchedTier(CPUTierManager):
    """The real CPU tier; each store records what it evicted and which chunks it could have evicted
    instead (READY, unpinned, not the store's own), to check the order after the step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.evictions: list[tuple[list[OffloadKey], set[OffloadKey]]] = []

    def prepare_store(self, keys, ctx):
        own = set(keys)
        evictable = {
            k
            for k, c in self._chunks.items()
            if c.state is ChunkState.READY and c.pins == 0 and k not in own
        }
        out = super().prepare_store(keys, ctx)
        if out is not None and out.evicted_keys:
            self.evictions.append((list(out.evicted_keys), evictable - set(out.evicted_keys)))
        return out


# tenant "c" and requests without a tenant get "*"
_QUOTAS = {"a": 3, "b": 5, "*": 4}
_TENANTS = ("a", "b", "c", None)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_tenants_and_hints_keep_quotas_and_ranks_at_every_step(mode, seed):
    """Tenants with quotas, some requests hinted (retain_s, a priority of their prompt's), in random
    order and overlap. After every engine step: no tenant holds more chunks in RAM than its quota;
    every chunk held ranks as its request asked (a hinted one above every unhinted one); and a store
    evicted a hinted chunk only when its tenant had no unhinted chunk left to evict."""
    rng = random.Random(seed)
    clock = FakeClock(now=100.0)
    primary = _WatchedTier(12, policy="lru", tenant_quotas=_QUOTAS)
    engine = make_engine(primary, mode, clock=clock, max_tokens_per_step=24, evict_lookahead=None)
    # each tenant's prompts: 2 hinted (2-3 chunks, each with its own priority), 4 unhinted (1-4 chunks)
    prompts: dict[tuple[str | None, int], tuple[list[int], int | None]] = {}
    for t, tenant in enumerate(_TENANTS):
        for p in range(6):
            priority = rng.randint(0, 9) if p < 2 else None
            num_chunks = rng.randint(2, 3) if p < 2 else rng.randint(1, 4)
            prompts[(tenant, p)] = (prompt(num_chunks * BLOCK + 1, seed=100 * t + p + 1), priority)
    # what each chunk's requests asked for
    rank_of: dict[OffloadKey, tuple[int, int]] = {}
    tenant_of: dict[OffloadKey, str] = {}
    for n in range(60):
        for _ in range(rng.randint(1, 2)):
            tenant = rng.choice(_TENANTS)
            tokens, priority = prompts[(tenant, rng.randrange(6))]
            params = (
                None if priority is None else {"kvtier": {"retain_s": 3600, "priority": priority}}
            )
            req_id = f"r{n}-{len(engine.requests)}"
            engine.add_request(req_id, tokens, cache_salt=tenant, kv_transfer_params=params)
            for key in chunk_keys(engine, req_id):
                rank_of[key] = ORDINARY if priority is None else (2, priority)
                tenant_of[key] = tenant or ""
        for _ in range(rng.randint(1, 3)):
            _step_and_check(engine, primary, clock, rank_of, tenant_of)
    while engine.waiting or engine.running:
        _step_and_check(engine, primary, clock, rank_of, tenant_of)
    check_lazy_path_ran(engine, mode)
    assert engine.scheduler.stats.failed_store_chunks == 0


def _step_and_check(
    engine: FakeEngine,
    primary: _WatchedTier,
    clock: FakeClock,
    rank_of: dict[OffloadKey, tuple[int, int]],
    tenant_of: dict[OffloadKey, str],
) -> None:
    engine.step()
    clock.now += 1.0
    primary.check()
    held = primary.ready_keys()
    for tenant in {tenant_of[k] for k in held}:
        num_held = sum(tenant_of[k] == tenant for k in held)
        assert num_held <= _QUOTAS.get(
            tenant, _QUOTAS["*"]
        ), f"tenant {tenant!r} holds {num_held} chunks"
    ranks = {k: primary.retention.rank(k, clock.now) for k in held}
    wrong = {k.hex()[:8]: (ranks[k], rank_of[k]) for k in held if ranks[k] != rank_of[k]}
    assert (
        not wrong
    ), f"(rank, asked for) of chunks ranked otherwise than their requests asked: {wrong}"
    for evicted, spared in primary.evictions:
        for key in evicted:
            if rank_of[key] != ORDINARY:
                kept = [
                    k for k in spared if rank_of[k] == ORDINARY and tenant_of[k] == tenant_of[key]
                ]
                assert (
                    not kept
                ), f"a hinted chunk of {tenant_of[key]!r} was evicted before {len(kept)} unhinted"
    primary.evictions.clear()


def test_a_lazy_store_retried_at_the_next_step_is_still_one_offer():
    # store_threshold 2: a chunk is stored once two requests offered it. A lazy store is made under a
    # new internal id each step; one request's chunk offered at two steps is still its one offer.
    m = CPUTierManager(4, policy="lru", store_threshold=2)
    k = make_offload_key(b"\x07" * 32, 0)
    for step in (1, 2):
        ctx = ReqContext(f"\x00kvtier:evictions:{step}:A", on_behalf_of="A")
        assert m.prepare_store([k], ctx).keys_to_store == []
    # another request's offer is the second one: stored
    assert m.prepare_store([k], ReqContext("B")).keys_to_store == [k]


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_preempted_last_turn_keeps_its_chunks_until_it_ends(mode):
    # review of issue 32's defect 3: a lazy store's owner ends right after its store; a request still
    # running (preempted, waiting to resume) had its session ended there, and the chunks it needs to
    # resume ranked "drop first" while it waited
    clock = FakeClock(now=100.0)
    primary = CPUTierManager(16, policy="lru")
    config = SchedulerOffloadConfig(
        groups=(GroupSpec(tokens_per_block=BLOCK),),
        store_mode=mode,
        max_defer_s=60.0,
        max_deferrals=1_000_000,
    )
    engine = close_after_test(
        FakeEngine(
            OffloadScheduler(config, primary, clock=clock),
            num_blocks=8,
            block_size=BLOCK,
            max_tokens_per_step=64,
            clock=clock,
            evict_lookahead=8,
        )
    )
    req = engine.add_request(
        "last-turn",
        prompt(4 * BLOCK + 1, seed=1),
        max_new_tokens=4,
        kv_transfer_params={"kvtier": {"session": "s", "end_session": True}},
    )
    engine.step()
    engine.step()
    # preempted: its blocks are cached and evictable; it is kept out of the queue for two steps, in
    # which lazy mode stores its chunks on its behalf
    engine.preempt("last-turn")
    engine.waiting.remove(req)
    engine.step()
    engine.step()
    engine.waiting.insert(0, req)
    keys = [make_offload_key(h, 0) for h in req.block_hashes[:4]]
    assert all(primary.is_readable(k) for k in keys) and not req.is_finished
    assert [primary.retention.rank(k, clock()) for k in keys] == [ORDINARY] * 4
    # it resumes and ends: its session is over, its chunks go first
    run_until_done(engine)
    assert [primary.retention.rank(k, clock())[0] for k in keys] == [-1] * 4
