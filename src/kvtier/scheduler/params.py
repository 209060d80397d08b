"""Per-request options read from `kv_transfer_params` (untrusted input).

kvtier reads only its own sub-dict, so other connectors' parameters pass through:

    {"kvtier": {"load": false, "store": true, "max_load_tokens": 512, "session": "chat-42", "retain_s": 600}}

Disaggregated prefill (`kvtier.scheduler.handoff`): `remote_decode` (or, on a "kv_producer",
vLLM's own top-level `do_remote_decode`) marks a request whose prompt a prefill engine hands
off; `handoff` is the promise a decode request carries.

`max_load_tokens` caps the tokens a request loads from kvtier after the engine's own hits (0:
none; at most 2**63 - 1, an int64 as the engine counts tokens), with the meaning of vLLM's own
`max_load_tokens`: the rest is recomputed. The hints
(`session`, `retain_s`, `priority`, `next_turn_s`, `end_session`) are read by
`kvtier.hints.parse_hints` and reach every manager call in `ReqContext.hints`.

Anything malformed is ignored with a warning naming the problem; it never raises, and a
warning quotes at most a line of what it got (a request may send megabytes of garbage).
"""

from __future__ import annotations

import dataclasses
import logging
import reprlib
from dataclasses import dataclass
from typing import Any

from kvtier.hints import HINT_NAMES, NO_HINTS, Hints, parse_hints
from kvtier.scheduler.promise import HandoffPromise, parse_promise

__all__ = ["OffloadParams", "for_role", "parse_kv_transfer_params"]

logger = logging.getLogger(__name__)
_FLAGS = ("load", "store")
_KNOWN = (*_FLAGS, "max_load_tokens", "remote_decode", "handoff", *HINT_NAMES)
_MAX_TOKENS = 2**63 - 1


@dataclass(frozen=True, slots=True)
class OffloadParams:
    # may this request load from kvtier
    load: bool = True
    # may this request's chunks be stored
    store: bool = True
    # at most this many tokens loaded after the engine's hits
    max_load_tokens: int | None = None
    # what the request says about its future (`kvtier.hints`)
    hints: Hints = NO_HINTS
    # its decode runs on another engine: hand its prompt off (`kvtier.scheduler.handoff`); asked
    # by kvtier's own key, or by vLLM's `do_remote_decode` (heeded by a "kv_producer" only)
    remote_decode: bool = False
    do_remote_decode: bool = False
    # what a prefill engine promised it
    handoff: HandoffPromise | None = None


def parse_kv_transfer_params(raw: Any, req_id: str) -> OffloadParams:
    """Read kvtier's options for one request; defaults on anything malformed."""
    try:
        return _parse(raw, req_id)
    except Exception as exc:
        # an object whose ==, hash or repr raises: still only this request's params
        logger.warning(
            "request %s: kv_transfer_params could not be read (%s); ignored",
            req_id,
            type(exc).__name__,
        )
        return OffloadParams()


def _parse(raw: Any, req_id: str) -> OffloadParams:
    if raw is None:
        return OffloadParams()
    if not isinstance(raw, dict):
        logger.warning(
            "request %s: kv_transfer_params is a %s, not a dict; ignored",
            req_id,
            type(raw).__name__,
        )
        return OffloadParams()
    ours = raw.get("kvtier")
    if ours is None:
        return OffloadParams(do_remote_decode=raw.get("do_remote_decode") is True)
    if not isinstance(ours, dict):
        logger.warning(
            "request %s: kv_transfer_params['kvtier'] must be a dict like "
            "{'load': bool, 'store': bool, 'max_load_tokens': int}; ignored",
            req_id,
        )
        return OffloadParams()
    unknown = [k for k in ours if k not in _KNOWN]
    if unknown:
        logger.warning(
            "request %s: unknown kvtier params %s ignored (valid: %s)",
            req_id,
            reprlib.repr(unknown),
            list(_KNOWN),
        )
    values: dict[str, Any] = {}
    for name in _FLAGS:
        value = ours.get(name, True)
        if isinstance(value, bool):
            values[name] = value
        else:
            logger.warning(
                "request %s: kvtier param %r must be true or false, got %s; ignored",
                req_id,
                name,
                reprlib.repr(value),
            )
    cap = ours.get("max_load_tokens")
    if type(cap) is int and 0 <= cap <= _MAX_TOKENS:
        values["max_load_tokens"] = cap
    elif cap is not None:
        logger.warning(
            "request %s: kvtier param 'max_load_tokens' must be a non-negative integer, got %s; ignored",
            req_id,
            reprlib.repr(cap),
        )
    handoff = None
    if "handoff" in ours:
        handoff = parse_promise(ours["handoff"], req_id)
    return OffloadParams(
        **values,
        hints=parse_hints(ours, req_id),
        remote_decode=ours.get("remote_decode") is True,
        do_remote_decode=raw.get("do_remote_decode") is True,
        handoff=handoff,
    )


def for_role(params: OffloadParams, role: str, consumer_stores: bool) -> OffloadParams:
    """What an engine of vLLM's `kv_role` does with a request's params.

    A "kv_consumer" hands nothing off, and stores only if `consumer_stores`. A "kv_producer"
    waits for no hand-off, and hands off a request marked either way. A "kv_both" engine hands
    off only on kvtier's own key: vLLM's `do_remote_decode` is there the mark of a transfer
    connector beside kvtier (NIXL under `MultiConnector`), whose decode engine gets the KV itself
    and must not wait for kvtier's.
    """
    if role == "kv_consumer":
        return dataclasses.replace(
            params,
            remote_decode=False,
            do_remote_decode=False,
            store=params.store and consumer_stores,
        )
    if role == "kv_producer":
        return dataclasses.replace(
            params, handoff=None, remote_decode=params.remote_decode or params.do_remote_decode
        )
    return params
