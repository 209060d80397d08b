"""Scheduler-side configuration: the KV-cache groups and the offload rules."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtier.costmodel.decision import LOAD_POLICIES
from kvtier.errors import ConfigError
from kvtier.settings import Check, choice, integer, seconds

__all__ = ["ROLES", "GroupKind", "GroupSpec", "SchedulerOffloadConfig"]

# vLLM's `kv_role` values: both, prefill (produces KV for others), decode (consumes it)
ROLES = ("kv_both", "kv_producer", "kv_consumer")


class GroupKind(enum.Enum):
    # every earlier token matters: prefix scan
    FULL = "full_attention"
    # only the last window matters: suffix scan
    SLIDING_WINDOW = "sliding_window"
    # e.g. state-space layers: the model gets no hits
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group.

    Args:
        kind: how the group's attention reads earlier tokens.
        tokens_per_block: the engine's block size for this group.
        blocks_per_chunk: engine blocks per offloaded chunk.
        sliding_window: window in tokens (SLIDING_WINDOW groups only).
        extra_retained_tokens: tokens before the window the engine keeps too (vLLM's
            `SlidingWindowSpec.extra_retained_tokens`: multi-token-prediction drafts re-prefill
            them); kvtier loads them and counts them out of the skipped blocks.
        reason: why kvtier cannot serve an UNSUPPORTED group (logged at start).
    """

    kind: GroupKind = GroupKind.FULL
    tokens_per_block: int = 16
    blocks_per_chunk: int = 1
    sliding_window: int | None = None
    # UNSUPPORTED groups: why, for the warning at start
    reason: str = ""
    extra_retained_tokens: int = 0
    # derived once (read for every request in every step): tokens_per_block x blocks_per_chunk
    tokens_per_chunk: int = field(init=False, repr=False, compare=False)
    # tokens of KV a sliding-window group keeps behind the next token (window + retained)
    _kept_tokens: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0 or self.blocks_per_chunk <= 0:
            raise ConfigError(f"tokens_per_block and blocks_per_chunk must be positive: {self}")
        if (self.kind is GroupKind.SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ConfigError(
                "sliding_window (tokens) is required for, and only for, SLIDING_WINDOW groups"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(
                f"sliding_window must be a positive number of tokens, got {self.sliding_window}"
            )
        if self.extra_retained_tokens < 0 or (
            self.extra_retained_tokens and self.sliding_window is None
        ):
            raise ConfigError(
                "extra_retained_tokens must be >= 0, and only a SLIDING_WINDOW group has any"
            )
        object.__setattr__(self, "tokens_per_chunk", self.tokens_per_block * self.blocks_per_chunk)
        object.__setattr__(
            self, "_kept_tokens", (self.sliding_window or 0) + self.extra_retained_tokens
        )

    def num_skipped_blocks(self, num_tokens: int) -> int:
        """Blocks wholly before the window of the token after `num_tokens`: the engine frees them
        and points them at its null block (vLLM's `SlidingWindowManager.get_num_skipped_tokens`),
        so kvtier never writes nor reads them. 0 for other groups."""
        if self.sliding_window is None:
            return 0
        return max(0, num_tokens - self._kept_tokens + 1) // self.tokens_per_block

    def first_needed_chunk(self, num_chunks: int) -> int:
        """First chunk whose KV this group needs to continue after `num_chunks` chunks.

        The token after the boundary attends to the previous `sliding_window - 1`
        tokens in a sliding-window group, to every earlier token otherwise.
        """
        if self.sliding_window is None:
            return 0
        return max(
            0,
            (num_chunks * self.tokens_per_chunk - (self._kept_tokens - 1)) // self.tokens_per_chunk,
        )


# the bounds of the settings the user's configuration hands the scheduler as they are
# (`kvtier.config.KVTierConfig` checks its keys of these names with these same checks)
CHECKS: dict[str, Check] = {
    "max_defer_s": seconds(0.0),
    "max_deferrals": integer(0),
    "job_timeout_s": seconds(0.001),
    "load_mode": choice("sync", "async"),
    "store_mode": choice("eager", "lazy"),
    "load_policy": choice(*LOAD_POLICIES),
    "role": choice(*ROLES),
    "handoff_wait_s": seconds(0.0),
}


@dataclass(frozen=True, slots=True)
class SchedulerOffloadConfig:
    """Offload rules shared by every request.

    Args:
        groups: the model's KV-cache groups, in the engine's group order.
        offload_prompt_only: store prompt chunks only (not generated tokens).
        max_defer_s: a request waits at most this long for pending writes or probes.
        max_deferrals: and is asked again at most this many times (a backstop: an idle engine
            asks again every few milliseconds, so a step count is no measure of time).
        job_timeout_s: a job's deadline after it is created: workers abandon it then, and
            the scheduler fails it once as long again has passed without every report.
        num_workers: workers that must acknowledge each job.
        hash_block_size: tokens per engine block hash (default: the first group's block size).
        load_mode: "sync": a load ends before its request's first forward pass (the engine
            waits for it inside the step); "async": the engine parks the request while its load
            runs and the rest of the batch keeps stepping (the engine must support it).
        store_mode: "eager": a chunk is stored as soon as it is computed; "lazy": when the
            engine is about to evict its blocks (the adapter passes them to
            `OffloadScheduler.plan_evictions` each step; see `kvtier.scheduler.lazy`), so the host
            tier holds what the engine lost instead of a copy of what it still holds.
        load_policy: "cost": load as much of a found prefix as the expected time to first token
            says (`kvtier.scheduler.load_cost`); "always": all of it.
        chunk_bytes: bytes of one chunk of every group on every worker (the cost model weighs
            them; 0: unknown, every found chunk is loaded).
        steps_planned_ahead: steps the engine plans before the one running ends (vLLM's async
            scheduling: 1), for timing its steps.
        role: the engine's part in disaggregated serving (vLLM's `kv_role`; see
            `kvtier.scheduler.handoff`): "kv_both" loads and stores; "kv_producer" (prefill)
            also hands prompts off; "kv_consumer" (decode) waits for hand-offs, and stores
            nothing unless `consumer_stores`.
        handoff_wait_s: a request promised a hand-off waits at most this long for it.
        consumer_stores: a "kv_consumer" stores what it computes too.
        namespace_id: the engine's namespace (hex; "": not known), which a hand-off's promise
            names: a decode engine of another namespace does not wait for it.
    """

    groups: tuple[GroupSpec, ...] = (GroupSpec(),)
    offload_prompt_only: bool = False
    max_defer_s: float = 2.0
    max_deferrals: int = 4096
    job_timeout_s: float = 10.0
    num_workers: int = 1
    hash_block_size: int | None = None
    load_mode: str = "sync"
    store_mode: str = "eager"
    load_policy: str = "cost"
    chunk_bytes: int = 0
    steps_planned_ahead: int = 0
    role: str = "kv_both"
    handoff_wait_s: float = 5.0
    consumer_stores: bool = False
    namespace_id: str = ""
    # Derived once, in `__post_init__` (plain attributes: the scheduler reads them for every
    # running request in every step, issue 37). Tokens per chunk, the same in every group:
    tokens_per_chunk: int = field(init=False, repr=False, compare=False)
    # tokens per engine block hash (`hash_block_size`, else the first group's block size)
    tokens_per_hash: int = field(init=False, repr=False, compare=False)
    # engine block hashes per chunk
    hashes_per_chunk: int = field(init=False, repr=False, compare=False)
    # False when a group cannot be offloaded: the whole model then gets no hits
    is_supported: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key, check in CHECKS.items():
            object.__setattr__(self, key, check(key, getattr(self, key)))
        if not self.groups:
            raise ConfigError("at least one KV-cache group is required")
        if len({g.tokens_per_chunk for g in self.groups}) != 1:
            raise ConfigError(
                "every KV-cache group needs the same tokens per chunk (block size x blocks_per_chunk)"
            )
        object.__setattr__(self, "tokens_per_chunk", self.groups[0].tokens_per_chunk)
        object.__setattr__(
            self, "tokens_per_hash", self.hash_block_size or self.groups[0].tokens_per_block
        )
        if self.tokens_per_chunk % self.tokens_per_hash:
            raise ConfigError(
                f"a chunk ({self.tokens_per_chunk} tokens) must span whole hash blocks of "
                f"{self.tokens_per_hash} tokens"
            )
        if self.chunk_bytes < 0 or self.steps_planned_ahead < 0:
            raise ConfigError(
                f"chunk_bytes and steps_planned_ahead must be >= 0: {self.chunk_bytes}, "
                f"{self.steps_planned_ahead}"
            )
        if self.num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {self.num_workers}")
        object.__setattr__(self, "hashes_per_chunk", self.tokens_per_chunk // self.tokens_per_hash)
        object.__setattr__(self, "is_supported", not self.unsupported_groups())

    def unsupported_groups(self) -> list[int]:
        """Indices of the groups kvtier cannot serve."""
        return [i for i, g in enumerate(self.groups) if g.kind is GroupKind.UNSUPPORTED]
