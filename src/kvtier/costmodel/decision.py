"""The load-or-recompute decision: how much of a found prefix one request loads.

The engine loads a prefix only (vLLM's connector API offers a number of tokens after its own
hits), so the choice is N: the first N found chunks are loaded, the rest recomputed. Given
where each found chunk is — `locations`, in prefix order up to the first chunk no tier holds:
"cpu" for the host RAM tier, else the secondary tier's medium — N minimizes the request's
expected time to first token:

    ttft(N) = wait(N) + copy(N) + recompute(found - N)     (+ what is computed anyway)
    wait(N) = 0 if the head is all in RAM, else the longest of
              - the reads of the head's chunks from each secondary tier (`seconds_for` its bytes
                there: latency + (queued + bytes) / throughput; the tiers read in parallel),
              - one engine step (the request is asked again at the next step at the earliest)
    copy(N) = reading N chunks from the host RAM tier into the engine
    recompute(k) = k chunks' tokens / the engine's prefill tokens per second

Ties go to loading more (what is loaded is not computed, which spares the batch's other
requests too). The figures are a `CostSnapshot`: the online estimates of one engine
(`kvtier.costmodel.estimates`) or the simulator's fixed cost model — the same code decides.

Thread-safety: immutable values and pure functions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.costmodel.estimates import ReadEstimate, read_prior

__all__ = ["DECISIONS", "LOAD_POLICIES", "CostSnapshot", "LoadChoice", "choose_load"]

CPU = "cpu"
LOAD_POLICIES = ("cost", "always")
DECISIONS = ("load", "partial", "recompute")


@dataclass(frozen=True, slots=True)
class CostSnapshot:
    """The figures one decision uses.

    reads: a read estimate per tier medium ("cpu": host RAM into the engine); a tier missing
        here is read at its prior (`kvtier.costmodel.estimates.READ_PRIORS`).
    prefill_tokens_per_s: the engine's prefill speed.
    step_s: one engine step (how long a request asked to wait waits at least).
    """

    reads: Mapping[str, ReadEstimate] = field(default_factory=dict)
    prefill_tokens_per_s: float = 10_000.0
    step_s: float = 0.0

    def read(self, medium: str) -> ReadEstimate:
        return self.reads.get(medium) or read_prior(medium)


@dataclass(frozen=True, slots=True)
class LoadChoice:
    """What one decision chose, and what it expected.

    num_chunks: found chunks to load (a head); num_found: chunks some tier holds.
    tier: the tier the decision is about — for a load, the slowest tier it reads from;
        otherwise the tier of the first chunk left to recompute.
    load_s: expected seconds until the head is in the engine; saved_s: expected prefill
        seconds the head spares.
    """

    num_chunks: int
    num_found: int
    tier: str
    load_s: float = 0.0
    saved_s: float = 0.0

    @property
    def decision(self) -> str:
        """ "load" (all found), "partial" (a head) or "recompute" (none)."""
        if self.num_chunks >= self.num_found:
            return "load"
        return "partial" if self.num_chunks > 0 else "recompute"


def choose_load(
    locations: Sequence[str],
    chunk_bytes: int,
    chunk_tokens: int,
    costs: CostSnapshot,
    policy: str = "cost",
    min_chunks: int = 0,
) -> LoadChoice:
    """How many of the found chunks to load; see the module docstring.

    Args:
        locations: the tier medium of each found chunk, in prefix order.
        chunk_bytes: bytes of one chunk (every KV-cache group, every worker).
        chunk_tokens: tokens of one chunk.
        costs: the figures to decide with.
        policy: "cost" (the smallest expected TTFT) or "always" (every found chunk; the
            expectation is still computed, for the stats).
        min_chunks: the head loads at least this many (<= len(locations)): an exploration of
            RAM (`kvtier.costmodel.exploration`) loads the RAM head its estimate wrote off.
    """
    cpu = costs.read(CPU)
    saving = chunk_tokens / costs.prefill_tokens_per_s
    head_bytes: Counter[str] = Counter()
    best_n, best_delta, best_load = 0, 0.0, 0.0
    load_at = [0.0]
    for n, medium in enumerate(locations, 1):
        if medium != CPU:
            head_bytes[medium] += chunk_bytes
        wait = 0.0
        if head_bytes:
            reads = [costs.read(m).seconds_for(b) for m, b in head_bytes.items()]
            wait = max([costs.step_s] + reads)
        load = wait + cpu.seconds_for(n * chunk_bytes)
        load_at.append(load)
        delta = load - n * saving
        if n == min_chunks or (n > min_chunks and delta <= best_delta):
            best_n, best_delta, best_load = n, delta, load
    if policy == "always":
        best_n, best_load = len(locations), load_at[-1]
    return LoadChoice(
        best_n, len(locations), _tier_of(locations, best_n), best_load, best_n * saving
    )


def _tier_of(locations: Sequence[str], num_chunks: int) -> str:
    if num_chunks < len(locations):
        return locations[num_chunks]
    return next((m for m in reversed(locations) if m != CPU), CPU)
