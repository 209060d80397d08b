"""Helpers shared by the test suites."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.base import ReqContext
from kvtier.jobs import Endpoint, TransferJob, TransferPart
from kvtier.keys import make_offload_key

# How long a test waits for a condition before it calls the wait a hang. Only a hang reaches it: on a
# busy 2-core machine (a CPU hog on one core, the suite's servers on the other) a thread can wait
# seconds for its turn, and the 5-10 s ceilings the tests had were reachable by a correct program.
HANG_S = 60.0
# the same, for a store's request timeout: a busy machine's requests never reach it
HANG_MS = int(HANG_S * 1000)


def wait_until(
    condition: Callable[[], object], what: str, timeout: float = HANG_S, interval_s: float = 0.01
) -> None:
    """Poll `condition` every `interval_s` until it holds; fail naming `what` after `timeout`."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting until {what}"
        time.sleep(interval_s)


def make_req_context(
    req_id: str = "", kv_transfer_params: dict[str, Any] | None = None
) -> ReqContext:
    """A ReqContext for tests; the manager suites do not care which request asks."""
    return ReqContext(req_id=req_id, kv_transfer_params=kv_transfer_params)


def key(i: int, group: int = 0) -> bytes:
    """A deterministic 36-byte offload key numbered `i` (readable in failures)."""
    return make_offload_key(i.to_bytes(32, "big"), group)


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def num(k: bytes) -> int:
    """Inverse of `key` for readable assertions."""
    return int.from_bytes(k[:32], "big")


def nums(ks: list[bytes] | None) -> list[int] | None:
    return None if ks is None else [num(k) for k in ks]


def access(p: Any, batch: list[bytes], victims: list[list[bytes]] | None = None) -> int:
    """One request as a tier drives its policy `p`: touch the keys of `batch` it holds, store the
    rest (evicting what it must, never the request's own keys; each eviction's victims appended to
    `victims`). Returns the number of hits."""
    held = [k for k in batch if k in p]
    p.touch(held)
    new = [k for k in batch if k not in p]
    p.prepare_insert(new)
    num_needed = len(p) + len(new) - p.capacity
    if num_needed > 0:
        evicted = p.evict(num_needed, set(batch))
        assert evicted is not None
        if victims is not None:
            victims.append(evicted)
    p.insert(new)
    return len(held)


def store_job(job_id, block_ids, slot_ids, group=0):
    """A one-part store job (ids passed through as given: validation is under test)."""
    part = TransferPart(group=group, slot_ids=slot_ids, block_ids=block_ids)
    return TransferJob(
        job_id=job_id,
        req_id="r",
        src=Endpoint.ENGINE,
        dst=Endpoint.SLAB,
        parts=(part,),
        deadline=0.0,
    )


def load_job(job_id, slot_ids, block_ids, group=0, skip_blocks=0):
    part = TransferPart(
        group=group, slot_ids=slot_ids, block_ids=block_ids, skip_blocks=skip_blocks
    )
    return TransferJob(
        job_id=job_id,
        req_id="r",
        src=Endpoint.SLAB,
        dst=Endpoint.ENGINE,
        parts=(part,),
        deadline=0.0,
    )


class CopyEnded(Exception):
    """The copy ended before the test could act while it ran: the attempt tests nothing."""


def mid_copy(scenario, attempts: int = 20):
    """`scenario()`'s result from the first attempt that caught its copy running (`scenario` raises
    `CopyEnded` when it came too late: a loaded machine may wake the test after a short copy ended).
    A cancel that never cuts a copy fails every attempt; 20 of them (8 before) leave a busy machine's
    late wake-ups no realistic way to fail a correct copier, and cost a passing run nothing."""
    for _ in range(attempts):
        try:
            return scenario()
        except CopyEnded:
            continue
    pytest.fail(f"in {attempts} attempts the copy always ended before the test could act on it")
