"""One request of the fake engine (`kvtier.sim.fake_engine.FakeEngine`): its tokens, blocks
and hashes, where it stands, and how the engine shows it to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.jobs import BlockIds
from kvtier.scheduler.types import RequestView, ScheduledRequest

__all__ = ["SimRequest"]


@dataclass
class SimRequest:
    req_id: str
    prompt: list[int]
    max_new_tokens: int
    cache_salt: str | None = None
    kv_transfer_params: Any = None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    # per group
    block_ids: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    # local + external at first scheduling
    num_cached_tokens: int | None = None
    num_external_tokens: int = 0
    num_lookups: int = 0
    is_finished: bool = False
    # its asynchronous load ended; not scheduled since
    awaits_first_schedule: bool = False
    # what the scheduler returned when it ended (vLLM: the output's kv_transfer_params)
    returned_params: Any = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def view(self) -> RequestView:
        return RequestView(
            req_id=self.req_id,
            block_hashes=self.block_hashes,
            num_tokens=self.num_tokens,
            num_prompt_tokens=len(self.prompt),
            num_computed_tokens=self.num_computed,
            kv_transfer_params=self.kv_transfer_params,
            tenant=self.cache_salt,
        )

    def as_scheduled(
        self, new_block_ids: BlockIds | None, is_new: bool, n: int
    ) -> ScheduledRequest:
        """This request in a step that computes `n` of its tokens."""
        return ScheduledRequest(
            req_id=self.req_id,
            new_block_ids=new_block_ids,
            is_new_or_resumed=is_new,
            num_computed_tokens=self.num_computed,
            num_scheduled_tokens=n,
        )
