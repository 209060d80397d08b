"""The fake engine's block pool: free blocks, reference counts and its own prefix cache.

Like vLLM's: full, computed blocks enter the prefix cache (keyed by block hash, one block
per KV-cache group) as soon as they exist; a block whose last reference goes stays cached
until it is evicted (least recently used first) to satisfy an allocation, or dropped by
`reset_prefix_cache`. Freed blocks are handed out again at once, lowest id first.

With `reserve_null`, block 0 is the null block, as vLLM's: never handed out, never cached;
a request's positions outside a sliding window point at it instead of a block of their own
(see `FakeEngine`). Nothing may ever write it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

__all__ = ["BlockPool"]


class BlockPool:
    """`num_blocks` block ids shared by `num_groups` KV-cache groups."""

    def __init__(self, num_blocks: int, num_groups: int, reserve_null: bool = False):
        self.num_groups = num_groups
        self.null_block = 0 if reserve_null else None
        first = 1 if reserve_null else 0
        # pop() hands out low ids first
        self.free_blocks = list(range(num_blocks - 1, first - 1, -1))
        self.refs = [0] * num_blocks
        # hash -> block per group (LRU order)
        self.cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        # every block id in `cache`
        self._cached_blocks: set[int] = set()
        # blocks handed out so far, per group
        self.num_allocations = 0

    def cached_prefix(self, block_hashes: Sequence[bytes]) -> list[tuple[int, ...]]:
        """Blocks (one per group) of the longest cached prefix of `block_hashes`."""
        hits = []
        for h in block_hashes:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hits.append(self.cache[h])
        return hits

    def allocate(self, n: int) -> list[list[int]] | None:
        """`n` referenced blocks for every group, or None (and nothing taken)."""
        new = [self._take(n) for _ in range(self.num_groups)]
        if any(blocks is None for blocks in new):
            for blocks in new:
                self.free_blocks.extend(blocks or [])
            return None
        for blocks in new:
            self.reference(blocks)
        self.num_allocations += n
        return new  # type: ignore[return-value]

    def reference(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def cache_blocks(
        self, block_hashes: Sequence[bytes], block_ids: Sequence[Sequence[int]], num_full: int
    ) -> None:
        """Enter the first `num_full` computed blocks (per group ids) into the prefix cache."""
        cache = self.cache
        cached_blocks = self._cached_blocks
        null = self.null_block
        for block_hash, blocks in zip(
            block_hashes[:num_full], zip(*block_ids, strict=True), strict=False
        ):
            if null in blocks:
                # outside a window: no KV there to cache
                continue
            entry = cache.setdefault(block_hash, blocks)
            if entry is blocks:
                cached_blocks.update(blocks)

    def release(self, block_ids: Sequence[Sequence[int]]) -> None:
        """Unreference a request's blocks; cached ones stay cached, the rest are freed."""
        cached = self._cached_blocks
        null = self.null_block
        for ids in block_ids:
            for b in ids:
                if b == null:
                    continue
                self.refs[b] -= 1
                if self.refs[b] == 0 and b not in cached:
                    self.free_blocks.append(b)

    def release_now(self, blocks: Sequence[int]) -> None:
        """Unreference `blocks` and make them free at once, out of the prefix cache (with the other
        groups' blocks of their entries): a window group's blocks as vLLM frees them once they
        leave the window — at the tail of its free queue, where an allocation in the same step
        may take them (its per-group cache is not modelled here; this is the worst case)."""
        doomed = set(blocks) - {self.null_block}
        for block_hash, entry in [(h, e) for h, e in self.cache.items() if doomed.intersection(e)]:
            del self.cache[block_hash]
            self._cached_blocks.difference_update(entry)
            self.free_blocks.extend(b for b in entry if self.refs[b] == 0 and b not in doomed)
        for b in doomed:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_blocks.append(b)

    def check(self, held: Sequence[int]) -> None:
        """Cross-check the pool against `held`, every block id the engine's requests hold (for tests).

        Raises:
            AssertionError: a free block is held or listed twice, a count of references is off,
                or the null block was handed out.
        """
        free = self.free_blocks
        null = self.null_block
        counts = Counter(b for b in held if b != null)
        if len(set(free)) != len(free) or any(counts[b] for b in free):
            raise AssertionError("block pool: a free block is listed twice or held by a request")
        if any(self.refs[b] != counts[b] for b in range(len(self.refs))) or null in free:
            raise AssertionError("block pool: reference counts differ from what requests hold")

    def evictable(self, num_allocations: int) -> list[int]:
        """Cached blocks the next `num_allocations` block allocations (per group) would evict,
        first to go first (uncached free blocks are handed out before any cached one)."""
        at_risk = num_allocations - len(self.free_blocks) // self.num_groups
        found: list[int] = []
        if at_risk <= 0:
            return found
        for _, blocks in self._eviction_order():
            found.extend(blocks)
            at_risk -= 1
            if at_risk <= 0:
                break
        return found

    def reset_prefix_cache(self) -> None:
        """Drop every unused cached block (vLLM's reset_prefix_cache(reset_connector=False))."""
        refs = self.refs
        # an entry with a free block goes whole: its block is free now
        for blocks in self.cache.values():
            self.free_blocks.extend(b for b in blocks if refs[b] == 0)
        self.cache = OrderedDict(
            (h, bs) for h, bs in self.cache.items() if all(refs[b] for b in bs)
        )
        self._cached_blocks = {b for bs in self.cache.values() for b in bs}

    def _eviction_order(self):
        """(hash, blocks) of the cached entries no request holds, least recently used first."""
        refs = self.refs
        return ((h, bs) for h, bs in self.cache.items() if not any(refs[b] for b in bs))

    def _take(self, n: int) -> list[int] | None:
        while len(self.free_blocks) < n:
            victim = next((h for h, _ in self._eviction_order()), None)
            if victim is None:
                return None
            blocks = self.cache.pop(victim)
            self._cached_blocks.difference_update(blocks)
            self.free_blocks.extend(blocks)
        return [self.free_blocks.pop() for _ in range(n)]
