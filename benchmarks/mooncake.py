"""The Mooncake conversation trace for the benchmarks: where it is, and kvtier's reader.

The reader is `kvtier.sim.trace` (re-exported here); this module adds the default path
(the developers' shared folder) and a friendly exit when the trace is missing. Each trace
hash id names a 512-token block; `offload_keys(req.hash_ids)` gives one kvtier key per id.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_mooncake, offload_keys

__all__ = ["DEFAULT_TRACE", "TOKENS_PER_KEY", "TraceRequest", "load_trace", "offload_keys"]

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake_conversation.jsonl"
)
TOKENS_PER_KEY = MOONCAKE_BLOCK_TOKENS


def load_trace(path: Path = DEFAULT_TRACE, limit: int | None = None) -> list[TraceRequest]:
    """Read up to `limit` requests; exits with a clear message when the trace is missing."""
    if not path.exists():
        raise SystemExit(
            f"trace not found at {path}; pass --trace PATH to mooncake_conversation.jsonl"
        )
    return load_mooncake(path, limit=limit)
