"""The engine-facing views: what an adapter builds from its engine's objects for the scheduler.

`RequestView`, `ScheduledRequest` and `StepView` hold no engine object and no tensor. (What
goes from the scheduler to the workers and back — jobs, plans, results — is in `kvtier.jobs`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.jobs import BlockIds
from kvtier.keys import BlockHash

__all__ = ["BlockIds", "RequestView", "ScheduledRequest", "StepView"]


@dataclass(slots=True, kw_only=True)
class RequestView:
    """What the scheduler reads of one engine request.

    `block_hashes` may be the engine's own list (vLLM extends it in place as blocks
    fill); the scheduler only reads it.
    """

    req_id: str
    block_hashes: Sequence[BlockHash]
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    # untrusted: validated by kvtier.scheduler.params
    kv_transfer_params: Any = None
    # the engine's per-tenant cache salt (vLLM's cache_salt)
    tenant: str | None = None
    # the adapter's own handle on the request (its events read it); never read here
    engine_request: Any = None


@dataclass(slots=True, kw_only=True)
class ScheduledRequest:
    """One request in an engine step.

    new_block_ids: blocks allocated this step per group (None: none). They replace the
        request's block list when `is_new_or_resumed`, else they are appended.
    num_computed_tokens: tokens whose KV existed before this step.
    num_scheduled_tokens: tokens computed by this step.
    """

    req_id: str
    new_block_ids: BlockIds | None
    is_new_or_resumed: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(slots=True)
class StepView:
    """One engine step: the scheduled requests, and the ids preempted or finished."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
