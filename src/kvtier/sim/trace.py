"""Request traces for the simulator: the Mooncake JSONL format.

A trace is a list of `TraceRequest`s in arrival order. Each names its prompt by
`hash_ids`, one id per `block_tokens`-token block of the prompt (512 in Mooncake's
traces), the last one possibly partial; equal ids at equal positions are the same
prefix (an id names its whole prefix, like an engine's chained block hash). That is
all the simulator needs to rebuild the traffic's prefix reuse.

    requests = load_mooncake("mooncake_conversation.jsonl")

One request per line, a JSON object with `timestamp` (ms), `input_length` and
`output_length` (tokens) and `hash_ids` (list of ints); blank lines are skipped. A
malformed line stops the reader with a `TraceError` that names the file, the line
number and what is wrong with it.

`synthetic(...)` (`kvtier.sim.synthetic`) and `agentic(...)` (`kvtier.sim.agentic`) make
traces of the same shape. A request may carry `ClientHints` (what its client would tell
kvtier; a trace file carries none): `kvtier.sim.hints` derives them from a trace's
conversations, and the replay hands them to the scheduler as the request's
`kv_transfer_params` (`{"kvtier": hints.to_params()}`).

Thread-safety: functions only; nothing is shared.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import KVTierError
from kvtier.keys import OffloadKey, make_offload_key

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "ClientHints",
    "TraceError",
    "TraceRequest",
    "load_mooncake",
    "offload_keys",
    "parse_mooncake",
]

# tokens per hash id in Mooncake's published traces
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(KVTierError, ValueError):
    """A trace file or line that cannot be read (the message names where and why)."""


@dataclass(frozen=True, slots=True)
class ClientHints:
    """What a client tells kvtier about one request (issue 23): `{"kvtier": {...}}` in its
    `kv_transfer_params`. Durations are in seconds of the clock the scheduler reads (in a
    replay, the simulated clock).

    Args:
        session: groups a conversation's (or an agent's) requests.
        next_turn_s: the session's next request is expected within this many seconds.
        end_session: the session is over.
        retain_s: keep this request's chunks at least this long, where capacity allows.
        priority: lower priorities are evicted first (0: the default).
    """

    session: str | None = None
    next_turn_s: float | None = None
    end_session: bool = False
    retain_s: float | None = None
    priority: int = 0

    def to_params(self) -> dict[str, Any]:
        """The `kvtier` sub-dict of `kv_transfer_params`: only the fields that say something."""
        params: dict[str, Any] = {}
        if self.session is not None:
            params["session"] = self.session
        if self.next_turn_s is not None:
            params["next_turn_s"] = self.next_turn_s
        if self.end_session:
            params["end_session"] = True
        if self.retain_s is not None:
            params["retain_s"] = self.retain_s
        if self.priority:
            params["priority"] = self.priority
        return params


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Args:
        timestamp_ms: arrival time in milliseconds from the trace's start.
        input_length: prompt tokens.
        output_length: generated tokens.
        hash_ids: one prefix id per prompt block (`block_tokens` tokens), the last maybe partial.
        hints: what the client tells kvtier about it (None: nothing; see `kvtier.sim.hints`).
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    hints: ClientHints | None = None

    def num_full_blocks(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> int:
        """Prompt blocks that are whole (only those can be cached)."""
        return min(self.input_length // block_tokens, len(self.hash_ids))

    def kv_transfer_params(self) -> dict[str, Any] | None:
        """What the engine's request carries for kvtier: the hints, if any."""
        return None if self.hints is None else {"kvtier": self.hints.to_params()}


def load_mooncake(
    path: str | Path, limit: int | None = None, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace (at most `limit` requests).

    Raises:
        TraceError: the file cannot be opened, or a line is malformed (its number is named).
    """
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:
            return parse_mooncake(f, source=str(path), limit=limit, block_tokens=block_tokens)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None


def parse_mooncake(
    lines: Iterable[str],
    source: str = "<trace>",
    limit: int | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Parse Mooncake JSONL lines (see the module docstring); `source` names them in errors."""
    requests: list[TraceRequest] = []
    for number, line in enumerate(lines, start=1):
        if limit is not None and len(requests) >= limit:
            break
        if not line.strip():
            continue
        try:
            requests.append(_parse_line(line, block_tokens))
        except ValueError as exc:
            raise TraceError(f"{source}: line {number}: {exc}") from None
    return requests


def offload_keys(hash_ids: Sequence[int], group: int = 0) -> list[OffloadKey]:
    """One kvtier key per trace id (the id as a 32-byte block hash), for manager-level replays."""
    return [make_offload_key(int(h).to_bytes(32, "big"), group) for h in hash_ids]


def _parse_line(line: str, block_tokens: int) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    timestamp = _number(row, "timestamp")
    input_length = _int(row, "input_length", minimum=1)
    output_length = _int(row, "output_length", minimum=0)
    hash_ids = row.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise ValueError(
            f"'hash_ids' must be a list of non-negative integers, got {_short(hash_ids)}"
        )
    expected = -(-input_length // block_tokens)
    if len(hash_ids) != expected:
        raise ValueError(
            f"{len(hash_ids)} hash_ids for input_length {input_length}: expected {expected}, "
            f"one per {block_tokens}-token block (another block size? pass block_tokens)"
        )
    return TraceRequest(int(timestamp), input_length, output_length, tuple(hash_ids))


def _number(row: dict[str, Any], name: str) -> float:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"'{name}' must be a non-negative number, got {_short(value)}")
    return value


def _int(row: dict[str, Any], name: str, minimum: int) -> int:
    value = row.get(name)
    if not _is_int(value) or value < minimum:
        raise ValueError(f"'{name}' must be an integer >= {minimum}, got {_short(value)}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = "missing" if value is None else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
