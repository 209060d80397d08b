"""A seeded agentic trace in the Mooncake shape: long agent sessions with sub-agents (issue 23).

    requests = agentic(num_sessions=100, seed=1)
    turns = agentic_turns(num_sessions=100, seed=1)   # the same, with each request's session and agent

What agent traffic looks like (the figures issue 23 quotes): a median 43 turns per session,
142K prompt tokens and 444 generated tokens per request, over 96 % of each prompt a prefix hit.
What this generator makes of it:
- **Sessions**: each starts from one of a few shared agent system prompts (tool definitions)
  and a task; each turn re-sends the whole history and appends the model's reply and a tool
  result to it, so the context grows turn after turn. Turns per session: log-normal, median 43
  (10 to 120); replies: log-normal, median 444 tokens; a turn follows its previous one within
  seconds (model time and a tool call).
- **Sub-agents**: now and then a turn spawns one to three sub-agents; each starts from the
  parent's whole context plus its own task, runs a few turns of its own, interleaved with its
  siblings, and the parent goes on once all have answered, with their (short) results appended.
- **Interleaving**: sessions start as a Poisson process, so tens of them run at once and their
  turns interleave: between two turns of a session, the others send theirs (capacity matters).

Scaled down to replay here: every token count (system prompts, tasks, replies, tool results,
sub-agents' results) is `scale` times its full size — at the default 0.1 a median prompt is
~14K tokens (~28 blocks, as in Mooncake's conversation trace) and a median reply 44 — while
the turn structure keeps its full size, and so do the ratios: a turn's prompt is its previous
one plus ~4 % (the previous prompt is 96 % of the next on average; 93 % counting whole
512-token blocks only, which is what a cache can serve).

Hash ids are content-addressed as in `kvtier.sim.synthetic` (an id names its whole prefix); the
same arguments and seed give the same trace. Requests are merged in time order.

Thread-safety: functions only; nothing is shared.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from kvtier.errors import ConfigError
from kvtier.sim.synthetic import BlockIds
from kvtier.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["AgentTurn", "agentic", "agentic_turns"]

# (segment id, tokens): a prompt's parts, in order
_Segments = list[tuple[int, int]]

# Full-size figures (tokens, turns, milliseconds); prompt parts are multiplied by `scale`.
_TURNS, _TURNS_SIGMA, _TURNS_SPAN = 43, 0.6, (10, 120)
_REPLY, _REPLY_SIGMA, _REPLY_SPAN = 444, 0.8, (20, 4_000)
# each turn's growth besides the reply: ~142K median prompts
_TOOL_RESULT, _TOOL_SIGMA = 2_700, 1.0
_SYSTEM_PROMPT, _TASK = (8_000, 16_000), (200, 2_000)
_SUB_TURNS, _SUB_TURNS_SPAN, _SUB_RESULT = 8, (3, 20), (300, 2_000)
_GAP_MS = (1_000, 12_000)


@dataclass(frozen=True, slots=True)
class AgentTurn:
    """One request of an agentic trace, with what the trace itself does not say.

    Args:
        session: the session's index (in start order).
        agent: 0 for the session's main agent; 1, 2, ... for its sub-agents, in spawn order.
        request: the request.
    """

    session: int
    agent: int
    request: TraceRequest


@dataclass
class _Generator:
    """One trace's random draws and ids; `session` makes one session's requests."""

    rng: random.Random
    ids: BlockIds
    scale: float
    subagent_rate: float
    # (time, order, turn)
    rows: list[tuple[int, int, AgentTurn]] = field(default_factory=list)
    num_sessions: int = 0
    # in the current session
    num_agents: int = 0

    def session(self, history: _Segments, start_ms: int) -> None:
        self.num_sessions += 1
        self.num_agents = 0
        self._agent(
            history + [self.part(_TASK)], start_ms, self._turns(_TURNS, _TURNS_SPAN), can_fork=True
        )

    def _agent(self, history: _Segments, now: int, num_turns: int, can_fork: bool) -> int:
        """Run one agent's turns from `history`; returns when its last reply is back."""
        agent = self.num_agents
        self.num_agents += 1
        for turn in range(num_turns):
            reply = self._scaled(self._lognormal(_REPLY, _REPLY_SIGMA, _REPLY_SPAN))
            self._request(agent, now, history, reply)
            history.append((self.ids.new_segment(), reply))
            now += self.rng.randint(*_GAP_MS)
            if turn == num_turns - 1:
                break
            may_fork = can_fork and 2 <= turn < num_turns - 2
            if may_fork and self.rng.random() < self.subagent_rate:
                now = self._subagents(history, now)
            else:
                history.append(self._tool_result())
        return now

    def _subagents(self, history: _Segments, now: int) -> int:
        """One to three sub-agents from the parent's context; their results join it when all are back."""
        done = now
        results = []
        for _ in range(self.rng.randint(1, 3)):
            start = now + self.rng.randint(0, _GAP_MS[0])
            turns = self._turns(_SUB_TURNS, _SUB_TURNS_SPAN)
            end = self._agent(history + [self.part(_TASK)], start, turns, can_fork=False)
            done = max(done, end)
            results.append(self.part(_SUB_RESULT))
        history.extend(results)
        return done

    def _request(self, agent: int, now: int, history: _Segments, reply: int) -> None:
        request = TraceRequest(now, sum(n for _, n in history), reply, self.ids.hash_ids(history))
        self.rows.append((now, len(self.rows), AgentTurn(self.num_sessions - 1, agent, request)))

    def _turns(self, median: int, span: tuple[int, int]) -> int:
        return self._lognormal(median, _TURNS_SIGMA, span)

    def _tool_result(self) -> tuple[int, int]:
        size = self._lognormal(_TOOL_RESULT, _TOOL_SIGMA, (50, 20 * _TOOL_RESULT))
        return self.ids.new_segment(), self._scaled(size)

    def part(self, span: tuple[int, int]) -> tuple[int, int]:
        """A new prompt part of a size drawn uniformly from `span` (full-size tokens)."""
        return self.ids.new_segment(), self._scaled(self.rng.randint(*span))

    def _scaled(self, tokens: int) -> int:
        return max(1, round(tokens * self.scale))

    def _lognormal(self, median: float, sigma: float, span: tuple[int, int]) -> int:
        return min(span[1], max(span[0], round(self.rng.lognormvariate(math.log(median), sigma))))


def agentic(
    num_sessions: int = 100,
    *,
    seed: int = 0,
    scale: float = 0.1,
    sessions_per_s: float = 0.12,
    subagent_rate: float = 0.08,
    num_system_prompts: int = 3,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """An agentic trace (see the module docstring); `agentic_turns` tells each request's session and agent."""
    return [
        turn.request
        for turn in agentic_turns(
            num_sessions,
            seed=seed,
            scale=scale,
            sessions_per_s=sessions_per_s,
            subagent_rate=subagent_rate,
            num_system_prompts=num_system_prompts,
            block_tokens=block_tokens,
        )
    ]


def agentic_turns(
    num_sessions: int = 100,
    *,
    seed: int = 0,
    scale: float = 0.1,
    sessions_per_s: float = 0.12,
    subagent_rate: float = 0.08,
    num_system_prompts: int = 3,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[AgentTurn]:
    """An agentic trace's requests in time order, each with its session and agent.

    Args:
        num_sessions: top-level agent sessions (each with its sub-agents' requests).
        seed: the random seed; equal arguments give an equal trace.
        scale: token counts against the full-size figures (1.0: a median prompt of ~142K tokens).
        sessions_per_s: the rate at which sessions start (at ~6 minutes a session, 0.12/s keeps
            ~40 running at once).
        subagent_rate: the chance that a turn spawns sub-agents.
        num_system_prompts: distinct agent system prompts the sessions share (uniformly).
        block_tokens: tokens per hash id.
    """
    if num_sessions < 0 or not 0 < scale <= 1 or sessions_per_s <= 0 or not 0 <= subagent_rate <= 1:
        raise ConfigError(
            "agentic: num_sessions >= 0, 0 < scale <= 1, sessions_per_s > 0, 0 <= subagent_rate <= 1"
        )
    if num_system_prompts < 1 or block_tokens < 1:
        raise ConfigError("agentic: num_system_prompts >= 1 and block_tokens >= 1")
    rng = random.Random(seed)
    generator = _Generator(rng, BlockIds(block_tokens), scale, subagent_rate)
    prompts = [generator.part(_SYSTEM_PROMPT) for _ in range(num_system_prompts)]
    start_ms = 0.0
    for _ in range(num_sessions):
        start_ms += rng.expovariate(sessions_per_s) * 1000.0
        generator.session([rng.choice(prompts)], int(start_ms))
    return [turn for _, _, turn in sorted(generator.rows, key=lambda row: row[:2])]
