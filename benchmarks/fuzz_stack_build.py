"""The stack the fuzzer drives, and the configuration it draws for it.

`FuzzConfig.draw(rng)` picks one configuration: store mode (eager, lazy), load mode (sync,
async), blocks per chunk (1, 2, 4), one full-attention group or a full and a sliding-window
group, the CPU tier's eviction policy (lru, arc, turns), which secondary tiers run (none, a
disk tier, a Redis tier, both) and how each is fed (write-through or on-evict, an admission
threshold), the sizes (CPU tier, engine cache, step budget) and the waiting budget (0 to 8
deferrals), and the load-or-recompute decision's figures (none, "always", or fixed costs that
make RAM, the disk or Redis fast or slow against recomputing, so requests load all, a head
or nothing of what they find). `Stack` builds it from the real classes — the fake engine and its real worker
(`WorkerSide`, `TransferEngine`) on a shared-memory slab, the real `OffloadScheduler`, a
`TieredManager` over a real `DiskTier` in a scratch directory and a real `RemoteTier` on a
real `redis-server` — and nothing here re-implements any of them. Faults are injected at the
edges only: the worker's copies (`kvtier.sim.faults`), the disk tier's file operations
(`FileFaults`, raising the errno a failing filesystem raises) and the Redis server (paused,
or killed and started again empty).
"""

from __future__ import annotations

import errno
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvtier.costmodel import CostSnapshot, ReadEstimate
from kvtier.scheduler import GroupKind, GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import FakeEngine, KVCache
from kvtier.sim.fake_engine import make_slab
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.redis import RedisStore
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.tiered import TieredManager

__all__ = ["BLOCK", "LOAD_COSTS", "FileFaults", "FakeClock", "FuzzConfig", "Stack"]

BLOCK = 4  # tokens per engine block


class FakeClock:
    """The scheduler's and the worker's clock: advanced by the fuzzer, one step at a time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class FuzzConfig:
    """One configuration of the stack (see the module docstring)."""

    seed: int
    store_mode: str
    load_mode: str
    blocks_per_chunk: int
    sliding_window: int | None  # tokens, for a second (sliding-window) group; None: one full group
    policy: str
    disk: str | None  # write mode of a disk tier, or None
    redis: str | None  # write mode of a Redis tier, or None
    min_offers: int
    num_slots: int
    num_blocks: int
    max_tokens_per_step: int
    max_deferrals: int
    evict_lookahead: int | None
    load_costs: str = "off"  # a key of `LOAD_COSTS`, or "off" (no decision: every found chunk loads)
    quotas: tuple[tuple[str, int], ...] = ()  # CPU-tier slots per tenant ("tenant-b", "*"), or none

    @classmethod
    def draw(cls, seed: int) -> FuzzConfig:
        rng = random.Random(seed)
        bpc = rng.choice([1, 2, 4])
        tiers = rng.choice([(None, None), ("write_through", None), ("on_evict", None), (None, "write_through"),
                            ("write_through", "write_through"), ("on_evict", "write_through"),
                            ("write_through", "on_evict")])
        window = rng.choice([None, None, None, 2 * BLOCK, 3 * BLOCK])
        # several KV-cache groups always load asynchronously (`kvtier.integrations.vllm.convert.load_mode_for`)
        load_mode = rng.choice(["sync", "async"]) if window is None else "async"
        return cls(seed=seed, store_mode=rng.choice(["eager", "lazy"]), load_mode=load_mode,
                   blocks_per_chunk=bpc, sliding_window=window,
                   policy=rng.choice(["lru", "arc", "turns"]), disk=tiers[0], redis=tiers[1],
                   min_offers=rng.choice([1, 1, 2]), num_slots=rng.randint(2, 6) * bpc,
                   num_blocks=rng.randint(12, 28) * (1 if window is None else 2),
                   max_tokens_per_step=rng.choice([5, 8, 16, 64]),
                   max_deferrals=rng.choice([0, 2, 8]), evict_lookahead=rng.choice([None, 1, 2, 4]),
                   # a generator of its own: the draws above stay what they were for every seed
                   load_costs=random.Random(seed * 7919 + 1).choice(["off", *LOAD_COSTS]),
                   quotas=random.Random(seed * 7919 + 2).choice([(), (), (("tenant-b", 1),), (("*", 2 * bpc),)]))

    def groups(self) -> tuple[GroupSpec, ...]:
        full = GroupSpec(tokens_per_block=BLOCK, blocks_per_chunk=self.blocks_per_chunk)
        if self.sliding_window is None:
            return (full,)
        window = GroupSpec(GroupKind.SLIDING_WINDOW, BLOCK, self.blocks_per_chunk, sliding_window=self.sliding_window)
        return (full, window)

    def describe(self) -> str:
        groups = "full" if self.sliding_window is None else f"full+window{self.sliding_window}"
        return (f"seed={self.seed} {self.store_mode}/{self.load_mode} bpc={self.blocks_per_chunk} {groups} "
                f"{self.policy} disk={self.disk} redis={self.redis} min_offers={self.min_offers} "
                f"slots={self.num_slots} blocks={self.num_blocks} step={self.max_tokens_per_step} "
                f"deferrals={self.max_deferrals} lookahead={self.evict_lookahead} costs={self.load_costs} "
                f"quotas={dict(self.quotas) or None}")


_FAST, _SLOW = ReadEstimate(1e12, 0.0), ReadEstimate(1e3, 0.1)
# fixed figures for the decision (prefill 1,000 tokens/s: a 4-token block takes 4 ms)
LOAD_COSTS: dict[str, tuple[str, CostSnapshot]] = {
    "always": ("always", CostSnapshot({"cpu": _FAST, "disk": _SLOW, "redis": _SLOW}, 1000.0)),
    "cost-fast": ("cost", CostSnapshot({"cpu": _FAST, "disk": _FAST, "redis": _FAST}, 1000.0)),
    "cost-slow-disk": ("cost", CostSnapshot({"cpu": _FAST, "disk": _SLOW, "redis": _FAST}, 1000.0)),
    "cost-slow-redis": ("cost", CostSnapshot({"cpu": _FAST, "disk": _FAST, "redis": _SLOW}, 1000.0)),
    "cost-slow-all": ("cost", CostSnapshot({"cpu": ReadEstimate(1e3, 0.0), "disk": _SLOW, "redis": _SLOW}, 1000.0)),
}

_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO, "erofs": errno.EROFS}
_METHODS = {"enospc": ("write_tmp",), "eio": ("read",), "erofs": ("publish", "discard_tmp")}


class FileFaults:
    """Makes a disk tier's file operations fail as a failing filesystem does, while `mode` is set:
    "enospc" (writes), "eio" (reads), "erofs" (the rename, and the cleanup after it)."""

    MODES = tuple(_METHODS)

    def __init__(self, files: object):
        self.mode: str | None = None
        self._files = files
        for method in {m for ms in _METHODS.values() for m in ms}:
            setattr(files, method, self._failing(method, getattr(files, method)))

    def _failing(self, method: str, real):
        def call(*args, **kwargs):
            mode = self.mode
            if mode is not None and method in _METHODS[mode]:
                raise OSError(_ERRNO[mode], f"injected {mode}")
            return real(*args, **kwargs)

        return call


class Stack:
    """The real kvtier stack of one configuration, driven by a fake engine (see the module docstring).

    Args:
        config: what to build.
        redis_url: a running `redis-server` (used when `config.redis` is set).
        tier_timeout_s: the tier jobs' deadline (the manager's `job_timeout_s`; real seconds).
    """

    def __init__(self, config: FuzzConfig, redis_url: str | None, tier_timeout_s: float = 2.0):
        self.config = config
        self.clock = FakeClock()
        self._tmp = tempfile.TemporaryDirectory(prefix="kvtier-fuzz-")
        kv = KVCache(len(config.groups()), config.num_blocks, BLOCK)
        self.slab = make_slab(kv, config.blocks_per_chunk, config.num_slots)
        slot_bytes = self.slab.rows.shape[1]
        namespace = Namespace(f"fuzz-{config.seed}", "float32", "sim", BLOCK, config.blocks_per_chunk, "sha256", 1,
                              slot_bytes)
        self.disk = self.remote = None
        self.file_faults: FileFaults | None = None
        tiers = []
        if config.disk is not None:
            self.disk = DiskTier(Path(self._tmp.name) / "disk", namespace, 3 * config.num_slots * (slot_bytes + 4096))
            self.disk.wait_scanned(10)
            self.file_faults = FileFaults(self.disk._files)
            tiers.append((self.disk, TierRules(config.disk, config.min_offers)))
        if config.redis is not None and redis_url is not None:
            store = RedisStore(redis_url, timeout_ms=300, connect_timeout_ms=200)
            self.remote = RemoteTier(store, namespace, prefix=f"fuzz-{config.seed}-{id(self)}", absent_ttl_s=0.05)
            tiers.append((self.remote, TierRules(config.redis, config.min_offers)))
        primary = CPUTierManager(config.num_slots, policy=config.policy, tenant_quotas=dict(config.quotas))
        self.manager = TieredManager(primary, [self.slab.rows], tiers, job_timeout_s=tier_timeout_s) if tiers \
            else primary
        policy, costs = LOAD_COSTS.get(config.load_costs, ("always", None))
        sched_config = SchedulerOffloadConfig(groups=config.groups(), max_deferrals=config.max_deferrals,
                                              max_defer_s=0.5, job_timeout_s=1.0, load_mode=config.load_mode,
                                              store_mode=config.store_mode, load_policy=policy,
                                              chunk_bytes=0 if costs is None else slot_bytes * len(config.groups()))
        self.scheduler = OffloadScheduler(sched_config, self.manager, clock=self.clock, costs=costs)
        self.engine = FakeEngine(self.scheduler, num_blocks=config.num_blocks, block_size=BLOCK,
                                 max_tokens_per_step=config.max_tokens_per_step, clock=self.clock, slab=self.slab,
                                 evict_lookahead=config.evict_lookahead)

    @property
    def tiers(self) -> list:
        return [t for t in (self.disk, self.remote) if t is not None]

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait for every tier job in flight; False when one is still running after `timeout`."""
        return all(tier.drain(timeout) for tier in self.tiers)

    def close(self) -> None:
        if self.file_faults is not None:
            self.file_faults.mode = None
        self.manager.close()
        self.engine.close()
        self._tmp.cleanup()
