"""The fake engine's "model" and its blocks: what a forward pass computes and checks, the
sampled token, vLLM's recompute rule, and how a request's blocks grow, leave a sliding window,
enter the prefix cache and are freed.

Every block computed gets a value derived from the block's hash; before computing a token
the model checks that every block the token attends to holds the right value, so a wrong
load, a missing fence or a stale completion shows up as `ContentMismatch`.

`FakeModel` is a part of `kvtier.sim.fake_engine.FakeEngine` (a mixin): it shares the
engine's block pool, KV cache, groups and requests, so it is not a class of its own.
"""

from __future__ import annotations

from kvtier.keys import BlockHasher
from kvtier.scheduler.config import GroupKind, GroupSpec
from kvtier.sim.block_pool import BlockPool
from kvtier.sim.kv_cache import KVCache
from kvtier.sim.request import SimRequest

__all__ = ["FakeModel"]


class FakeModel:
    """The model and block side of `FakeEngine`; see the module docstring."""

    # the engine's state this part reads and changes (set by FakeEngine.__init__)
    block_size: int
    groups: tuple[GroupSpec, ...]
    check_content: bool
    hasher: BlockHasher
    kv: KVCache
    pool: BlockPool  # (and FakeEngine.preempt, when a request's blocks cannot grow)

    # -- the "model" ------------------------------------------------------------------

    def _forward(self, req: SimRequest, n: int) -> bool:
        """Compute `n` tokens of `req` after checking every block they attend to; True when
        the request then has all its output tokens."""
        start, end = req.num_computed, req.num_computed + n
        for g, spec in enumerate(self.groups if self.check_content else ()):
            window = spec.sliding_window if spec.kind is GroupKind.SLIDING_WINDOW else None
            first = 0 if window is None else max(0, start - window + 1) // self.block_size
            self.kv.check(
                req.req_id, g, *self._blocks(req, g, range(first, start // self.block_size))
            )
            self.kv.write(
                g,
                *self._blocks(req, g, range(start // self.block_size, end // self.block_size))[1:],
            )
        req.num_computed = end
        self._cache_computed(req)
        return end == req.num_tokens and self._sample(req)

    def _blocks(
        self, req: SimRequest, group: int, positions: range
    ) -> tuple[list[int], list[int], list[int]]:
        """(positions, engine blocks, expected contents) of the request's blocks at `positions`."""
        ids = req.block_ids[group]
        return (
            list(positions),
            [ids[j] for j in positions],
            [self.kv.content(req.block_hashes[j], group) for j in positions],
        )

    def _sample(self, req: SimRequest) -> bool:
        req.output.append((sum(req.tokens[-8:]) * 31 + req.num_tokens) % 997)
        full = req.num_tokens // self.block_size
        if full > len(req.block_hashes):
            parent = req.block_hashes[-1] if req.block_hashes else None
            tail = req.tokens[len(req.block_hashes) * self.block_size : full * self.block_size]
            salt = req.cache_salt if not req.block_hashes else None
            req.block_hashes.extend(self.hasher.hash_blocks(tail, cache_salt=salt, parent=parent))
        return len(req.output) >= req.max_new_tokens

    def _rewind_if_invalid(self, req: SimRequest, invalid: set[int]) -> bool:
        """vLLM's "recompute" policy: a request with a failed block recomputes from it."""
        for g in range(len(self.groups)):
            for j, b in enumerate(req.block_ids[g]):
                if b in invalid and j * self.block_size < req.num_computed:
                    req.num_computed = j * self.block_size
                    return True
        return False

    # -- blocks -----------------------------------------------------------------------

    def _grow(self, req: SimRequest, num_tokens: int) -> tuple[list[int], ...] | None:
        needed = -(-num_tokens // self.block_size) - len(req.block_ids[0])
        if needed <= 0:
            return tuple([] for _ in self.groups)
        new = self.pool.allocate(needed)
        if new is None:
            self.preempt(req.req_id)
            return None
        for g, blocks in enumerate(new):
            req.block_ids[g].extend(blocks)
        return tuple(new)

    def _skip_window_blocks(self, req: SimRequest, num_tokens: int) -> None:
        """vLLM's sliding-window rule (`SlidingWindowManager.get_num_skipped_tokens`): once
        `num_tokens` are computed, the blocks wholly before the next token's window are freed
        and point at the null block; nobody tells the connector."""
        for g, spec in enumerate(self.groups):
            if spec.kind is not GroupKind.SLIDING_WINDOW:
                continue
            ids = req.block_ids[g]
            kept = spec.sliding_window + spec.extra_retained_tokens
            skipped = min(len(ids), max(0, num_tokens - kept + 1) // self.block_size)
            self.pool.release_now(ids[:skipped])  # the null block among them is not counted
            ids[:skipped] = [self.pool.null_block] * skipped

    def _cache_computed(self, req: SimRequest) -> None:
        self.pool.cache_blocks(req.block_hashes, req.block_ids, req.num_computed // self.block_size)

    def _release_blocks(self, req: SimRequest) -> None:
        self.pool.release(req.block_ids)
        req.block_ids = []
