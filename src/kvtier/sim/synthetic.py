"""A seeded synthetic trace of multi-turn chats and agent loops, in the Mooncake shape.

    requests = synthetic(num_conversations=300, seed=1)

What it models:
- **Shared system prompts**: every conversation starts with one of `num_system_prompts`
  prompts (the first ones more popular), so their blocks are shared across conversations.
- **Chats**: a few turns; each turn re-sends the whole history (system prompt, earlier
  user messages and replies) plus a new user message, after a think time of tens of seconds.
- **Agent loops**: many quick turns; each appends the model's last reply and a tool result
  to the history and calls the model again within seconds.

Conversations start as a Poisson process; the requests of all of them are merged in time
order. Hash ids are content-addressed like an engine's chained block hashes: a block's id
names its whole prefix, so equal prefixes get equal ids and a history's partial last block
gets a new id once a later turn fills it. The same arguments and seed give the same trace.

Thread-safety: functions only; nothing is shared.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["BlockIds", "synthetic"]

# (low, high) inclusive
_Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class _Kind:
    """How one kind of conversation behaves (token counts and gaps are drawn uniformly)."""

    turns: _Span
    # a user message (chat) or a tool result (agent)
    added_tokens: _Span
    output_tokens: _Span
    gap_ms: _Span


_CHAT = _Kind(
    turns=(1, 8), added_tokens=(30, 800), output_tokens=(50, 700), gap_ms=(10_000, 300_000)
)
_AGENT = _Kind(
    turns=(4, 24), added_tokens=(100, 2_000), output_tokens=(20, 300), gap_ms=(500, 8_000)
)


def synthetic(
    num_conversations: int = 200,
    *,
    seed: int = 0,
    agent_fraction: float = 0.3,
    num_system_prompts: int = 4,
    system_prompt_tokens: _Span = (600, 3_000),
    conversations_per_s: float = 0.5,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """A synthetic chat/agent trace (see the module docstring).

    Args:
        num_conversations: conversations to generate (each gives one request per turn).
        seed: the random seed; equal arguments give an equal trace.
        agent_fraction: the share of conversations that are agent loops (the rest chats).
        num_system_prompts: distinct shared system prompts (popularity ~ 1/rank).
        system_prompt_tokens: (low, high) length of each system prompt.
        conversations_per_s: the rate at which new conversations start.
        block_tokens: tokens per hash id.
    """
    if num_conversations < 0 or not 0.0 <= agent_fraction <= 1.0 or num_system_prompts < 1:
        raise ConfigError(
            "synthetic: num_conversations >= 0, 0 <= agent_fraction <= 1 and num_system_prompts >= 1"
        )
    if (
        conversations_per_s <= 0
        or block_tokens < 1
        or not 1 <= system_prompt_tokens[0] <= system_prompt_tokens[1]
    ):
        raise ConfigError(
            "synthetic: conversations_per_s > 0, block_tokens >= 1 and 1 <= low <= high tokens"
        )
    rng = random.Random(seed)
    ids = BlockIds(block_tokens)
    prompts = [[(-1 - i, rng.randint(*system_prompt_tokens))] for i in range(num_system_prompts)]
    weights = [1.0 / (rank + 1) for rank in range(num_system_prompts)]
    rows: list[tuple[int, int, int, TraceRequest]] = []
    start_ms = 0.0
    for conv in range(num_conversations):
        start_ms += rng.expovariate(conversations_per_s) * 1000.0
        is_agent = rng.random() < agent_fraction
        kind = _AGENT if is_agent else _CHAT
        system = rng.choices(prompts, weights)[0]
        for turn, request in enumerate(_conversation(rng, ids, kind, list(system), int(start_ms))):
            rows.append((request.timestamp_ms, conv, turn, request))
    rows.sort(key=lambda row: row[:3])
    return [row[3] for row in rows]


def _conversation(
    rng: random.Random, ids: BlockIds, kind: _Kind, history: list[tuple[int, int]], start_ms: int
) -> list[TraceRequest]:
    """One conversation's requests; `history` is its segments (segment id, tokens), system prompt first."""
    requests = []
    now = start_ms
    for _ in range(rng.randint(*kind.turns)):
        history.append((ids.new_segment(), rng.randint(*kind.added_tokens)))
        output = rng.randint(*kind.output_tokens)
        input_length = sum(n for _, n in history)
        requests.append(TraceRequest(now, input_length, output, ids.hash_ids(history)))
        # the reply is part of the next turn's prompt
        history.append((ids.new_segment(), output))
        now += rng.randint(*kind.gap_ms)
    return requests


class BlockIds:
    """Content-addressed block ids: (parent id, the block's pieces of segments) -> id."""

    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self._ids: dict[tuple, int] = {}
        self._segments = 0

    def new_segment(self) -> int:
        self._segments += 1
        return self._segments

    def hash_ids(self, history: list[tuple[int, int]]) -> tuple[int, ...]:
        """One id per block of the token sequence the segments spell, the last maybe partial."""
        out: list[int] = []
        # (segment, first token, end) inside the current block
        pieces: list[tuple[int, int, int]] = []
        room = self.block_tokens
        parent = -1
        for segment, length in history:
            offset = 0
            while offset < length:
                take = min(room, length - offset)
                pieces.append((segment, offset, offset + take))
                offset += take
                room -= take
                if room == 0:
                    parent = self._id(parent, pieces)
                    out.append(parent)
                    pieces = []
                    room = self.block_tokens
        if pieces:
            out.append(self._id(parent, pieces))
        return tuple(out)

    def _id(self, parent: int, pieces: list[tuple[int, int, int]]) -> int:
        return self._ids.setdefault((parent, tuple(pieces)), len(self._ids))
