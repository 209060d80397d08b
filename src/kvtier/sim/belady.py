"""Belady's MIN: the most hits any cache of a given size could get on a block stream.

MIN (Belady, 1966) knows the future: on a miss with the cache full it drops the block
whose next use is farthest away — or does not keep the new block when that one is
needed last. No policy gets more hits on the same stream at the same capacity (with or
without prefetching), so it is the ceiling a sweep plots kvtier's policies against.

The stream is every request's prompt blocks a cache could serve (`hittable_blocks`), head
first, requests in trace order. In a prefix trace, block i+1 is only ever used right after
block i of the same request, so MIN never keeps a block without its prefix: its block hits
are prefix hits, the same measure as the simulator's.

    hits = belady_hits(stream, capacity)                      # any hashable items
    rate = belady_hit_rate(requests, capacity)                 # a trace, in trace tokens

O(n log n) over the stream's n accesses (a heap with lazy deletion): the 288,500-block
conversation trace takes about a second.

Thread-safety: pure functions.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from kvtier.errors import ConfigError
from kvtier.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest
from kvtier.sim.workload import hittable_blocks

__all__ = ["belady_hit_rate", "belady_hits", "block_stream"]


def block_stream(
    requests: Sequence[TraceRequest], trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[int]:
    """Every request's servable prompt blocks, head first, in trace order."""
    return [h for req in requests for h in hittable_blocks(req, trace_block_tokens)]


def belady_hits(stream: Sequence[Hashable], capacity: int) -> int:
    """Hits of Belady's MIN on `stream` with room for `capacity` items."""
    if capacity < 0:
        raise ConfigError(f"capacity must be >= 0, got {capacity}")
    next_use = _next_uses(stream)
    # item -> its next use
    cached: dict[Hashable, int] = {}
    # (-next use, time of that use's previous access): stale when moved
    heap: list[tuple[int, int]] = []
    # time of an access -> its item (heap entries name items by it)
    at: dict[int, Hashable] = {}
    hits = 0
    for t, item in enumerate(stream):
        nxt = next_use[t]
        if item in cached:
            hits += 1
        elif len(cached) >= capacity:
            while heap and cached.get(at.get(heap[0][1], _GONE)) != -heap[0][0]:
                # stale: its item was used again since
                at.pop(heapq.heappop(heap)[1], None)
            if not heap or -heap[0][0] <= nxt:
                # the new item is needed last: MIN does not keep it
                continue
            del cached[at.pop(heapq.heappop(heap)[1])]
        cached[item] = nxt
        at[t] = item
        heapq.heappush(heap, (-nxt, t))
    return hits


def belady_hit_rate(
    requests: Sequence[TraceRequest], capacity: int, trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> float:
    """MIN's hits on the trace's block stream, as a share of its prompt tokens."""
    prompt_tokens = sum(req.input_length for req in requests)
    hits = belady_hits(block_stream(requests, trace_block_tokens), capacity)
    return hits * trace_block_tokens / prompt_tokens if prompt_tokens else 0.0


_GONE = object()


def _next_uses(stream: Sequence[Hashable]) -> list[int]:
    """For each access, the time of the next access to the same item (never: past the end,
    later accesses farther, so ties among never-again items do not matter)."""
    never = len(stream)
    seen: dict[Hashable, int] = {}
    out = [0] * len(stream)
    for t in range(len(stream) - 1, -1, -1):
        out[t] = seen.get(stream[t], never)
        seen[stream[t]] = t
    return out
