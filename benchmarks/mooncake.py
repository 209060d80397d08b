"""The Mooncake conversation trace as kvtier keys (shared by the benchmarks).

Each line of the trace is one request: `hash_ids` are prefix-block ids of 512 tokens
(equal ids = a reusable prefix), so each id maps to one offload key (group 0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvtier.keys import make_offload_key

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake_conversation.jsonl"
TOKENS_PER_KEY = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    keys: list[bytes]


def load_trace(path: Path = DEFAULT_TRACE, limit: int | None = None) -> list[TraceRequest]:
    """Read up to `limit` requests; a clear error when the trace is missing."""
    if not path.exists():
        raise SystemExit(f"trace not found at {path}; pass --trace PATH to mooncake_conversation.jsonl")
    requests = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            row = json.loads(line)
            keys = [make_offload_key(int(h).to_bytes(32, "big"), 0) for h in row["hash_ids"]]
            requests.append(TraceRequest(row["timestamp"], row["input_length"], row["output_length"], keys))
    return requests
