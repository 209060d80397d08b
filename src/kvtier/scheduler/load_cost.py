"""The scheduler's load-or-recompute decisions (`kvtier.costmodel`), per request.

Before a request's hit scan, `limit` asks the manager where each chunk after the engine's own
hits is (`locate`: no byte moves, no promotion starts), and decides with `choose_load` how many
to load: the scan then looks no further, so no promotion starts for a chunk the request will
recompute. A request whose chunks a tier is still checking is asked again (the same bounded
wait as the scan's); once its wait is spent, it decides on what is known. The decision is kept
while the request is asked again (its promotions run), and dropped at the answer, a preemption
or a reset: the next question (its tokens grew, a chunk moved) decides afresh.

The figures: the tiered manager's read estimates (`read_estimates`), the host RAM tier's
from the workers' load results (bytes and copy seconds), and the engine's prefill speed from
the steps the scheduler plans (`PrefillRate`) — or a fixed `CostSnapshot` (the simulator's
cost model). Each decision is counted (`SchedulerStats.load_decisions`), and each load that
ends adds its expected and measured seconds: from the decision to the load's start (its
promotions), plus the workers' copy (the longest a worker reported; not the forward pass of a
sync load's step).

A decision that writes off a tier — its head stops before a chunk found there — still tries it
when that tier's estimate is stale (`kvtier.costmodel.exploration`; issue 32: estimates fed only
by the jobs they allow locked a tier out for good after one slow spell): a secondary tier reads
that chunk in the background (`manager.explore`: the request still recomputes it), RAM is tried
by this decision loading its RAM head anyway. Explorations are counted per tier
(`SchedulerStats.explorations`); a simulation's fixed figures are never explored.

Thread-safety: the scheduler's (one thread).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvtier.base import NOT_KNOWN_YET, OffloadingManager
from kvtier.costmodel.decision import CPU, CostSnapshot, LoadChoice, choose_load
from kvtier.costmodel.estimates import PrefillRate, TransferRate, read_prior
from kvtier.costmodel.exploration import Exploration
from kvtier.jobs import JobResult
from kvtier.scheduler.config import GroupKind, SchedulerOffloadConfig
from kvtier.scheduler.lookup import may_defer
from kvtier.scheduler.state import DecidedLoad, RequestOffloadState
from kvtier.scheduler.stats import SchedulerStats
from kvtier.scheduler.types import StepView

__all__ = ["LoadCosts"]

# RAM unmeasured for this long (no load copied since) is weighed at its prior by one decision at a
# time (an exploration): a RAM copy is never as slow as a dead link, so the bet costs one request's
# copy at worst, per exploration interval
_RAM_FORGET_S = 30.0


@dataclass(slots=True)
class _LoadTiming:
    """What the workers reported of one load job so far."""

    # summed over the workers
    num_bytes: int = 0
    # the longest copy
    seconds: float = 0.0
    num_reports: int = 0


class LoadCosts:
    """How much of each request's found prefix to load; see the module docstring.

    Args:
        config: `load_policy` and `chunk_bytes` are read from it.
        manager: asked where chunks are and what its tiers cost.
        stats: where decisions and load times are counted.
        fixed: decide with these figures instead of measuring (the simulator).
    """

    def __init__(
        self,
        config: SchedulerOffloadConfig,
        manager: OffloadingManager,
        stats: SchedulerStats,
        fixed: CostSnapshot | None = None,
    ):
        self.config = config
        self.manager = manager
        self.stats = stats
        self.fixed = fixed
        self.prefill = PrefillRate(
            min_tokens=max(128, 2 * config.tokens_per_chunk), lag=config.steps_planned_ahead
        )
        self.cpu = TransferRate(read_prior(CPU))
        # load job id -> what its workers reported so far
        self._loads: dict[int, _LoadTiming] = {}
        self._ram_exploration = Exploration()
        # nothing to weigh with (chunk size unknown, or no full-attention group): load what the scan finds
        self._decides = bool(config.chunk_bytes) and any(
            g.kind is GroupKind.FULL for g in config.groups
        )

    def snapshot(self) -> CostSnapshot:
        """The figures a decision made now would use."""
        if self.fixed is not None:
            return self.fixed
        reads = {**self.manager.read_estimates(), CPU: self.cpu.estimate()}
        return CostSnapshot(reads, self.prefill.tokens_per_s(), self.prefill.step_seconds())

    # -- what the scheduler sees -------------------------------------------------------

    def step_planned(self, step: StepView, now: float) -> None:
        batch = step.scheduled
        self.prefill.step_started(now, sum(batch.num_scheduled_tokens), frozenset(batch.req_ids))

    def worker_results(self, results: Iterable[tuple[JobResult, bool]], now: float) -> None:
        """Load results (`(result, is_load)`): the host RAM tier's bytes and copy seconds.

        One load is one sample once every worker reported it (a worker's report may come a step
        after another's): its workers copied their shares side by side, so the sample is the
        bytes they moved together over the longest copy (issue 32: placed end to end, N workers'
        loads read N times slower than they ran, and a decision charges every worker's bytes). The
        loads completed in one call ran one after another (a worker copies one batch after
        another): their samples are placed end to end, ending now."""
        completed: list[_LoadTiming] = []
        for result, is_load in results:
            if not is_load:
                continue
            timing = self._loads.setdefault(result.job_id, _LoadTiming())
            timing.num_bytes += result.num_bytes
            timing.seconds = max(timing.seconds, result.seconds)
            timing.num_reports += 1
            if timing.num_reports == self.config.num_workers and timing.num_bytes > 0:
                completed.append(timing)
        start = now - sum(t.seconds for t in completed)
        for timing in completed:
            self.cpu.add(timing.num_bytes, start, timing.seconds)
            start += timing.seconds

    def load_started(
        self, state: RequestOffloadState, decided: DecidedLoad | None, now: float
    ) -> None:
        """The request's load job (`state.load_job_id`) goes to the workers."""
        state.timed_load = None if decided is None else (decided, now - decided.decided_at)
        if state.load_job_id is not None:
            self._loads.setdefault(state.load_job_id, _LoadTiming())

    def loaded(self, state: RequestOffloadState, job_id: int) -> None:
        """The request's load ended: its decision's expected seconds against the measured ones."""
        timing = self._loads.pop(job_id, None)
        # a simulation's loads take its clock's time, not the real copies'
        copy_s = timing.seconds if timing is not None and self.fixed is None else 0.0
        timed = state.timed_load
        state.timed_load = None
        if timed is not None and timed[0].choice.num_chunks > 0:
            self.stats.expected_load_us += int(timed[0].choice.load_s * 1e6)
            self.stats.measured_load_us += int((timed[1] + copy_s) * 1e6)
            self.stats.timed_loads += 1

    # -- the decision ------------------------------------------------------------------

    def scan_end(self, state: RequestOffloadState, start: int, end: int, now: float) -> int | None:
        """The chunk the request's scan stops at (<= `end`); None: ask again next step (a tier is
        still checking, and the request's waiting budget allows it: `may_defer` spends it)."""
        limit = self.limit(state, start, end, now, final=False)
        if limit is None and not may_defer(state, self.config, now, self.stats):
            limit = self.limit(state, start, end, now, final=True)
        return limit

    def limit(
        self, state: RequestOffloadState, start: int, end: int, now: float, final: bool
    ) -> int | None:
        """The chunk the request's scan stops at (<= `end`), or None while a tier still checks
        whether it holds one of them (`final`: decide on what is known, never None)."""
        decided = state.decided_load
        if decided is not None and decided.start_chunk == start:
            return min(end, start + decided.choice.num_chunks)
        if not self._decides:
            return end
        locations = self._locate(state, start, end)
        if NOT_KNOWN_YET in locations:
            if not final:
                return None
            locations = locations[: locations.index(NOT_KNOWN_YET)]
        if not locations:
            return start
        costs = self.snapshot()
        choice = choose_load(
            locations,
            self.config.chunk_bytes,
            self.config.tokens_per_chunk,
            costs,
            self.config.load_policy,
        )
        if choice.num_chunks < len(locations) and self.fixed is None:
            choice = self._explore(state, start, locations, choice, costs, now)
        state.decided_load = DecidedLoad(start, choice, now)
        self.stats.count_decision(choice.decision, choice.tier)
        return start + choice.num_chunks

    def _explore(
        self,
        state: RequestOffloadState,
        start: int,
        locations: list[str],
        choice: LoadChoice,
        costs: CostSnapshot,
        now: float,
    ) -> LoadChoice:
        """`choice` wrote off the tier of the chunk its head stops before: try that tier if its
        estimate is stale (see the module docstring). Returns the choice to keep."""
        # Only loads measure RAM, and a read from every tier ends in a RAM copy: RAM written off
        # while every prefix is behind it (on disk, Redis, S3: none in RAM to try it with) kept
        # every tier out (the stack fuzzer). Unmeasured that long, one decision at a time weighs
        # RAM at its prior, and loads if that says so.
        if now - self.cpu.last_ended_at > _RAM_FORGET_S and self._may_explore_ram(now):
            at_prior = replace(costs, reads={**costs.reads, CPU: self.cpu.prior})
            bet = choose_load(
                locations,
                self.config.chunk_bytes,
                self.config.tokens_per_chunk,
                at_prior,
                self.config.load_policy,
            )
            if bet.num_chunks > choice.num_chunks:
                self._ram_exploration.started(now)
                self.stats.explorations[CPU] += 1
                return bet
        tier = locations[choice.num_chunks]
        if tier == CPU:
            if not self._may_explore_ram(now):
                return choice
            self._ram_exploration.started(now)
            ram_end = choice.num_chunks
            while ram_end < len(locations) and locations[ram_end] == CPU:
                ram_end += 1
            choice = choose_load(
                locations,
                self.config.chunk_bytes,
                self.config.tokens_per_chunk,
                costs,
                self.config.load_policy,
                min_chunks=ram_end,
            )
        else:
            chunk = start + choice.num_chunks
            keys = [
                state.keys(gs.group, chunk, chunk + 1)[0]
                for gs in state.group_states
                if gs.spec.kind is GroupKind.FULL
            ]
            if not self.manager.explore(tier, keys, state.req_context):
                return choice
        self.stats.explorations[tier] += 1
        return choice

    def _may_explore_ram(self, now: float) -> bool:
        """RAM is measured by loads only: not while one is in flight (it will measure it), nor
        sooner than the exploration rules allow."""
        in_flight = any(t.num_reports < self.config.num_workers for t in self._loads.values())
        return not in_flight and self._ram_exploration.is_due(self.cpu, now)

    def _locate(self, state: RequestOffloadState, start: int, end: int) -> list[str]:
        """Per chunk from `start`: the slowest tier any full-attention group's key is in, up to
        the first chunk some group misses. (A sliding-window group's chunks are not weighed:
        the scan only loads those inside its window, at most what the full groups load.)"""
        per_group = [
            self.manager.locate(state.keys(gs.group, start, end), state.req_context)
            for gs in state.group_states
            if gs.spec.kind is GroupKind.FULL
        ]
        if len(per_group) == 1:
            # one group: its own media up to its first miss (`_slowest` of one medium is itself;
            # a long prompt's lookup walks thousands of chunks here)
            located = per_group[0]
            end_index = located.index(None) if None in located else len(located)
            return located[:end_index]  # type: ignore[return-value]
        found: list[str] = []
        for media in zip(*per_group, strict=True):
            if None in media:
                break
            found.append(_slowest(media))
        return found


def _slowest(media: tuple[str | None, ...]) -> str:
    if NOT_KNOWN_YET in media:
        return NOT_KNOWN_YET
    return next((m for m in media if m != CPU), CPU)  # type: ignore[return-value]
