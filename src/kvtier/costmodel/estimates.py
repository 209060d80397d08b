"""Online estimates for the load-or-recompute decision: how fast each tier reads, and how fast
the engine prefills, as measured while it runs.

- **A tier's transfers** (`TransferRate`): from the jobs it completed — bytes, when each was
  submitted, how long it took — over its recent jobs: those that ended within `_SPAN_S` of the
  newest one (at least the newest `_MIN_SAMPLES`, at most `window`). Throughput is bytes over
  *busy* time (the union of the jobs' [submitted, ended] intervals), so concurrent jobs are not
  mistaken for slow ones; latency is the least any job took beyond its bytes at that
  throughput (what a job waited behind the others is queueing, counted at decision time). A
  job's share of busy time is capped at `_STALL_FACTOR` times the window's median job time:
  one stalled job (a network hiccup, a job given up on) lowers the estimate for a while, it
  does not make the tier look dead for the next `window` jobs. A tier that is
  slow on every job moves the median itself, so the cap follows it.
  Estimates age with the tier's own activity, not with time alone: a slow spell leaves the
  estimate once `_MIN_SAMPLES` newer jobs ended more than `_SPAN_S` after it (issue 32: a window
  of 32 jobs kept three reads given up on for good), while a tier nobody used since keeps its
  last figure — time passing says nothing about its speed, and forgetting it would make the next
  request bet its TTFT on a prior. What measures a written-off tier again is exploration
  (`kvtier.costmodel.exploration`).
- **The engine's prefill** (`PrefillRate`): tokens per second of the engine's steps, from the
  time between two consecutive steps of a busy engine and the tokens the first one computed:
  the median over prefill-sized steps of their tokens over their time less a step's fixed part
  (measured on the small, decode steps, so it does not make recomputing look slower than it is). A step counts
  only when the next one continued one of its requests (an engine that idled in between says
  nothing about its speed).
- **Priors**: until a tier or the engine has been measured, its read prior (what that kind of
  tier usually does, declared by its descriptor: `kvtier.tiers.secondary.TierDescriptor`) and
  `PRIOR_PREFILL_TOKENS_PER_S` stand in. The prefill prior is on the side
  of recomputing: an accelerator's prefill (an engine on CPU is 5-10x slower, and measures so
  within its first prefill steps). A tier measures itself soon too: its write-through stores
  are transfers, and a read estimate falls back on them (`kvtier.tiers.rates`).

Nothing here blocks or does I/O: the numbers come from what the scheduler and the tiered
manager already observe. Thread-safety: not thread-safe; one owner calls it from one thread.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, replace
from itertools import pairwise
from types import MappingProxyType
from typing import NamedTuple

from kvtier.errors import ConfigError

__all__ = [
    "PRIOR_PREFILL_TOKENS_PER_S",
    "READ_PRIORS",
    "PrefillRate",
    "ReadEstimate",
    "TransferRate",
    "declare_read_prior",
    "read_prior",
]

# a job counts at most this many median job times of busy time
_STALL_FACTOR = 4.0
# fewer measured jobs or steps than this: the prior still stands
_MIN_SAMPLES = 3
# an engine that serves mostly hits computes few prefill-sized steps
_MIN_PREFILL_STEPS = 2
# jobs that ended this long before a tier's newest one no longer count once _MIN_SAMPLES newer ones
# did: long enough to cover several jobs of a busy tier, short enough that three explorations of a
# recovered tier (one a second at most, `kvtier.costmodel.exploration`) outweigh a slow spell
_SPAN_S = 2.0


@dataclass(frozen=True, slots=True)
class ReadEstimate:
    """What reading from one tier is expected to cost now.

    bytes_per_s: sustained throughput; latency_s: what a job takes beyond its bytes;
    queued_bytes: reads already waiting ahead of a new one; num_samples: measured jobs behind
    the figures (0: a prior).
    """

    bytes_per_s: float
    latency_s: float
    queued_bytes: int = 0
    num_samples: int = 0

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0 or self.latency_s < 0 or self.queued_bytes < 0:
            raise ConfigError(
                f"a read estimate needs a positive throughput and no negative time: {self}"
            )

    def seconds_for(self, num_bytes: int) -> float:
        """Expected seconds until `num_bytes` more are read, behind what is queued."""
        return self.latency_s + (self.queued_bytes + num_bytes) / self.bytes_per_s


# Each registered tier's read prior, by tier name, as its descriptor declares it: the tiers are a
# layer above this one, so their registry (`kvtier.tiers.registry`) declares each prior here.
_READ_PRIORS: dict[str, ReadEstimate] = {}
# the same, read-only, for whoever wants to see them all
READ_PRIORS = MappingProxyType(_READ_PRIORS)
# an accelerator's prefill (Llama-3-8B on one GPU); recomputing is assumed fast
PRIOR_PREFILL_TOKENS_PER_S = 10_000.0


def declare_read_prior(tier: str, prior: ReadEstimate) -> None:
    """Tier `tier` reads at `prior` until measured (called by the tier registry only)."""
    _READ_PRIORS[tier] = prior


def read_prior(tier: str) -> ReadEstimate:
    """The read prior of the tier named `tier` (a tier's `medium`).

    Raises:
        ConfigError: no tier of that name is registered (`kvtier.tiers.registry`).
    """
    prior = _READ_PRIORS.get(tier)
    if prior is None:
        raise ConfigError(
            f"no tier named {tier!r} is registered, so it has no read prior; registered: "
            f"{sorted(_READ_PRIORS)} (a tier registers with kvtier.tiers.register_tier)"
        )
    return prior


class _Job(NamedTuple):
    """One measured job of a `TransferRate`."""

    num_bytes: int
    # its share of the tier's busy time (capped, see the module docstring)
    busy_s: float
    # how long it took
    seconds: float
    # when it ended, on the owner's clock: its age counts from there
    ended_at: float


class _PlannedStep(NamedTuple):
    """One engine step a `PrefillRate` saw planned."""

    at: float
    num_tokens: int
    req_ids: frozenset[str]


class TransferRate:
    """Throughput and latency of one tier in one direction, from its recent jobs.

    Args:
        prior: the estimate until `_MIN_SAMPLES` jobs were measured.
        window: how many recent jobs the estimate covers at most.
    """

    def __init__(self, prior: ReadEstimate, window: int = 32):
        if window < _MIN_SAMPLES:
            raise ConfigError(f"a transfer window needs at least {_MIN_SAMPLES} jobs, got {window}")
        self.prior = prior
        self._jobs: deque[_Job] = deque(maxlen=window)
        self._busy_until = float("-inf")
        # cached until the next job
        self._estimate: ReadEstimate | None = None

    @property
    def num_samples(self) -> int:
        return len(self._jobs)

    @property
    def last_ended_at(self) -> float:
        """When the newest job ended (-inf: none measured yet)."""
        return self._jobs[-1].ended_at if self._jobs else -math.inf

    @property
    def last_seconds(self) -> float:
        """How long the newest job took (0: none measured yet)."""
        return self._jobs[-1].seconds if self._jobs else 0.0

    def add(
        self, num_bytes: int, submitted_at: float, seconds: float, ended_at: float | None = None
    ) -> None:
        """A job of `num_bytes` submitted at `submitted_at` (monotonic) ended after `seconds`.

        `ended_at`: when its end was seen, on the clock the owner ages its estimates with (default
        `submitted_at + seconds`: the same clock)."""
        seconds = max(seconds, 0.0)
        ended = submitted_at + seconds
        busy = max(0.0, ended - max(submitted_at, self._busy_until))
        self._busy_until = max(self._busy_until, ended)
        if len(self._jobs) >= _MIN_SAMPLES:
            busy = min(busy, _STALL_FACTOR * statistics.median(j.seconds for j in self._jobs))
        seen_at = ended if ended_at is None else ended_at
        self._jobs.append(_Job(max(num_bytes, 0), busy, seconds, seen_at))
        self._estimate = None

    def estimate(self, queued_bytes: int = 0) -> ReadEstimate:
        """The current estimate, with `queued_bytes` waiting ahead of a new job."""
        if self._estimate is None:
            self._estimate = self._measure()
        if not queued_bytes:
            return self._estimate
        return replace(self._estimate, queued_bytes=max(queued_bytes, 0))

    def _recent(self) -> list[_Job]:
        """The jobs the estimate covers: those that ended within `_SPAN_S` of the newest one, and at
        least the newest `_MIN_SAMPLES`."""
        jobs = list(self._jobs)
        newest = jobs[-1].ended_at
        recent = [j for j in jobs if newest - j.ended_at <= _SPAN_S]
        return recent if len(recent) >= _MIN_SAMPLES else jobs[-_MIN_SAMPLES:]

    def _measure(self) -> ReadEstimate:
        if len(self._jobs) < _MIN_SAMPLES:
            return self.prior
        jobs = self._recent()
        num_bytes = sum(j.num_bytes for j in jobs)
        busy = sum(j.busy_s for j in jobs)
        if num_bytes <= 0 or busy <= 0:
            return self.prior
        rate = num_bytes / busy
        # the least a job took beyond its bytes: jobs submitted together also waited for each other,
        # which a decision counts separately (`queued_bytes`); seven promotions submitted at once
        # read a 6 ms latency as 34 ms through their median
        latency = min(max(0.0, j.seconds - j.num_bytes / rate) for j in jobs)
        return ReadEstimate(rate, latency, num_samples=len(jobs))


class PrefillRate:
    """The engine's prefill speed in tokens per second, from its step timings.

    A step's time is a fixed part (scheduling, sampling, the decode tokens of the batch) and a
    part per computed token. The fixed part is the median of the small steps (fewer than
    `min_tokens` tokens: decode steps); the speed is the prefill-sized steps' tokens over their
    time less that fixed part (never less than half of it: a noisy median must not make
    prefill look free).

    An engine that plans ahead (vLLM's async scheduling keeps two steps in flight: step k+1 is
    planned before step k ran, step k+2 once it has) runs step k between the planning of step
    k + `lag` and of step k + `lag` + 1; pairing a step's tokens with the wrong interval made a
    10,000 tokens/s engine look 100x faster.

    Args:
        prior_tokens_per_s: the estimate until `_MIN_PREFILL_STEPS` prefill steps were measured.
        min_tokens: a step computing at least this many tokens is a prefill step.
        window: how many recent steps of each kind the estimate covers.
        lag: steps planned ahead of the one running (0: none; 1: vLLM's async scheduling).
    """

    def __init__(
        self,
        prior_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S,
        min_tokens: int = 256,
        window: int = 32,
        lag: int = 0,
    ):
        if not prior_tokens_per_s > 0 or min_tokens < 1 or window < _MIN_SAMPLES or lag < 0:
            raise ConfigError("the prefill prior, min_tokens and window must be positive, lag >= 0")
        self.prior_tokens_per_s = prior_tokens_per_s
        self.min_tokens = min_tokens
        # (tokens, seconds) of prefill-sized steps
        self._prefills: deque[tuple[int, float]] = deque(maxlen=window)
        # seconds of steps under min_tokens
        self._smalls: deque[float] = deque(maxlen=window)
        # every step measured
        self._durations: deque[float] = deque(maxlen=window)
        self._planned: deque[_PlannedStep] = deque(maxlen=lag + 2)

    @property
    def num_samples(self) -> int:
        return len(self._prefills)

    def step_started(self, now: float, num_tokens: int, req_ids: frozenset[str]) -> None:
        """An engine step computing `num_tokens` for `req_ids` was planned at `now` (monotonic).
        The step planned `lag` + 1 steps ago ran from the previous planning until now, if the
        engine stayed busy (each step continued a request of the one before)."""
        planned = self._planned
        planned.append(_PlannedStep(now, num_tokens, req_ids))
        if len(planned) < planned.maxlen:
            return
        steps = list(planned)
        seconds = now - steps[-2].at
        if seconds <= 0 or any(a.req_ids.isdisjoint(b.req_ids) for a, b in pairwise(steps)):
            return
        self._durations.append(seconds)
        ran = steps[0]
        if ran.num_tokens >= self.min_tokens:
            self._prefills.append((ran.num_tokens, seconds))
        else:
            self._smalls.append(seconds)

    def tokens_per_s(self) -> float:
        if len(self._prefills) < _MIN_PREFILL_STEPS:
            return self.prior_tokens_per_s
        fixed = statistics.median(self._smalls) if len(self._smalls) >= _MIN_SAMPLES else 0.0
        # the median step's speed: an engine's first forward pass is cold (8-11 s here whatever its
        # size), and a sum over the window would carry it for the next 32 prefill steps
        return statistics.median(t / max(s - fixed, s / 2) for t, s in self._prefills)

    def step_seconds(self) -> float:
        """The median step of a busy engine (0 until measured): how long a request asked to wait
        (its chunks are being read up from a tier) waits at least before it is asked again."""
        return statistics.median(self._durations) if len(self._durations) >= _MIN_SAMPLES else 0.0
