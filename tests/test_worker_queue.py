"""TaskQueue: loads first, unless they conflict with an earlier store; FIFO per direction."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.worker.queue import TaskQueue
from kvtier.worker.tasks import CopyTask


def job(
    job_id: int, is_store: bool, blocks: list[int], slots: list[int], num_bytes: int = 1
) -> CopyTask:
    return CopyTask(
        job_id=job_id,
        part=0,
        is_store=is_store,
        group=0,
        block_ids=np.array(blocks).reshape(len(slots), -1),
        slot_ids=np.array(slots),
        num_chunks=len(slots),
        failed_chunks=(),
        error=None,
        block_set=frozenset(blocks),
        slot_set=frozenset(slots),
        num_bytes=num_bytes,
    )


def store(job_id: int, blocks: list[int], slots: list[int], num_bytes: int = 1) -> CopyTask:
    return job(job_id, True, blocks, slots, num_bytes)


def load(job_id: int, slots: list[int], blocks: list[int], num_bytes: int = 1) -> CopyTask:
    return job(job_id, False, blocks, slots, num_bytes)


def drain_order(queue: TaskQueue) -> list[int]:
    order = []
    while (next_job := queue.pop_next()) is not None:
        order.append(next_job.job_id)
    return order


def test_a_load_overtakes_unrelated_stores():
    queue = TaskQueue()
    queue.push(store(1, [0], [0]))
    queue.push(store(2, [1], [1]))
    queue.push(load(3, [5], [7]))
    # the load touches neither slot 0/1 nor block 0/1: it runs first, then the stores in order
    assert drain_order(queue) == [3, 1, 2]


@pytest.mark.parametrize(
    "conflicting_load",
    [
        load(3, [1], [7]),
        load(3, [5], [1]),
        # reads the slot store 2 writes / writes the block it reads
    ],
    ids=["same-slot", "same-block"],
)
def test_a_load_waits_for_an_earlier_store_it_conflicts_with(conflicting_load):
    queue = TaskQueue()
    queue.push(store(1, [0], [0]))
    queue.push(store(2, [1], [1]))
    queue.push(conflicting_load)
    # store 2 must run before the load, and FIFO puts store 1 before store 2
    assert drain_order(queue) == [1, 2, 3]


def test_a_store_never_runs_before_an_earlier_load_it_conflicts_with():
    queue = TaskQueue()
    queue.push(store(1, [0], [0]))
    # blocked by store 1 (slot 0)
    queue.push(load(2, [0], [4]))
    # rewrites slot 0: after load 2
    queue.push(store(3, [9], [0]))
    assert drain_order(queue) == [1, 2, 3]


def test_batches_stop_before_a_conflict_with_the_batch_or_what_is_running():
    queue = TaskQueue()
    queue.push(store(1, [0], [0]))
    queue.push(store(2, [1], [1]))
    # writes slot 0 again: not beside store 1
    queue.push(store(3, [2], [0]))
    assert [j.job_id for j in queue.pop_batch(10, 100)] == [1, 2]
    # store 1 still copying: store 3 may not start beside it
    running = [store(1, [0], [0])]
    assert queue.pop_batch(10, 100, running=running) == []
    assert [j.job_id for j in queue.pop_batch(10, 100)] == [3]


def test_batches_respect_their_caps_and_drain_returns_the_rest_in_order():
    queue = TaskQueue()
    for i in range(6):
        queue.push(store(i, [i], [i], num_bytes=10))
    assert [j.job_id for j in queue.pop_batch(max_tasks=2, max_bytes=1000)] == [0, 1]
    assert [j.job_id for j in queue.pop_batch(max_tasks=10, max_bytes=15)] == [2, 3]
    queue.push(load(9, [50], [50]))
    assert [j.job_id for j in queue.drain()] == [4, 5, 9]
    assert len(queue) == 0 and queue.pop_next() is None
