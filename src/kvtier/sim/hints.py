"""Client hints for a trace (issue 23): what each request's client would tell kvtier.

    pace = replay_pace(requests, options)                  # simulated seconds per request
    hinted = with_hints(requests, pace)                    # exact hints
    noisy = with_hints(requests, pace, error=0.2, seed=1)  # the client wrong 1 time in 5

A trace names no users, so the conversations are recognised by their prefix chains
(`find_conversations`): a request continues an earlier one when its prompt extends that
request's whole blocks, at a block no other conversation has sent and that does not start
many prompts (a shared system prompt links nobody, even the first time a second
conversation sends it). The first such later request is the earlier one's next turn; a session is a
first request and everything that continues it (an agent's sub-agents, which start from its
prefix, join its session). A request whose whole blocks are all shared (a first turn that ends
less than a block past its system prompt) cannot be told apart from another conversation's
start: it is a session of its own, and the rest of its conversation another. It loses nothing
by it: it has no block of its own that a hint could keep.

What a client knows, and so what it says (`ClientHints`):
- `session`: its conversation (the index of the conversation's first request);
- `next_turn_s` on a request that has a next turn: the client knows its conversation goes on,
  and roughly when; it knows nothing of other users' futures;
- `end_session` on a session's last request (a single-turn conversation's only one);
- a request that is neither (a sub-agent's last turn while its parent goes on) says only its
  session. `retain_s` and `priority` are not derived: a trace's structure says nothing more
  about a request than whether and when its conversation comes back.

Seconds are on the replay's clock, not the trace's: a replay does not replay timestamps, it
admits requests in order as the engine has room (`kvtier.sim.replay`), about one every
`replay_pace` simulated seconds. So a next turn `n` requests later is announced as expected
within `n x pace x NEXT_TURN_SLACK` seconds: the time the replay will take to get there, with
room for its pace to vary. Scaling the trace's timestamps instead would tell the scheduler
about a clock the replay does not run (a conversation's think time is not where its next turn
falls among the others in a replay).

The noisy variant flips each request's hint with probability `error` (seeded): a next turn
not announced or an end announced instead, a next turn announced that never comes (expected
within the median announced gap), a session ended while it goes on.

Thread-safety: functions only; nothing is shared.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from kvtier.errors import ConfigError
from kvtier.sim.options import SimOptions
from kvtier.sim.trace import MOONCAKE_BLOCK_TOKENS, ClientHints, TraceRequest
from kvtier.sim.workload import engine_output_tokens

__all__ = [
    "NEXT_TURN_SLACK",
    "Conversations",
    "find_conversations",
    "hints_for",
    "replay_pace",
    "with_hints",
]

# A next turn is announced at 1.5x the replay's time to reach it: the replay's pace is an
# average (a step that prefills many long prompts admits fewer), and a hint that runs out
# before its turn arrives protects nothing when it is needed.
NEXT_TURN_SLACK = 1.5
# a block id that more than one session has sent
_SHARED = -1
# A block followed by more different whole blocks than this across the trace is a shared prefix
# (a system prompt): a conversation's block is followed by its later turns' next block and, for
# an agent, by its sub-agents' tasks (3 at most).
_MAX_BRANCHES = 5


@dataclass(frozen=True, slots=True)
class Conversations:
    """A trace's conversations, per request (indices into the trace).

    Args:
        session: the index of the first request of the request's session.
        next_turn: the index of its first later turn (None: none comes).
        is_last: the last request of its session, with no turn after it.
    """

    session: list[int]
    next_turn: list[int | None]
    is_last: list[bool]


def find_conversations(
    requests: Sequence[TraceRequest], block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> Conversations:
    """Link each request to the earlier one it continues (see the module docstring)."""
    session: list[int] = []
    next_turn: list[int | None] = [None] * len(requests)
    # a request's last whole-block id -> the latest request ending there
    ends: dict[int, int] = {}
    # block id -> the one session that sent it
    owner = dict.fromkeys(_branching(requests, block_tokens), _SHARED)
    for index, req in enumerate(requests):
        parent = _parent(req, requests, ends, owner, session, block_tokens)
        session.append(index if parent is None else session[parent])
        if parent is not None and next_turn[parent] is None:
            next_turn[parent] = index
        num_full = req.num_full_blocks(block_tokens)
        for block_id in req.hash_ids[:num_full]:
            first_sender = owner.setdefault(block_id, session[index])
            if first_sender != session[index]:
                owner[block_id] = _SHARED
        if num_full:
            ends[req.hash_ids[num_full - 1]] = index
    last = {s: index for index, s in enumerate(session)}
    is_last = [last[s] == index and next_turn[index] is None for index, s in enumerate(session)]
    return Conversations(session, next_turn, is_last)


def _branching(requests: Sequence[TraceRequest], block_tokens: int) -> list[int]:
    """Block ids followed by more than `_MAX_BRANCHES` different blocks: prefixes many prompts share."""
    successors: dict[int, set[int]] = {}
    # whole blocks only: each turn's partial last block is a new one
    for req in requests:
        whole = req.hash_ids[: req.num_full_blocks(block_tokens)]
        for block_id, after in pairwise(whole):
            successors.setdefault(block_id, set()).add(after)
    return [block_id for block_id, after in successors.items() if len(after) > _MAX_BRANCHES]


def _parent(
    req: TraceRequest,
    requests: Sequence[TraceRequest],
    ends: dict[int, int],
    owner: dict[int, int],
    session: list[int],
    block_tokens: int,
) -> int | None:
    """The request `req` continues: the deepest whose whole blocks `req` extends, at a block its session owns."""
    # `req` has a block more than its parent
    for position in range(len(req.hash_ids) - 2, -1, -1):
        block_id = req.hash_ids[position]
        earlier = ends.get(block_id)
        if earlier is None or owner.get(block_id) != session[earlier]:
            continue
        if requests[earlier].num_full_blocks(block_tokens) == position + 1:
            return earlier
    return None


def replay_pace(requests: Sequence[TraceRequest], options: SimOptions) -> float:
    """Simulated seconds between two admissions in a replay of `requests`, on average.

    A replay keeps `max_running` requests in the engine; each stays one step per generated token
    (its prefill step samples the first), and each step is `step_s` seconds.
    """
    if not requests:
        return options.step_s
    scale = (options.trace_block_tokens, options.engine_block_tokens)
    steps = statistics.fmean(engine_output_tokens(req, *scale) for req in requests)
    return options.step_s * steps / options.max_running


def hints_for(
    conversations: Conversations, seconds_per_request: float, *, error: float = 0.0, seed: int = 0
) -> list[ClientHints]:
    """Each request's hints; with `error` > 0, each one wrong with that probability (seeded)."""
    if not 0.0 <= error <= 1.0 or seconds_per_request <= 0:
        raise ConfigError(
            f"hints: 0 <= error <= 1 and seconds_per_request > 0, got {error}, {seconds_per_request}"
        )
    exact = [
        _exact(conversations, index, seconds_per_request)
        for index in range(len(conversations.session))
    ]
    if error == 0.0:
        return exact
    rng = random.Random(seed)
    gaps = [h.next_turn_s for h in exact if h.next_turn_s is not None]
    typical_s = statistics.median(gaps) if gaps else 100 * seconds_per_request * NEXT_TURN_SLACK
    noisy: list[ClientHints] = []
    for told in exact:
        hints = told
        if rng.random() < error:
            hints = _wrong(told, rng, typical_s)
        noisy.append(hints)
    return noisy


def with_hints(
    requests: Sequence[TraceRequest],
    seconds_per_request: float,
    *,
    error: float = 0.0,
    seed: int = 0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """`requests`, each carrying its client's hints (see `hints_for`)."""
    conversations = find_conversations(requests, block_tokens)
    hints = hints_for(conversations, seconds_per_request, error=error, seed=seed)
    return [replace(req, hints=h) for req, h in zip(requests, hints, strict=True)]


def _exact(conversations: Conversations, index: int, seconds_per_request: float) -> ClientHints:
    session = f"s{conversations.session[index]}"
    later = conversations.next_turn[index]
    if later is not None:
        return ClientHints(
            session, next_turn_s=(later - index) * seconds_per_request * NEXT_TURN_SLACK
        )
    return ClientHints(session, end_session=conversations.is_last[index])


def _wrong(hints: ClientHints, rng: random.Random, typical_s: float) -> ClientHints:
    """The other answer to "does this session come back?" than the exact hint gives."""
    # it comes back: not announced, or announced over
    if hints.next_turn_s is not None:
        return ClientHints(hints.session, end_session=rng.random() < 0.5)
    # it is over: a turn announced that never comes
    if hints.end_session:
        return ClientHints(hints.session, next_turn_s=typical_s)
    # a leaf of a session that goes on: a turn that never comes, or the whole session ended
    if rng.random() < 0.5:
        return ClientHints(hints.session, next_turn_s=typical_s)
    return ClientHints(hints.session, end_session=True)
