"""What a request says about its own future: the client's hints, read from `kv_transfer_params`.

    {"kvtier": {"session": "chat-42", "retain_s": 600, "priority": 1, "next_turn_s": 30}}
    {"kvtier": {"session": "chat-42", "end_session": true}}

- `session` (str): groups a conversation's or an agent's requests. A chunk used only by one
  session's requests goes first once that session ends; a chunk another session (or an
  unhinted request) also used, e.g. a shared system prompt, does not.
- `retain_s` (seconds): keep this request's chunks at least this long where capacity allows:
  every tier evicts them after the chunks nobody asked to keep, and a shared store keeps the
  value at least this long (Redis: its TTL).
- `priority` (int, default 0): lower priorities are evicted first, higher ones last.
- `next_turn_s` (seconds): the session's next request is expected within this long; its chain
  is kept as `retain_s` would keep it, so the next turn finds it where it is fastest to load.
- `end_session` (bool): the session is over; its chunks go first once this request ends.

Durations count on the scheduler's clock (`time.monotonic` under an engine, the simulated
clock in `kvtier simulate`) from the request's last use of the chunk; an expired hint leaves
an ordinary chunk. How tiers honor them: `kvtier.policies.retention`.

A bad value is ignored with a one-line warning naming it (`parse_hints`); it never raises.

Thread-safety: immutable values and functions only.
"""

from __future__ import annotations

import logging
import math
import reprlib
from dataclasses import dataclass
from typing import Any

__all__ = ["HINT_NAMES", "NO_HINTS", "Hints", "parse_hints"]

logger = logging.getLogger(__name__)

HINT_NAMES = ("session", "retain_s", "priority", "next_turn_s", "end_session")
MAX_SESSION_CHARS = 256
# a year: beyond it a hint is a mistake, not a plan
MAX_SECONDS = 366 * 24 * 3600.0
MAX_PRIORITY = 1000


@dataclass(frozen=True, slots=True)
class Hints:
    session: str | None = None
    retain_s: float = 0.0
    priority: int = 0
    next_turn_s: float = 0.0
    end_session: bool = False

    @property
    def keep_s(self) -> float:
        """How long the request's chunks are to be kept after their last use (0: no such wish)."""
        return max(self.retain_s, self.next_turn_s)

    @property
    def is_empty(self) -> bool:
        return self == NO_HINTS


NO_HINTS = Hints()


def parse_hints(ours: dict[str, Any], req_id: str) -> Hints:
    """The hints in kvtier's sub-dict of `kv_transfer_params`; each bad one ignored with a warning."""
    values: dict[str, Any] = {}
    session = ours.get("session")
    if isinstance(session, str) and 0 < len(session) <= MAX_SESSION_CHARS:
        values["session"] = session
    elif session is not None:
        _ignored(req_id, "session", f"a string of 1 to {MAX_SESSION_CHARS} characters", session)
    for name in ("retain_s", "next_turn_s"):
        seconds = ours.get(name)
        if _is_number(seconds) and 0 <= seconds <= MAX_SECONDS:
            values[name] = float(seconds)
        elif seconds is not None:
            _ignored(req_id, name, f"a number of seconds from 0 to {MAX_SECONDS:.0f}", seconds)
    priority = ours.get("priority")
    if type(priority) is int and -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        values["priority"] = priority
    elif priority is not None:
        _ignored(req_id, "priority", f"an integer from {-MAX_PRIORITY} to {MAX_PRIORITY}", priority)
    end = ours.get("end_session")
    if isinstance(end, bool):
        values["end_session"] = end
    elif end is not None:
        _ignored(req_id, "end_session", "true or false", end)
    return Hints(**values) if values else NO_HINTS


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _ignored(req_id: str, name: str, expected: str, got: Any) -> None:
    logger.warning(
        "request %s: kvtier hint %r must be %s, got %s; ignored",
        req_id,
        name,
        expected,
        reprlib.repr(got),
    )
