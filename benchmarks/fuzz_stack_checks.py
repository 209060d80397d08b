"""What the stack fuzzer checks: after every step, and whenever the stack is quiet.

After every step (`check_step`):
- the fake engine's block pool agrees with the blocks its requests hold;
- the fake engine itself checked the KV of every block a token attended to (a wrong byte
  anywhere — a wrong load, a missing fence, a stale completion, a torn copy, a chunk stored
  under another's key — raised `ContentMismatch` during the step);
- the CPU tier's invariants (`CPUTierManager.check`: slots, states, pins, counters);
- a hit the scan found is still there when its load is prepared (`load_prepare_failures`):
  between a request's lookup and its allocation only its own lookups run, so nothing may
  evict what it found (issue 20, defect 3);
- a key the Redis tier calls present has a value (`load_missing` stays 0 while the server
  keeps its values: nothing else in the walk deletes them; a reset's sweep waits for the
  jobs from before it); the same for the S3 tier, whose server always keeps them;
- no remote value read back failed its checks (`corrupt` stays 0: the fuzzer never damages a
  value, so a bad one is bytes uploaded from rows that held another chunk by then);
- no tenant holds more chunks in the CPU tier than its quota, counting each chunk for the tenant
  whose request computed it (`fuzz_stack_owners`), not as the tier charged it;
- every chunk only keepers used ranks as they asked (retained, at their priority), and no store
  evicted a keeper's chunk while a chunk of the same tenant that nobody hinted could have gone;
- once the tiers were drained, no tenant holds more disk files than its disk quota.

When the stack is quiet — every request ended, faults off, the tiers drained
(`check_quiet`):
- nothing is left behind: no request, no job, no pin, no PENDING or RETIRED slot, no
  promotion budget, no tier job;
- the counters add up: the loads the scheduler planned are the loads the worker ran;
- the disk tier's index equals its directory (`DiskTier.check`);
- every key the Redis tier calls present is in the store (`RemoteTier.check`; skipped when
  the server was restarted empty, which drops values legitimately); the same for S3.

After the quiet end, once the stack's tiers are closed (an S3 store's close waits for its
requests), `check_closed` reads each remote tier's namespace back with a fresh store: every
value holds its own key's bytes, and none written before the last reset is left.

Each failed check raises `Violation`, naming it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fuzz_stack_build import Stack
from fuzz_stack_owners import Owners
from fuzz_stack_remote import check_values
from kvtier.errors import InvariantError
from kvtier.tiers.remote.store import RemoteStore

if TYPE_CHECKING:
    from fuzz_stack_driver import Driver

__all__ = ["Violation", "check_closed", "check_quiet", "check_step"]


class Violation(AssertionError):
    """An invariant of the stack does not hold."""


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise Violation(what)


def check_step(stack: Stack, driver: Driver) -> None:
    """The invariants that hold after every action of `driver`."""
    remote_kept_values = driver.remote_kept_values
    try:
        stack.manager.check()
    except InvariantError as exc:
        raise Violation(f"CPU tier: {exc}") from exc
    try:
        # the fake engine's own books (a broken double would hide bugs)
        stack.engine.check_blocks()
    except AssertionError as exc:
        raise Violation(f"fake engine: {exc}") from exc
    stats = stack.scheduler.stats
    _require(
        stats.load_prepare_failures == 0,
        "a hit found by a scan was gone when its load was prepared",
    )
    for tier in stack.remote_tiers:
        counters = tier.stats().counters
        if tier is stack.s3 or remote_kept_values:
            missing = counters["load_missing"]
            _require(
                missing == 0,
                f"{missing} {tier.medium} load(s) of a key the tier called present found no value",
            )
        corrupt = counters["corrupt"]
        _require(
            corrupt == 0,
            f"{corrupt} {tier.medium} value(s) read back failed their checks (no fault damages one)",
        )
    driver.owners.update()
    _check_tenants(stack, driver.owners)
    if driver.evictions is not None:
        _check_keepers(stack, driver)
    if driver.is_settled and stack.disk is not None and stack.config.disk_quotas:
        _check_disk_tenants(stack, driver.owners)


def _limit(quotas: tuple[tuple[str, int], ...], tenant: str) -> int | None:
    by_tenant = dict(quotas)
    return by_tenant.get(tenant, by_tenant.get("*"))


def _check_tenants(stack: Stack, owners: Owners) -> None:
    """No tenant holds more READY chunks in the CPU tier than its quota, by which tenant computed them."""
    if not stack.config.quotas:
        return
    held = Counter(owners.tenant(key) for key in stack.primary.ready_keys())
    for tenant, num_held in held.items():
        limit = None if tenant is None else _limit(stack.config.quotas, tenant)
        _require(
            limit is None or num_held <= limit,
            f"tenant {tenant!r} holds {num_held} chunks in RAM, its quota is {limit} "
            f"(the tier charges {stack.primary._quotas.held(tenant)} to it)",
        )


def _check_disk_tenants(stack: Stack, owners: Owners) -> None:
    """No tenant holds more files in the disk tier than its disk quota (the tiers are drained)."""
    held = Counter(
        owners.tenant(bytes.fromhex(path.stem)) for path in Path(stack.disk.directory).rglob("*.kv")
    )
    for tenant, num_held in held.items():
        limit = None if tenant is None else _limit(stack.config.disk_quotas, tenant)
        _require(
            limit is None or num_held <= limit,
            f"tenant {tenant!r} holds {num_held} disk files, its quota is {limit}",
        )


def _check_keepers(stack: Stack, driver: Driver) -> None:
    """Keepers' chunks rank as they asked, and go after every unhinted chunk of their tenant."""
    owners = driver.owners
    primary = stack.primary
    now = stack.clock.now
    for key in primary.ready_keys():
        priority = owners.keeper_priority(key)
        if priority is not None:
            rank = primary.retention.rank(key, now)
            _require(
                rank == (2, priority),
                f"a keeper's chunk ({owners.tenant(key)!r}) ranks {rank}, "
                f"its requests asked to retain it at priority {priority}",
            )
    for evicted, spared in driver.evictions.take():
        for key in evicted:
            if owners.keeper_priority(key) is None:
                continue
            tenant = owners.tenant(key)
            plain = [k for k in spared if owners.tenant(k) == tenant and owners.is_plain(k)]
            _require(
                not plain,
                f"a store evicted a keeper's chunk of {tenant!r} while {len(plain)} unhinted "
                "chunk(s) of that tenant could have gone",
            )


def check_quiet(stack: Stack, driver: Driver) -> None:
    """The invariants that hold once every request ended and the tiers are drained."""
    remote_kept_values = driver.remote_kept_values
    sched = stack.scheduler
    engine = stack.engine
    _require(
        not (engine.waiting or engine.running or engine.parked), "requests still in the engine"
    )
    _require(
        sched.num_requests() == 0, f"{sched.num_requests()} request states left in the scheduler"
    )
    _require(not sched.has_jobs_in_flight(), "transfer jobs left in flight")
    cpu = stack.manager.stats()
    _require(cpu.pinned_slots == 0, f"{cpu.pinned_slots} slots still pinned")
    _require(cpu.pending_slots == 0, f"{cpu.pending_slots} slots still PENDING")
    _require(cpu.extra.get("retired_slots", 0) == 0, "retired slots never freed")
    _require(cpu.extra.get("promoting_bytes", 0) == 0, "promotion budget not given back")
    _require(cpu.extra.get("tier_jobs_in_flight", 0) == 0, "tier jobs left in flight")
    loads = stack.engine.transfer.loads
    _require(
        sched.stats.load_jobs == len(loads),
        f"{sched.stats.load_jobs} loads planned, {len(loads)} ran",
    )
    _require(
        sched.stats.loaded_chunks == sum(job.num_chunks for job in loads),
        "loaded chunks do not add up",
    )
    try:
        if stack.disk is not None:
            stack.disk.check()
        if stack.remote is not None and remote_kept_values and not stack.remote.breaker.is_open:
            _check_remote(stack.remote)
        if stack.s3 is not None and not stack.s3.breaker.is_open:
            _check_remote(stack.s3)
    except InvariantError as exc:
        raise Violation(str(exc)) from exc
    if stack.disk is not None and stack.config.disk_quotas:
        _check_disk_tenants(stack, driver.owners)


def check_closed(stack: Stack, fresh_store: Callable[[str], RemoteStore]) -> None:
    """Once the stack's tiers are closed: each remote tier's values, read back with a fresh store
    (`fresh_store(medium)`), hold their own keys' bytes, and none written before the last reset
    is left (not checked after a request timed out: the server may apply it after the client
    gave up, a case `kvtier.tiers.remote.reset` names)."""
    for tier in stack.remote_tiers:
        watch = stack.watches[tier.medium]
        has_timed_out = tier.stats().counters["timeouts"] > 0
        store = fresh_store(tier.medium)
        try:
            problems = check_values(
                store, tier.codec, None if has_timed_out else watch.names_by_epoch, watch.epoch
            )
            # the servers outlive the configuration: what it left would pile up over a long run
            store.delete(list(store.list_names(tier.codec.name_prefix)))
        finally:
            store.close()
        _require(
            not problems,
            f"{tier.medium} values after the end: {len(problems)} wrong: {'; '.join(problems[:3])}",
        )


def _check_remote(remote, tries: int = 3) -> None:
    """`remote.check()`, asked again when its request timed out: the fuzzed store's 300 ms is
    one stall of a loaded machine, not a defect (a phantom raises InvariantError every time)."""
    for attempt in range(tries):
        try:
            return remote.check()
        except InvariantError:
            raise
        except Exception as exc:
            if attempt == tries - 1 or not remote.store.is_timeout(exc):
                raise
