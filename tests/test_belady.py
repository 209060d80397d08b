"""Belady's MIN, the sweep's ceiling: checked against an exhaustive search on small streams."""

from __future__ import annotations

import functools
import random

import pytest

from kvtier.errors import ConfigError
from kvtier.sim import TraceRequest, belady_hit_rate, belady_hits
from kvtier.sim.belady import block_stream


def most_hits(stream: list[int], capacity: int) -> int:
    """Every choice at every miss (keep nothing, or evict any one held item): the true optimum."""

    @functools.cache
    def best(t: int, held: frozenset[int]) -> int:
        if t == len(stream):
            return 0
        item = stream[t]
        if item in held:
            return 1 + best(t + 1, held)
        if len(held) < capacity:
            return best(t + 1, held | {item})
        return max([best(t + 1, held)] + [best(t + 1, held - {old} | {item}) for old in held])

    return best(0, frozenset())


def test_min_equals_the_exhaustive_optimum_on_random_small_streams():
    rng = random.Random(12)
    for _ in range(400):
        stream = [rng.randrange(rng.randint(1, 6)) for _ in range(rng.randint(0, 13))]
        capacity = rng.randint(0, 4)
        assert belady_hits(stream, capacity) == most_hits(stream, capacity), (stream, capacity)


def test_min_drops_the_item_needed_last():
    # capacity 2: c arrives with a (next use 3) and b (next use 5) held: b goes → a and c hit, b misses
    assert belady_hits(["a", "b", "c", "a", "c", "b"], 2) == 2
    # with room for all three every repeat hits; with none, nothing does
    assert belady_hits(["a", "b", "c", "a", "c", "b"], 3) == 3
    assert belady_hits(["a", "a"], 0) == 0


def test_a_negative_capacity_is_refused():
    with pytest.raises(ConfigError):
        belady_hits([1], -1)


def test_the_trace_stream_is_the_servable_blocks_and_the_rate_is_in_trace_tokens():
    trace = [TraceRequest(0, 1100, 1, (1, 2, 3)), TraceRequest(1, 1600, 1, (1, 2, 4, 5))]
    # request 1: blocks 1,2 (3 is partial); request 2: 1,2,4 (5 is partial)
    assert block_stream(trace) == [1, 2, 1, 2, 4]
    # room for 2: the second request hits blocks 1 and 2 → 1024 of 2700 prompt tokens
    assert belady_hit_rate(trace, 2) == pytest.approx(1024 / 2700)
    assert belady_hit_rate(trace, 1) == pytest.approx(512 / 2700)
