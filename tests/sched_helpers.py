"""Builders for the scheduler scenario tests."""

from __future__ import annotations

import time
from dataclasses import dataclass

from helpers import HANG_S
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import FakeEngine
from kvtier.tiers.cpu.manager import CPUTierManager


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


# A deferral budget no correct run spends, for engines beside a real tier: a request waits for a
# promotion or a probe as long as it takes, and `run_until_done`'s HANG_S is the ceiling. (A count of
# 1,000,000 steps passed in ~17 s on 2 busy cores, and in less on a faster machine: a bound on the
# machine's speed, not a hang.)
UNBOUNDED_DEFERRALS = 10**9


def run_until_done(engine: FakeEngine, timeout_s: float = HANG_S) -> None:
    """Step `engine` until every request finished. With a real tier beside it (a disk read takes
    milliseconds of real time, a fake step microseconds) a count of steps is no bound: 10,000 of
    them (`FakeEngine.run`'s) pass in ~1 s, which one stall of a loaded machine outlasts."""
    deadline = time.monotonic() + timeout_s
    while engine.waiting or engine.running or engine.parked:
        assert (
            time.monotonic() < deadline
        ), f"requests still unfinished after {timeout_s} s of steps"
        engine.step()


def make_engine(
    *,
    block_size: int = 4,
    blocks_per_chunk: int = 1,
    num_slots: int = 64,
    num_blocks: int = 64,
    groups: tuple[GroupSpec, ...] | None = None,
    max_tokens_per_step: int = 64,
    clock: FakeClock | None = None,
    policy: str = "lru",
    evict_lookahead: int | None = None,
    **config,
) -> FakeEngine:
    groups = groups or (GroupSpec(tokens_per_block=block_size, blocks_per_chunk=blocks_per_chunk),)
    clock = clock or FakeClock()
    sched = OffloadScheduler(
        SchedulerOffloadConfig(groups=groups, **config),
        CPUTierManager(num_slots, policy=policy),
        clock=clock,
    )
    engine = FakeEngine(
        sched,
        num_blocks=num_blocks,
        block_size=block_size,
        max_tokens_per_step=max_tokens_per_step,
        clock=clock,
        evict_lookahead=evict_lookahead,
    )
    return close_after_test(engine)


_to_close: list = []


def close_after_test(thing):
    """Have the conftest close `thing` (a fake engine, a worker) when the test ends: their copy threads stop."""
    _to_close.append(thing)
    return thing


def close_engines() -> None:
    """Stop the copy threads of everything `close_after_test` was given (conftest calls it)."""
    while _to_close:
        thing = _to_close.pop()
        (thing.close if hasattr(thing, "close") else thing.shutdown)()


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(n)]
