"""Two tensor-parallel ranks under the fake engine, for the stack fuzzer.

`FakeEngine` runs one worker. With tensor parallelism vLLM runs one worker per rank, each with
its own KV tensors and its own host slab, and hands the scheduler every rank's job results (the
scheduler counts a job done once `num_workers` ranks acknowledged it). `add_second_rank(engine,
slab)` gives an engine a second rank made of the real classes: a second `KVCache`, a second
`WorkerSide` + `SimTransferEngine` on a second shared-memory slab. The engine then talks to both
through `Ranks`, which does what vLLM's executor does with its workers' outputs: every call goes
to each rank in turn, job results are concatenated, failed blocks are united, and a request's
asynchronous load has ended only once every rank reported it (vLLM's `KVOutputAggregator`).

Rank 1's KV bytes differ from rank 0's (`RANK1_MASK`), so a chunk loaded into the wrong rank, or
a rank's half stored in the other's slab, is a `ContentMismatch` like any other wrong byte. Each
rank has its own `Faults`: the fuzzer may slow or fail one rank only.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence

from kvtier.jobs import JobResult, StepPlan
from kvtier.sim import FakeEngine, KVCache
from kvtier.sim.faults import Faults, SimTransferEngine
from kvtier.slab import HostSlab
from kvtier.worker.side import WorkerSide

__all__ = ["RANK1_MASK", "Ranks", "TwoRankKV", "add_second_rank"]

# rank 1 holds `content ^ RANK1_MASK` where rank 0 holds `content` (contents are 56-bit digests)
RANK1_MASK = 0x2A5A_5A5A_5A5A_5A5A


class TwoRankKV:
    """The engine's "model" writes and checks both ranks' KV through this (the `KVCache` calls
    `FakeEngine`'s model makes); `tensors` are rank 0's, which the engine's first worker registered."""

    def __init__(self, rank0: KVCache, rank1: KVCache):
        self.ranks = (rank0, rank1)
        self.tensors = rank0.tensors
        self.layer_groups = rank0.layer_groups

    def content(self, block_hash: bytes, group: int) -> int:
        value = self.ranks[0].content(block_hash, group)
        # rank 1's name for its own value, for its error messages
        self.ranks[1]._names.setdefault(
            value ^ RANK1_MASK, f"block hash {block_hash.hex()[:12]}… of group {group} " "(rank 1)"
        )
        return value

    def write(self, group: int, block_ids: Sequence[int], contents: Sequence[int]) -> None:
        self.ranks[0].write(group, block_ids, contents)
        self.ranks[1].write(group, block_ids, [c ^ RANK1_MASK for c in contents])

    def check(
        self,
        req_id: str,
        group: int,
        positions: Sequence[int],
        block_ids: Sequence[int],
        contents: Sequence[int],
    ) -> None:
        self.ranks[0].check(req_id, group, positions, block_ids, contents)
        self.ranks[1].check(
            f"{req_id} (rank 1)", group, positions, block_ids, [c ^ RANK1_MASK for c in contents]
        )

    def check_unwritten(self, block_id: int, what: str) -> None:
        for rank, kv in enumerate(self.ranks):
            kv.check_unwritten(block_id, f"{what} (rank {rank})")


class _RanksTransfer:
    """What the engine and the fuzzer ask of "the" transfer engine: each rank's step ends
    (`end_step`); `loads` are rank 0's (every rank runs the same jobs)."""

    def __init__(self, transfers: Sequence[SimTransferEngine]):
        self.transfers = list(transfers)

    @property
    def loads(self) -> list:
        return self.transfers[0].loads

    def end_step(self) -> None:
        for transfer in self.transfers:
            transfer.end_step()


class Ranks:
    """The engine's workers, one per rank, behind `WorkerSide`'s interface (see the module docstring)."""

    def __init__(self, workers: Sequence[WorkerSide]):
        self.workers = list(workers)
        self.transfer = _RanksTransfer([w.transfer for w in self.workers])
        # asynchronous loads: ranks that reported each request
        self._load_reports: Counter[str] = Counter()
        self._load_failed: set[str] = set()

    def handle_preemptions(self, plan: StepPlan) -> None:
        for worker in self.workers:
            worker.handle_preemptions(plan)

    def start_load_kv(self, plan: StepPlan) -> None:
        for worker in self.workers:
            worker.start_load_kv(plan)

    def wait_for_layer_load(self, layer: str) -> None:
        for worker in self.workers:
            worker.wait_for_layer_load(layer)

    def finish_layered_loads(self) -> None:
        for worker in self.workers:
            worker.finish_layered_loads()

    def wait_for_save(self, plan: StepPlan) -> None:
        for worker in self.workers:
            worker.wait_for_save(plan)

    def take_load_errors(self) -> set[int]:
        return set().union(*(worker.take_load_errors() for worker in self.workers))

    def take_results(self) -> list[JobResult]:
        return [result for worker in self.workers for result in worker.take_results()]

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous load every rank has reported (failed: on any rank)."""
        for worker in self.workers:
            finished, failed = worker.take_finished_loads()
            self._load_reports.update(finished)
            self._load_failed |= failed
        done = {
            req_id for req_id, count in self._load_reports.items() if count == len(self.workers)
        }
        failed = done & self._load_failed
        for req_id in done:
            del self._load_reports[req_id]
        self._load_failed -= done
        return done, failed

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()


def add_second_rank(
    engine: FakeEngine, slab: HostSlab, faults: Faults, clock: Callable[[], float]
) -> None:
    """Give `engine` (one worker, built over a scheduler with `num_workers=2`) a second rank on
    `slab` (owned by the engine from now on: its `close` unlinks it), its copies faulted by `faults`,
    its deadlines read on `clock` (the engine's)."""
    first = engine.worker
    kv1 = KVCache(
        len(engine.groups),
        engine.kv.tensors[next(iter(engine.kv.tensors))].shape[0],
        engine.block_size,
    )
    second = WorkerSide(
        num_slots=first.num_slots,
        blocks_per_chunk=first.blocks_per_chunk,
        layer_groups=kv1.layer_groups,
        clock=clock,
        slab_name=slab.name,
        transfer_factory=functools.partial(SimTransferEngine, faults=faults),
    )
    second.register_kv_caches(kv1.tensors)
    engine.slabs.append(slab)
    engine.kv = TwoRankKV(engine.kv, kv1)
    engine.worker = Ranks([first, second])
    engine.transfer = engine.worker.transfer
