"""Online miss-ratio curves: what hit ratio a tier would get at other sizes, from its lookups.

Operators size `cpu_bytes`, `disk_bytes` and a Redis `maxmemory` without knowing what more (or
less) would buy. Each tier feeds a `MissRatioCurve` the keys it is asked for, in order, and the
curve answers "the hit ratio at `c` chunks" for any `c` (exported at 0.25x ... 8x of the tier's
capacity, `CAPACITY_FACTORS`).

The estimator is SHARDS (Waldspurger et al., FAST'15), the fixed-size variant: a key is sampled
when its hash is below a threshold; for a sampled key the number of distinct sampled keys used
since its previous use, divided by the sampling rate, estimates its LRU reuse (stack) distance.
The sample set holds at most `max_samples` keys: past that the key with the largest hash leaves
and the threshold drops to it, so memory stays bounded whatever the traffic. A lookup counts
with weight 1/rate at its time (the paper's rescaling), so lookups sampled at a higher rate
early on do not outweigh later ones. Most keys cost one `hash()` (cached on the bytes object)
and one comparison; Python seeds `hash()` per process, so each process samples other keys.

The curve is LRU's: a tier whose policy keeps chunks better than LRU (the CPU tier's default
`adaptive`) gets more hits than predicted, one worse gets fewer.

What counts as a use (see `lookup` and `store`): a lookup counts toward the hit ratio and makes
a cached key the most recent; a store (a chunk written into the tier) caches the key, most
recent, without counting. A key is cached by its store, not by the lookup that missed it: two
requests admitted together ask for a prefix neither has computed yet, and the second cannot hit
(a synthetic replay through the simulator: predicted 0.25 where the tier got 0). A plain cache's
stream (every miss stored) is `lookup` then `store` per reference. A tier's owner counts each
request's lookups once (`kvtier.tiers.tiered.TieredManager.count_query`).

Thread-safety: not thread-safe; a tier's owner calls it from one thread (the scheduler's).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Hashable, Iterable, Sequence

from kvtier.errors import ConfigError

__all__ = ["CAPACITY_FACTORS", "DEFAULT_MAX_SAMPLES", "MissRatioCurve", "curve_gauges"]

CAPACITY_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
# SHARDS' s_max; bench_mrc: error <= 0.012, 1.5 MB
DEFAULT_MAX_SAMPLES = 8192
_HASH_SPACE = 2**64
# hash() is uniform over [-2**63, 2**63): a threshold of 2**63 samples every key
_ALL = 2**63
# a tier of known size starts sampling at the rate that fills the sample at this many times its
# size (bench_mrc-like streams: at 8x, errors at 0.25x the size were 1.5-2x those at rate 1)
_START_FACTOR = 2
# reuse distances below this are counted one bucket per chunk
_EXACT_BUCKETS = 256
# above it, geometric buckets ~2 % wide
_BUCKETS_PER_DOUBLING = 32
# times per block of `_Uses`
_BLOCK = 512
# the time record has room for this many uses per sampled key before it is compacted
_TIME_ROOM = 4


class MissRatioCurve:
    """A SHARDS estimate of the LRU hit ratio of one tier's lookup stream at every size.

    Args:
        max_samples: sampled keys kept at most (bounds memory; more is more accurate).
        capacity_chunks: the tier's size in chunks, if known (0: not). Sampling then starts at the
            rate that fills the sample when the keys in use reach twice that (`_START_FACTOR`),
            instead of at 1: a tier of 32k chunks sampled 59 % of its first 95k lookups and stores
            (issue 37) to reach a rate it could have started at. Once the tier is full, at least
            half the sample is in use; below that, the curve is estimated from fewer samples.
    """

    __slots__ = (
        "_cold",
        "_heap",
        "_histogram",
        "_last",
        "_rate",
        "_threshold",
        "_uses",
        "max_samples",
        "num_lookups",
    )

    def __init__(self, max_samples: int = DEFAULT_MAX_SAMPLES, capacity_chunks: float = 0):
        if max_samples < 1:
            raise ConfigError(f"max_samples must be >= 1, got {max_samples}")
        self.max_samples = max_samples
        # every lookup, sampled or not
        self.num_lookups = 0
        keys_to_fill = _START_FACTOR * capacity_chunks
        # a key is sampled when hash(key) < threshold
        self._threshold = _ALL
        if keys_to_fill > max_samples:
            self._threshold = int(max_samples / keys_to_fill * _HASH_SPACE) - _ALL
        self._rate = (self._threshold + _ALL) / _HASH_SPACE
        # sampled cached key's hash -> time of its last use
        self._last: dict[int, int] = {}
        # -hash of every sampled key: the largest leaves first
        self._heap: list[int] = []
        # the times of the sampled keys' last uses
        self._uses = _Uses(_TIME_ROOM * max_samples)
        # weighted lookups by reuse-distance bucket
        self._histogram: list[float] = []
        # weighted lookups of keys not cached (never stored)
        self._cold = 0.0

    def lookup(self, key: Hashable) -> None:
        """A lookup of `key`: counts toward the hit ratio; a cached key becomes the most recent."""
        self.num_lookups += 1
        h = hash(key)
        if h < self._threshold:
            self._use(h, is_lookup=True)

    def store(self, key: Hashable) -> None:
        """`key` was written into the tier: cached, the most recent, no lookup counted."""
        h = hash(key)
        if h < self._threshold:
            self._use(h, is_lookup=False)

    def lookup_many(self, keys: Iterable[Hashable]) -> None:
        """`lookup` of each key, in order, in one loop (a tier counts a request's whole prompt)."""
        num_keys = 0
        use = self._use
        for key in keys:
            num_keys += 1
            h = hash(key)
            # the threshold drops inside `_use` when the sample is full: read it again each time
            if h < self._threshold:
                use(h, is_lookup=True)
        self.num_lookups += num_keys

    def store_many(self, keys: Iterable[Hashable]) -> None:
        """`store` of each key, in order, in one loop."""
        use = self._use
        for key in keys:
            h = hash(key)
            if h < self._threshold:
                use(h, is_lookup=False)

    def hit_ratio(self, capacity: float) -> float:
        """The predicted LRU hit ratio with room for `capacity` chunks (0.0 before any lookup).

        SHARDS_adj: the sampled lookups' weight should add up to every lookup's; what they miss
        (or exceed) is put at distance 0. The few keys a prefix trace reuses most (the first
        blocks of shared system prompts: 10 keys are 4 % of the conversation trace's lookups) are
        in the sample or not as their hash falls; without this the estimate was 0.03 low there.
        """
        return self.hit_ratios([capacity])[0]

    def hit_ratios(self, capacities: Sequence[float]) -> list[float]:
        """`hit_ratio` of each capacity, in order, from one pass over the histogram (the gauges ask
        for six: a walk per ratio computed 1.3M bucket bounds in a 15 s benchmark run)."""
        num_lookups = self.num_lookups
        ratios = [0.0] * len(capacities)
        if num_lookups == 0:
            return ratios
        histogram = self._histogram
        num_buckets = len(histogram)
        bounds = _bucket_bounds(num_buckets)
        # weight counted in every positive capacity: the lookups the sample missed (SHARDS_adj)
        hits = num_lookups - self._cold - sum(histogram)
        # from the smallest capacity up: the buckets wholly below each are added once
        counted = 0
        for capacity, index in sorted((c, i) for i, c in enumerate(capacities) if c > 0):
            # the bucket `capacity` falls in: bounds[bucket] <= capacity < bounds[bucket + 1]
            bucket = min(bisect.bisect_right(bounds, capacity, 0, num_buckets + 1) - 1, num_buckets)
            hits += sum(histogram[counted:bucket])
            counted = bucket
            partial = 0.0
            if bucket < num_buckets:
                low = bounds[bucket]
                partial = histogram[bucket] * (capacity - low) / (bounds[bucket + 1] - low)
            ratios[index] = min(1.0, max(0.0, (hits + partial) / num_lookups))
        return ratios

    def curve(
        self, capacity: float, factors: Sequence[float] = CAPACITY_FACTORS
    ) -> dict[float, float]:
        """{factor: predicted hit ratio at factor x `capacity` chunks}."""
        ratios = self.hit_ratios([f * capacity for f in factors])
        return dict(zip(factors, ratios, strict=True))

    @property
    def sampling_rate(self) -> float:
        return self._rate

    @property
    def num_samples(self) -> int:
        return len(self._last)

    def _use(self, h: int, is_lookup: bool) -> None:
        uses = self._uses
        if uses.now + 1 >= uses.size:
            uses = self._renumber()
        book = self._last
        last = book.get(h)
        if last is not None:
            if is_lookup:
                self._count(uses.count_after(last) / self._rate)
            book[h] = uses.move(last)
        elif is_lookup:
            # never written (or not since it left the sample): a miss, and not cached
            self._cold += 1.0 / self._rate
        elif len(book) < self.max_samples:
            heapq.heappush(self._heap, -h)
            book[h] = uses.mark_next()
        elif self._make_room(h):
            book[h] = uses.mark_next()
        # else the new key has the largest hash: it is the one that leaves

    def _count(self, distance: float) -> None:
        if distance < _EXACT_BUCKETS:
            bucket = int(distance)
        else:
            bucket = _EXACT_BUCKETS + int(
                math.log2(distance / _EXACT_BUCKETS) * _BUCKETS_PER_DOUBLING
            )
        histogram = self._histogram
        if bucket >= len(histogram):
            histogram.extend([0.0] * (bucket + 1 - len(histogram)))
        histogram[bucket] += 1.0 / self._rate

    def _make_room(self, h: int) -> bool:
        """The sample is full and `h` is new: the largest hash of both leaves and the threshold drops
        to it. Returns whether `h` stays."""
        largest = -heapq.heappushpop(self._heap, -h)
        self._threshold = largest
        self._rate = (largest + _ALL) / _HASH_SPACE
        if largest == h:
            return False
        self._uses.unmark(self._last.pop(largest))
        return True

    def _renumber(self) -> _Uses:
        """The record of times is full: renumber the last uses 1..n in order."""
        order = sorted(self._last, key=self._last.__getitem__)
        self._last = {h: t for t, h in enumerate(order, start=1)}
        self._uses = _Uses(self._uses.size - 1, ones=len(order))
        return self._uses


def curve_gauges(mrc: MissRatioCurve | None, capacity_chunks: float) -> dict[str, float]:
    """The stats gauges of one tier's curve: {"predicted_hit_ratio.<factor>": ratio}; none when
    the tier has no curve, no capacity or no lookups yet."""
    if mrc is None or capacity_chunks <= 0 or mrc.num_lookups == 0:
        return {}
    return {
        f"predicted_hit_ratio.{f:g}": round(r, 4) for f, r in mrc.curve(capacity_chunks).items()
    }


# the bounds of the histogram's buckets so far: bucket b counts distances in [_BOUNDS[b], _BOUNDS[b + 1])
_BOUNDS: list[float] = []


def _bucket_bounds(num_buckets: int) -> list[float]:
    """The bounds of the first `num_buckets` buckets (one more than that many; shared, grown as
    needed): a lookup at distance d (d other keys used since) hits in a cache of more than d
    chunks, so bucket b counts fully once the capacity reaches its high bound `bounds[b + 1]`,
    and in part (spread evenly over the bucket) between its low `bounds[b]` and that."""
    while len(_BOUNDS) <= num_buckets:
        b = len(_BOUNDS)
        if b <= _EXACT_BUCKETS:
            _BOUNDS.append(float(b))
        else:
            _BOUNDS.append(_EXACT_BUCKETS * 2 ** ((b - _EXACT_BUCKETS) / _BUCKETS_PER_DOUBLING))
    return _BOUNDS


class _Uses:
    """Which times 1..size-1 hold a sampled key's last use: a byte per time and a count per block of
    `_BLOCK` times, so the uses after a time cost one C-speed count inside its block and a sum over
    the blocks after it (a Fenwick tree in pure Python took 3x longer per sampled lookup)."""

    __slots__ = ("_blocks", "_used", "now", "size")

    def __init__(self, size: int, ones: int = 0):
        self.size = size + 1
        # the latest time marked
        self.now = ones
        self._used = bytearray(self.size)
        self._used[1 : ones + 1] = b"\x01" * ones
        self._blocks = [0] * (self.size // _BLOCK + 1)
        for block in range(ones // _BLOCK + 1):
            self._blocks[block] = self._used.count(1, block * _BLOCK, (block + 1) * _BLOCK)

    def mark_next(self) -> int:
        """Mark the next time (the caller renumbers before the record is full); returns it."""
        t = self.now + 1
        self.now = t
        self._used[t] = 1
        self._blocks[t // _BLOCK] += 1
        return t

    def move(self, t: int) -> int:
        """`unmark(t)`, then `mark_next()`, in one call (a sampled key used again); returns the time."""
        used = self._used
        blocks = self._blocks
        used[t] = 0
        blocks[t // _BLOCK] -= 1
        now = self.now + 1
        self.now = now
        used[now] = 1
        blocks[now // _BLOCK] += 1
        return now

    def unmark(self, t: int) -> None:
        self._used[t] = 0
        self._blocks[t // _BLOCK] -= 1

    def count_after(self, t: int) -> int:
        """Uses after time t."""
        now = self.now
        block = t // _BLOCK
        last_block = now // _BLOCK
        if block == last_block:
            return self._used.count(1, t + 1, now + 1)
        return self._used.count(1, t + 1, (block + 1) * _BLOCK) + sum(
            self._blocks[block + 1 : last_block + 1]
        )
