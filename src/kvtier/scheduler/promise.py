"""The hand-off promise on the wire: what a prefill engine's `request_finished` returns and a
decode request carries in its `kv_transfer_params` (untrusted there); see
`kvtier.scheduler.handoff` for what it means."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["HandoffPromise", "parse_promise"]

logger = logging.getLogger(__name__)

# the key is an OffloadKey: a block hash and a group index
_MAX_KEY_BYTES = 64
_MAX_COUNT = 2**63 - 1


@dataclass(frozen=True, slots=True)
class HandoffPromise:
    """What a prefill engine promised a decode engine (see the module docstring)."""

    # the leading chunks on their way
    chunks: int
    # tokens in them
    tokens: int
    # the tier they go to
    tier: str
    # how long the producer's writes may still take
    deadline_s: float
    # the last promised chunk's key (group 0)
    key: bytes
    # the producer's namespace (hex; "": not known)
    namespace: str = ""

    def as_params(self) -> dict[str, Any]:
        """The promise as `request_finished` returns it (JSON-safe)."""
        return {
            "kvtier": {
                "handoff": {
                    "tokens": self.tokens,
                    "chunks": self.chunks,
                    "tier": self.tier,
                    "deadline_s": self.deadline_s,
                    "key": self.key.hex(),
                    "namespace": self.namespace,
                }
            }
        }


def parse_promise(value: Any, req_id: str) -> HandoffPromise | None:
    """A promise as the consumer receives it (untrusted); None, with a warning, if malformed."""
    if not isinstance(value, dict):
        return _refused(req_id, "is not a dict")
    chunks = value.get("chunks")
    tokens = value.get("tokens")
    if type(chunks) is not int or type(tokens) is not int:
        return _refused(req_id, "needs integer 'chunks' and 'tokens'")
    if not (0 <= chunks <= _MAX_COUNT and 0 <= tokens <= _MAX_COUNT):
        return _refused(req_id, "has a negative or too large count")
    tier = value.get("tier")
    if not isinstance(tier, str) or len(tier) > 32:
        return _refused(req_id, "needs a tier name")
    deadline = value.get("deadline_s", math.inf)
    is_number = isinstance(deadline, (int, float)) and not isinstance(deadline, bool)
    if not is_number or not deadline >= 0:
        return _refused(req_id, "has a deadline_s that is not a non-negative number")
    key = value.get("key", "")
    try:
        key_bytes = bytes.fromhex(key) if isinstance(key, str) else None
    except ValueError:
        key_bytes = None
    if key_bytes is None or len(key_bytes) > _MAX_KEY_BYTES or (chunks and not key_bytes):
        return _refused(req_id, "needs the hex key of its last chunk")
    namespace = value.get("namespace", "")
    if not isinstance(namespace, str) or len(namespace) > 64:
        return _refused(req_id, "has a namespace that is not a hex id")
    return HandoffPromise(chunks, tokens, tier, float(deadline), key_bytes, namespace)


def _refused(req_id: str, why: str) -> None:
    logger.warning(
        "request %s: kv_transfer_params['kvtier']['handoff'] %s; no hand-off is awaited",
        req_id,
        why,
    )
