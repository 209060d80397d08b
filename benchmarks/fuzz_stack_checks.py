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
  jobs from before it).

When the stack is quiet — every request ended, faults off, the tiers drained
(`check_quiet`):
- nothing is left behind: no request, no job, no pin, no PENDING or RETIRED slot, no
  promotion budget, no tier job;
- the counters add up: the loads the scheduler planned are the loads the worker ran;
- the disk tier's index equals its directory (`DiskTier.check`);
- every key the Redis tier calls present is in the store (`RemoteTier.check`; skipped when
  the server was restarted empty, which drops values legitimately).

Each failed check raises `Violation`, naming it.
"""

from __future__ import annotations

from fuzz_stack_build import Stack
from kvtier.errors import InvariantError

__all__ = ["Violation", "check_quiet", "check_step"]


class Violation(AssertionError):
    """An invariant of the stack does not hold."""


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise Violation(what)


def check_step(stack: Stack, remote_kept_values: bool = True) -> None:
    """The invariants that hold after every engine step (`remote_kept_values`: the Redis server was
    never restarted empty)."""
    try:
        stack.manager.check()
    except InvariantError as exc:
        raise Violation(f"CPU tier: {exc}") from exc
    try:
        stack.engine.check_blocks()  # the fake engine's own books (a broken double would hide bugs)
    except AssertionError as exc:
        raise Violation(f"fake engine: {exc}") from exc
    stats = stack.scheduler.stats
    _require(stats.load_prepare_failures == 0, "a hit found by a scan was gone when its load was prepared")
    if stack.remote is not None and remote_kept_values:
        missing = stack.remote.stats().counters["load_missing"]
        _require(missing == 0, f"{missing} Redis load(s) of a key the tier called present found no value")


def check_quiet(stack: Stack, remote_kept_values: bool) -> None:
    """The invariants that hold once every request ended and the tiers are drained."""
    sched, engine = stack.scheduler, stack.engine
    _require(not (engine.waiting or engine.running or engine.parked), "requests still in the engine")
    _require(sched.num_requests() == 0, f"{sched.num_requests()} request states left in the scheduler")
    _require(not sched.has_jobs_in_flight(), "transfer jobs left in flight")
    cpu = stack.manager.stats()
    _require(cpu.pinned_slots == 0, f"{cpu.pinned_slots} slots still pinned")
    _require(cpu.pending_slots == 0, f"{cpu.pending_slots} slots still PENDING")
    _require(cpu.extra.get("retired_slots", 0) == 0, "retired slots never freed")
    _require(cpu.extra.get("promoting_bytes", 0) == 0, "promotion budget not given back")
    _require(cpu.extra.get("tier_jobs_in_flight", 0) == 0, "tier jobs left in flight")
    loads = stack.engine.transfer.loads
    _require(sched.stats.load_jobs == len(loads), f"{sched.stats.load_jobs} loads planned, {len(loads)} ran")
    _require(sched.stats.loaded_chunks == sum(job.num_chunks for job in loads), "loaded chunks do not add up")
    try:
        if stack.disk is not None:
            stack.disk.check()
        if stack.remote is not None and remote_kept_values and not stack.remote.breaker.is_open:
            _check_remote(stack.remote)
    except InvariantError as exc:
        raise Violation(str(exc)) from exc


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
