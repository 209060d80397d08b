"""kvtier's connector scheduler side against vLLM's own `OffloadingConnector` scheduler side, on
one stream of scheduler calls (issue 37): the cost each adds to vLLM's scheduling thread.

Both connectors are built with role SCHEDULER from one `VllmConfig`/`KVCacheConfig` (a tiny
Llama's config, dummy weights: no engine, no GPU) and driven by a small scheduler of this file
that calls them as vLLM's `Scheduler` does (`on_new_request`, `get_num_new_matched_tokens`,
`update_state_after_alloc`, `get_external_cache_hit_sources`, `build_connector_meta`,
`request_finished_all_groups`, `update_connector_output`, `get_kv_connector_stats`,
`take_events`), with vLLM's own `Request`, `SchedulerOutput`, `KVCacheBlocks` and
`KVConnectorOutput` objects. The workload is GPU-like: 16-token blocks, 8,192 tokens per step
(chunked prefill), 64 (`--quick`) or 256 running requests, prompts of 1k, 16k and 128k tokens
whose first 3/4 is one of a few shared documents, 64-1,024 decoded tokens each. The engine's own
prefix cache is modelled as holding the 2 most recently used documents: the others are left to
the connector. Block ids come from a free list of this file.

No bytes move: every job a side plans is reported done by its "workers" (loads in the step that
planned them, stores one step later: kvtier's `KVTierWorkerMetadata`, vLLM's
`OffloadingWorkerMetadata` plus `finished_recving` for its asynchronous loads). This measures the
scheduler thread only. Events are on (`KVEventsConfig(enable_kv_cache_events=True)`), stats are
asked for at every step, as vLLM's scheduler does. Capacities are equal: vLLM's
`cpu_bytes_to_use` is set to what makes its `num_chunks` equal kvtier's slots, and both chunk
16 tokens (one block). Each side runs its defaults otherwise (kvtier: adaptive policy, sync loads,
cost-model load policy; vLLM: LRU, async loads).

    python benchmarks/bench_sched_side.py [--quick] [--rounds N] [--profile] [--kvtier-config JSON]
        [--extras]

The two sides run interleaved, `--rounds` times (order alternating), fresh connectors each run;
the figures are medians, with the spread of the per-round ratio. `--profile` adds a cProfile of
both sides (only inside the connector calls) on one more run each. Last line:
RESULT kvtier_us_per_step=<x> vllm_us_per_step=<y> ratio=<x/y> us_per_lookup_chunk=<z>
us_per_stored_chunk=<w> long_prompt_us_per_step=<v>
(v: the median decode step of one 128k-token request alone on the engine; the first decode step
completes the last prefill step's stores, a cost per chunk stored, shown beside it as the mean).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import hashlib
import io
import json
import logging
import pstats
import random
import statistics
import tempfile
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 16
# tokens per step (vLLM's max_num_batched_tokens on a GPU)
BUDGET = 8192
CALLS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "get_external_cache_hit_sources",
    "build_connector_meta",
    "request_finished",
    "update_connector_output",
    "get_kv_connector_stats",
    "take_events",
)
# the calls issue 37 names, which the per-step figures of the RESULT line sum; vLLM's scheduler
# also calls on_new_request, and get_external_cache_hit_sources when it logs stats (vllm serve)
CORE_CALLS = tuple(
    c for c in CALLS if c not in ("on_new_request", "get_external_cache_hit_sources")
)
# the engine's own prefix cache: the documents it still holds
LOCAL_DOCS = 2


@dataclass(frozen=True)
class Workload:
    num_requests: int
    max_running: int
    # (prompt tokens, share of the requests)
    lengths: tuple[tuple[int, float], ...]
    decode: tuple[int, int]
    # CPU capacity of each side, in 16-token chunks (4 KiB each on the tiny model)
    num_chunks: int
    docs_per_length: int = 4
    seed: int = 0
    # kvtier's kv_connector_extra_config beyond its capacity (`--kvtier-config`)
    kvtier_extra: tuple[tuple[str, object], ...] = ()
    # kvtier's extra features on (`--extras`): each request carries a tenant (`cache_salt`, two
    # tenants, each with a quota of 3/4 of the capacity) and client hints (its document's session,
    # a next turn within 30 s)
    extras: bool = False


@dataclass
class TraceRequest:
    req_id: str
    doc: tuple[int, int]
    doc_tokens: int
    prompt: list[int]
    outputs: list[int]
    # one per full block of prompt + outputs
    hashes: list[bytes]
    # `--extras`: the request's tenant and kv_transfer_params
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None


def chain(tokens: np.ndarray, parent: bytes) -> list[bytes]:
    """32-byte chained block hashes, as opaque to both connectors as vLLM's sha256 ones."""
    out = []
    data = tokens.astype(np.int32).tobytes()
    step = BLOCK * 4
    for start in range(0, len(data) - step + 1, step):
        parent = hashlib.sha256(parent + data[start : start + step]).digest()
        out.append(parent)
    return out


def make_trace(w: Workload) -> list[TraceRequest]:
    rng = random.Random(w.seed)
    gen = np.random.default_rng(w.seed)
    docs: dict[tuple[int, int], tuple[np.ndarray, list[bytes]]] = {}
    sizes = [n for n, _ in w.lengths]
    weights = [p for _, p in w.lengths]
    trace = []
    for i in range(w.num_requests):
        length = rng.choices(sizes, weights)[0]
        doc = (length, rng.randrange(w.docs_per_length))
        if doc not in docs:
            tokens = gen.integers(3, 32000, length * 3 // 4 // BLOCK * BLOCK)
            docs[doc] = (tokens, chain(tokens, b""))
        doc_tokens, doc_hashes = docs[doc]
        rest = gen.integers(3, 32000, length - len(doc_tokens) + rng.randint(*w.decode))
        num_suffix = length - len(doc_tokens)
        hashes = doc_hashes + chain(rest, doc_hashes[-1])
        salt = None
        params = None
        if w.extras:
            # a document is its tenant's (the hashes stand for salted ones: no tenant shares one)
            salt = f"tenant-{doc[1] % 2}"
            params = {"kvtier": {"session": f"doc-{doc[0]}-{doc[1]}", "next_turn_s": 30}}
        trace.append(
            TraceRequest(
                f"r{i}",
                doc,
                len(doc_tokens),
                doc_tokens.tolist() + rest[:num_suffix].tolist(),
                rest[num_suffix:].tolist(),
                hashes,
                salt,
                params,
            )
        )
    return trace


# -- the two connectors, built as vLLM builds them -------------------------------------------------


def model_dir(root: Path) -> Path:
    """A tiny Llama's config.json (the weights are vLLM's dummy ones): 2 layers, 2 KV heads of 16."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 1 << 18,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def configs(model: Path, transfer):
    import torch
    from vllm.config import CacheConfig, KVEventsConfig, LoadConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model_config = ModelConfig(
        model=str(model), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=1 << 18
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        # a GPU's block size (vLLM on CPU defaults to 128)
        cache_config=CacheConfig(block_size=BLOCK),
        load_config=LoadConfig(load_format="dummy"),
        kv_transfer_config=transfer,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    groups = [KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)]
    kv_cache_config = KVCacheConfig(num_blocks=1 << 21, kv_cache_tensors=[], kv_cache_groups=groups)
    return vllm_config, kv_cache_config


def build_kvtier(model: Path, num_chunks: int, extra: dict):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.integrations.vllm import kv_transfer_config
    from kvtier.integrations.vllm.connector import KVTierConnector

    # 2 layers x 2 x 16 tokens x 2 heads x 16 x 2 bytes = 4 KiB a chunk
    transfer = kv_transfer_config(**{**extra, "cpu_bytes": num_chunks * 4096})
    vllm_config, kv_cache_config = configs(model, transfer)
    conn = KVTierConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert conn.layout.num_slots == num_chunks, conn.layout.num_slots
    return conn


def build_vllm(model: Path, num_chunks: int, extra: dict):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    def transfer(cpu_bytes: int):
        extra = {"cpu_bytes_to_use": cpu_bytes, "block_size": BLOCK}
        return KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )

    # the chunk's aligned size, read from a probe spec: capacity in chunks equal to kvtier's
    probe = OffloadingSpecFactory.create_spec(build_offloading_config(*configs(model, transfer(1))))
    vllm_config, kv_cache_config = configs(model, transfer(num_chunks * probe.kv_bytes_per_chunk))
    conn = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert conn.scheduler.manager._num_chunks == num_chunks
    return conn


# -- each side's "workers": every planned job is done ----------------------------------------------


def kvtier_jobs(meta) -> tuple[list, list]:
    """(loads, stores) of a kvtier plan: (job id, request id, chunks) each."""
    plan = meta.plan
    loads = [(j.job_id, j.req_id, j.num_chunks) for j in plan.load_jobs + plan.async_load_jobs]
    stores = [(j.job_id, j.req_id, j.num_chunks) for j in plan.store_jobs]
    return loads, stores


def vllm_jobs(meta) -> tuple[list, list]:
    loads = [(i, j.req_id, len(j.dst_spec.block_ids)) for i, j in meta.load_jobs.items()]
    stores = [(i, j.req_id, len(j.src_spec.block_ids)) for i, j in meta.store_jobs.items()]
    return loads, stores


def kvtier_output(loads: list, stores: list, async_loads: set[str], slots: tuple[int, ...]):
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata
    from kvtier.jobs import JobResult

    results = [JobResult(job_id=j, num_bytes=n * 4096, seconds=n * 2e-7) for j, _, n in loads]
    results += [JobResult(job_id=j, num_bytes=n * 4096, seconds=n * 2e-7) for j, _, n in stores]
    meta = KVTierWorkerMetadata(results, slots)
    return KVConnectorOutput(finished_recving=async_loads or None, kv_connector_worker_meta=meta)


def vllm_output(loads: list, stores: list, async_loads: set[str], slots: tuple[int, ...]):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput

    meta = OffloadingWorkerMetadata(completed_jobs={j: 1 for j, _, _ in loads + stores})
    return KVConnectorOutput(finished_recving=async_loads or None, kv_connector_worker_meta=meta)


SIDES = {
    "kvtier": (build_kvtier, kvtier_jobs, kvtier_output),
    "vllm": (build_vllm, vllm_jobs, vllm_output),
}


# -- the driver: vLLM's Scheduler, reduced to the calls a connector sees ----------------------------


class Timed:
    """One side's connector, its calls timed (and profiled, given a profiler)."""

    def __init__(self, conn, profiler: cProfile.Profile | None = None):
        self.conn = conn
        self.profiler = profiler
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __call__(self, name: str, method: str, *args):
        fn = getattr(self.conn, method)
        if self.profiler is not None:
            self.profiler.enable()
        start = time.perf_counter()
        result = fn(*args)
        if name == "take_events":
            # vLLM's scheduler lists them (a generator on vLLM's side)
            result = list(result)
        self.seconds[name] += time.perf_counter() - start
        if self.profiler is not None:
            self.profiler.disable()
        self.calls[name] += 1
        return result

    def total(self, names: tuple[str, ...] = CALLS) -> float:
        return sum(self.seconds[n] for n in names)


@dataclass
class Scheduled:
    new_reqs: list
    cached_ids: list
    cached_blocks: list
    cached_computed: list
    cached_outputs: list
    num_tokens: dict


class MiniEngine:
    """Admits, schedules and finishes the trace's requests as vLLM's scheduler would, calling one
    side's connector; never preempts (the block pool is large)."""

    def __init__(
        self, side: str, trace: list[TraceRequest], max_running: int, num_chunks: int, timed: Timed
    ):
        _, self.jobs_of, self.output_of = SIDES[side]
        self.call = timed
        self.trace = deque(trace)
        self.by_id = {t.req_id: t for t in trace}
        self.max_running = max_running
        self.free_blocks = deque(range(1, 1 << 21))
        self.blocks: dict[str, list] = {}
        self.requests: dict = {}
        self.waiting: deque = deque()
        self.running: list = []
        self.parked: dict[str, int] = {}
        self.local_docs: OrderedDict = OrderedDict()
        self.finished_ids: set[str] = set()
        self.stores_done_next: list = []
        # the workers' slab size, in their first report (kvtier checks it)
        self.slots: tuple[int, ...] = (num_chunks,)
        self.steps = 0
        self.lookup_chunks = 0
        self.stored_chunks = 0
        self.hit_tokens = 0
        self.step_seconds: list[float] = []

    def run(self) -> None:
        while self.trace or self.waiting or self.running or self.parked:
            before = self.call.total(CORE_CALLS)
            self.step()
            self.step_seconds.append(self.call.total(CORE_CALLS) - before)

    def step(self) -> None:
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

        self._arrive()
        sched = Scheduled([], [], [], [], [], {})
        budget = self._schedule_running(sched, BUDGET)
        self._schedule_waiting(sched, budget)
        cached = CachedRequestData(
            req_ids=sched.cached_ids,
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=sched.cached_blocks,
            num_computed_tokens=sched.cached_computed,
            num_output_tokens=sched.cached_outputs,
        )
        out = SchedulerOutput(
            scheduled_new_reqs=sched.new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=sched.num_tokens,
            total_num_scheduled_tokens=sum(sched.num_tokens.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=self.finished_ids,
            free_encoder_mm_hashes=[],
        )
        self.finished_ids = set()
        meta = self.call("build_connector_meta", "build_connector_meta", out)
        for req_id, n in sched.num_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        self._sample(sched.num_tokens)
        self._report(meta)
        self.steps += 1

    def _arrive(self) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        while self.trace and len(self.requests) < self.max_running:
            t = self.trace.popleft()
            extra_args = None
            if t.kv_transfer_params is not None:
                extra_args = {"kv_transfer_params": t.kv_transfer_params}
            params = SamplingParams(
                max_tokens=len(t.outputs), ignore_eos=True, extra_args=extra_args
            )
            req = Request(
                t.req_id,
                list(t.prompt),
                params,
                None,
                cache_salt=t.cache_salt,
                block_hasher=self._hasher,
            )
            self.requests[t.req_id] = req
            self.waiting.append(req)
            self.call("on_new_request", "on_new_request", req)

    def _hasher(self, req) -> list[bytes]:
        hashes = self.by_id[req.request_id].hashes
        return hashes[len(req.block_hashes) : req.num_tokens // BLOCK]

    def _allocate(self, req_id: str, num_tokens: int) -> list[int]:
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        blocks = self.blocks.setdefault(req_id, [])
        new = [
            KVCacheBlock(self.free_blocks.popleft())
            for _ in range(-(-num_tokens // BLOCK) - len(blocks))
        ]
        blocks.extend(new)
        return [b.block_id for b in new]

    def _schedule_running(self, sched: Scheduled, budget: int) -> int:
        for req in self.running:
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            budget -= n
            new_ids = self._allocate(req.request_id, req.num_computed_tokens + n)
            sched.cached_ids.append(req.request_id)
            sched.cached_blocks.append((new_ids,) if new_ids else None)
            sched.cached_computed.append(req.num_computed_tokens)
            sched.cached_outputs.append(len(req.output_token_ids))
            sched.num_tokens[req.request_id] = n
        return budget

    def _local_hit(self, req_id: str) -> int:
        """The engine's own prefix cache: the documents it used last."""
        t = self.by_id[req_id]
        hit = t.doc_tokens if t.doc in self.local_docs else 0
        self.local_docs[t.doc] = True
        self.local_docs.move_to_end(t.doc)
        while len(self.local_docs) > LOCAL_DOCS:
            self.local_docs.popitem(last=False)
        return hit

    def _lookup(self, req) -> tuple[int, int, bool] | None:
        """(local, external tokens, load async) of a request that was never scheduled."""
        local = self._local_hit(req.request_id)
        self.lookup_chunks += max(0, (req.num_tokens - 1) // BLOCK - local // BLOCK)
        ext, is_async = self.call(
            "get_num_new_matched_tokens", "get_num_new_matched_tokens", req, local
        )
        if ext is None:
            return None
        return local, ext, is_async

    def _schedule_waiting(self, sched: Scheduled, budget: int) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.sched.output import NewRequestData
        from vllm.v1.request import RequestStatus

        for req in list(self.waiting):
            if budget <= 0:
                break
            found = (req.num_computed_tokens, 0, False)
            if req.num_computed_tokens == 0:
                found = self._lookup(req)
                if found is None:
                    continue
            local, ext, is_async = found
            num_new = 0 if is_async else min(req.num_tokens - local - ext, budget)
            self._allocate(req.request_id, local + ext + num_new)
            blocks = KVCacheBlocks((self.blocks[req.request_id],))
            self.call("update_state_after_alloc", "update_state_after_alloc", req, blocks, ext)
            if ext:
                self.hit_tokens += ext
                self.call(
                    "get_external_cache_hit_sources", "get_external_cache_hit_sources", req, ext
                )
            self.waiting.remove(req)
            if is_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.parked[req.request_id] = local + ext
                continue
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = local + ext
            budget -= num_new
            self.running.append(req)
            ids = [b.block_id for b in self.blocks[req.request_id]]
            sched.new_reqs.append(NewRequestData.from_request(req, (ids,)))
            sched.num_tokens[req.request_id] = num_new

    def _sample(self, num_tokens: dict) -> None:
        """The forward pass: a token for every request whose known tokens are all computed."""
        from vllm.v1.request import RequestStatus

        for req_id in num_tokens:
            req = self.requests[req_id]
            if req.num_computed_tokens < req.num_tokens:
                continue
            t = self.by_id[req_id]
            req.append_output_token_ids(t.outputs[len(req.output_token_ids)])
            if len(req.output_token_ids) < len(t.outputs):
                continue
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            ids = [b.block_id for b in self.blocks[req_id]]
            self.call("request_finished", "request_finished_all_groups", req, (ids,))
            self.free_blocks.extend(ids)
            del self.blocks[req_id]
            del self.requests[req_id]
            self.running.remove(req)
            self.finished_ids.add(req_id)

    def _report(self, meta) -> None:
        """The workers' output: this step's loads done, last step's stores done; then stats and
        events, as vLLM's `update_from_output` asks for them."""
        loads, stores = self.jobs_of(meta)
        self.stored_chunks += sum(n for _, _, n in stores)
        async_loads = {r for _, r, _ in loads if r in self.parked}
        output = self.output_of(loads, self.stores_done_next, async_loads, self.slots)
        self.slots = ()
        self.stores_done_next = stores
        self.call("update_connector_output", "update_connector_output", output)
        for req_id in async_loads:
            req = self.requests[req_id]
            # vLLM's _update_waiting_for_remote_kv: the last token is always computed
            req.num_computed_tokens = min(self.parked.pop(req_id), req.num_tokens - 1)
            self.waiting.appendleft(req)
        self.call("get_kv_connector_stats", "get_kv_connector_stats")
        self.call("take_events", "take_events")


# -- runs, rounds, profile --------------------------------------------------------------------------


def run_side(side: str, model: Path, trace: list, w: Workload, profiler=None) -> dict:
    extra = {}
    if side == "kvtier":
        extra = dict(w.kvtier_extra)
        if w.extras:
            # 4 KiB chunks
            extra.setdefault("tenant_quotas", {"*": w.num_chunks * 4096 * 3 // 4})
    conn = SIDES[side][0](model, w.num_chunks, extra)
    # the trace's millions of hashes out of the collector's reach: a full collection landed in
    # whichever call was running and moved a side's µs per step by 2x from run to run
    gc.collect()
    gc.freeze()
    try:
        engine = MiniEngine(side, trace, w.max_running, w.num_chunks, Timed(conn, profiler))
        engine.run()
    finally:
        conn.shutdown()
        gc.unfreeze()
    timed = engine.call
    return {
        "steps": engine.steps,
        "us_per_step": timed.total(CORE_CALLS) / engine.steps * 1e6,
        "us_per_step_all": timed.total() / engine.steps * 1e6,
        "us_per_call": {n: timed.seconds[n] / max(timed.calls[n], 1) * 1e6 for n in CALLS},
        "us_per_step_of": {n: timed.seconds[n] / engine.steps * 1e6 for n in CALLS},
        "us_per_lookup_chunk": timed.seconds["get_num_new_matched_tokens"]
        / max(engine.lookup_chunks, 1)
        * 1e6,
        "us_per_stored_chunk": (
            timed.seconds["build_connector_meta"] + timed.seconds["update_connector_output"]
        )
        / max(engine.stored_chunks, 1)
        * 1e6,
        "stored_chunks": engine.stored_chunks,
        "hit_tokens": engine.hit_tokens,
        "step_seconds": engine.step_seconds,
    }


def long_prompt(
    side: str, model: Path, length: int, num_decode: int, kvtier_extra=()
) -> tuple[float, float]:
    """µs per decode step of one request of `length` prompt tokens, alone on the engine: the median
    (a steady decode step) and the mean (with the first decode step, which completes the last
    prefill step's stores and takes their events: per chunk that moved, not per step)."""
    w = Workload(1, 1, ((length, 1.0),), (num_decode, num_decode), 1 << 14, seed=length)
    w = dataclasses.replace(w, kvtier_extra=kvtier_extra)
    result = run_side(side, model, make_trace(w), w)
    # the decode steps: after the last prefill chunk (8,192 tokens a step)
    first_decode = -(-length // BUDGET)
    decode = result["step_seconds"][first_decode:]
    return statistics.median(decode) * 1e6, statistics.mean(decode) * 1e6


def rounds(model: Path, trace: list, w: Workload, num_rounds: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {"kvtier": [], "vllm": []}
    for i in range(num_rounds):
        order = ["kvtier", "vllm"] if i % 2 == 0 else ["vllm", "kvtier"]
        for side in order:
            runs[side].append(run_side(side, model, trace, w))
        print(
            f"round {i + 1}: kvtier {runs['kvtier'][-1]['us_per_step']:.1f} µs/step, "
            f"vLLM {runs['vllm'][-1]['us_per_step']:.1f} µs/step",
            flush=True,
        )
    return runs


def median_of(runs: list[dict], key: str, sub: str | None = None) -> float:
    return statistics.median(r[key][sub] if sub else r[key] for r in runs)


def report_calls(runs: dict[str, list[dict]]) -> None:
    print(
        f"{'call':32} {'kvtier µs/call':>15} {'vLLM µs/call':>13} {'kvtier µs/step':>15} {'vLLM µs/step':>13}"
    )
    for name in CALLS:
        print(
            f"{name:32} {median_of(runs['kvtier'], 'us_per_call', name):15.1f} "
            f"{median_of(runs['vllm'], 'us_per_call', name):13.1f} "
            f"{median_of(runs['kvtier'], 'us_per_step_of', name):15.1f} "
            f"{median_of(runs['vllm'], 'us_per_step_of', name):13.1f}"
        )


def profile(model: Path, trace: list, w: Workload, top: int) -> None:
    for side in ("kvtier", "vllm"):
        profiler = cProfile.Profile()
        run_side(side, model, trace, w, profiler)
        for sort in ("cumulative", "tottime"):
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.strip_dirs().sort_stats(sort).print_stats(top)
            lines = text.getvalue().splitlines()
            start = next(i for i, line in enumerate(lines) if "ncalls" in line)
            print(f"-- profile {side}, by {sort} time (inside the connector calls only)")
            print("\n".join(line[:120] for line in lines[start:] if line.strip()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 running, 160 requests, 3 rounds")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3 quick, 5 full)")
    parser.add_argument("--profile", action="store_true", help="cProfile both sides once more")
    parser.add_argument("--top", type=int, default=25, help="profile lines per listing")
    parser.add_argument(
        "--kvtier-config",
        default="{}",
        help='JSON added to kvtier\'s kv_connector_extra_config, e.g. {"eviction_policy": "lru"}',
    )
    parser.add_argument(
        "--extras",
        action="store_true",
        help="kvtier's extra features on: tenants with quotas, client hints (curves and events are "
        "on in every run)",
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    lengths = ((1024, 0.8), (16384, 0.17), (131072, 0.03))
    # quick: 64 running, short decodes; else 256 running, long decodes
    quick = Workload(160, 64, lengths, (64, 256), 1 << 15)
    w = quick if args.quick else Workload(1000, 256, lengths, (256, 1024), 1 << 17)
    num_rounds = args.rounds or (3 if args.quick else 5)
    w = dataclasses.replace(
        w, kvtier_extra=tuple(json.loads(args.kvtier_config).items()), extras=args.extras
    )
    trace = make_trace(w)
    print(f"kvtier's extra config: {dict(w.kvtier_extra)}")
    if w.extras:
        print(
            "extras: 2 tenants (cache_salt) with tenant_quotas of 3/4 the capacity each, every "
            "request hinted (its document's session, next_turn_s 30)"
        )
    print(
        f"{w.num_requests} requests (prompts {'/'.join(str(n) for n, _ in lengths)} tokens, 3/4 a "
        f"shared document), {w.max_running} running, {w.decode[0]}-{w.decode[1]} decoded each; "
        f"{BUDGET} tokens a step, {BLOCK}-token blocks and chunks, {w.num_chunks} chunks of CPU "
        f"capacity each side; {num_rounds} interleaved rounds; no copies (scheduler thread only)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp) / "llama")
        runs = rounds(model, trace, w, num_rounds)
        report_calls(runs)
        for side in ("kvtier", "vllm"):
            r = runs[side][0]
            print(
                f"{side}: {r['steps']} steps, {r['hit_tokens']} tokens hit, "
                f"{r['stored_chunks']} chunks stored; µs per lookup chunk "
                f"{median_of(runs[side], 'us_per_lookup_chunk'):.2f}, per stored chunk "
                f"{median_of(runs[side], 'us_per_stored_chunk'):.2f}"
            )
        all_calls = {s: median_of(runs[s], "us_per_step_all") for s in runs}
        print(
            f"every call, on_new_request and get_external_cache_hit_sources too: kvtier "
            f"{all_calls['kvtier']:.1f} µs/step, vLLM {all_calls['vllm']:.1f} µs/step "
            f"({all_calls['kvtier'] / all_calls['vllm']:.2f}x)"
        )
        ratios = [
            k["us_per_step"] / v["us_per_step"]
            for k, v in zip(runs["kvtier"], runs["vllm"], strict=True)
        ]
        long = {}
        for side in ("kvtier", "vllm"):
            for n in (1024, 131072):
                long[side, n] = long_prompt(
                    side, model, n, 64 if args.quick else 256, w.kvtier_extra
                )
            print(
                f"{side}: one request alone, µs per decode step, median (mean with the first "
                f"decode step's store completion): 1k prompt {long[side, 1024][0]:.1f} "
                f"({long[side, 1024][1]:.1f}), 128k prompt {long[side, 131072][0]:.1f} "
                f"({long[side, 131072][1]:.1f})"
            )
        if args.profile:
            profile(model, trace, w, args.top)
    kvtier_us = median_of(runs["kvtier"], "us_per_step")
    vllm_us = median_of(runs["vllm"], "us_per_step")
    print(
        f"ratio per round: {' '.join(f'{r:.2f}' for r in ratios)} (median "
        f"{statistics.median(ratios):.2f}, spread {min(ratios):.2f}-{max(ratios):.2f})"
    )
    print(
        f"RESULT kvtier_us_per_step={kvtier_us:.1f} vllm_us_per_step={vllm_us:.1f} "
        f"ratio={kvtier_us / vllm_us:.2f} "
        f"us_per_lookup_chunk={median_of(runs['kvtier'], 'us_per_lookup_chunk'):.2f} "
        f"us_per_stored_chunk={median_of(runs['kvtier'], 'us_per_stored_chunk'):.2f} "
        f"long_prompt_us_per_step={long['kvtier', 131072][0]:.1f}"
    )


if __name__ == "__main__":
    main()
