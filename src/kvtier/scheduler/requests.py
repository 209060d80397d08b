"""`RequestTable`: the requests the scheduler tracks, and when one is forgotten.

A request is tracked from its first lookup (an engine request) or from the step its chunks are
stored lazily (an eviction owner, `kvtier.scheduler.stores`). It is forgotten once it has ended
and has no job in flight: only then does the manager hear `on_request_finished`, which releases
its pins and its chain (a job in flight still reads or writes the slots they protect).

Thread-safety: none; the scheduler's thread owns it.
"""

from __future__ import annotations

from collections.abc import Iterator, ValuesView

from kvtier.base import OffloadingManager
from kvtier.scheduler.state import RequestOffloadState

__all__ = ["RequestTable"]


class RequestTable:
    """Request id -> the scheduler's state of that request.

    Args:
        manager: told when a request is forgotten (`on_request_finished`).
    """

    def __init__(self, manager: OffloadingManager):
        self._manager = manager
        self._states: dict[str, RequestOffloadState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[str]:
        """The ids of the requests tracked, oldest first."""
        return iter(self._states)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._states

    def __getitem__(self, req_id: str) -> RequestOffloadState:
        return self._states[req_id]

    def get(self, req_id: str) -> RequestOffloadState | None:
        return self._states.get(req_id)

    def values(self) -> ValuesView[RequestOffloadState]:
        return self._states.values()

    def add(self, state: RequestOffloadState) -> None:
        """Track `state` under its request id."""
        self._states[state.req_id] = state

    def release_if_done(self, state: RequestOffloadState) -> None:
        """Forget `state` if its request has ended and has no job in flight."""
        if state.is_finished and not state.transfer_jobs:
            del self._states[state.req_id]
            self._manager.on_request_finished(state.req_context)
