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
(`FileFaults`, raising the errno a failing filesystem raises), the Redis server (paused,
or killed and started again empty) and an S3 store's requests (`fuzz_stack_remote`).

Issue 32 added, each drawn from a generator of its own (so the draws above stay what they were
for every seed): an S3 tier on a real SeaweedFS; two tensor-parallel ranks (`fuzz_stack_ranks`:
two workers, two slabs, jobs acknowledged by both); several tenants with quotas in the CPU tier
(a named tenant below "*") and in the disk tier; and "keepers", requests that ask to keep their
own prompts (`keeper_hints`), whose chunks must outrank unhinted ones.

A configuration drawn `lockstep` waits after every engine step until its tiers are quiet (no
job in flight but those a fault holds, every existence probe answered; `Stack.is_quiet`), runs
one I/O thread per remote pool, remembers absent keys for the whole walk, and leaves out the
faults whose effect depends on real time (a paused or restarted server, slow or failing PUTs,
through timeouts and the circuit breaker's retry delay): its walk is the same on every run, so
a failure it finds replays exactly (`--config-seed`). The others keep the tiers' threads racing
the engine.
"""

from __future__ import annotations

import errno
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fuzz_stack_ranks import add_second_rank
from fuzz_stack_remote import PutFaults, S3Server, StoreWatch, attach_put_faults, detach_put_faults
from kvtier.costmodel import CostSnapshot, PrefillRate, ReadEstimate
from kvtier.scheduler import GroupKind, GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import FakeEngine, KVCache
from kvtier.sim.fake_engine import make_slab
from kvtier.sim.faults import Faults
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.disk.format import ChunkFormat
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.redis import RedisStore
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.tiered import TieredManager

__all__ = [
    "BLOCK",
    "KEEPER_PRIORITIES",
    "LOAD_COSTS",
    "TENANTS",
    "FileFaults",
    "FakeClock",
    "FuzzConfig",
    "Stack",
    "keeper_hints",
]

# tokens per engine block
BLOCK = 4
# requests' cache_salt where a configuration has several tenants
TENANTS = (
    None,
    "tenant-b",
    "tenant-c",
)
# a keeper's priority (above every other request's, which is 2 at most)
KEEPER_PRIORITIES = (1, 5)


def keeper_hints(priority: int) -> dict:
    """What a keeper request asks: keep its prompt's chunks for an hour, at `priority`."""
    return {"kvtier": {"retain_s": 3600, "priority": priority}}


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
    # tokens, for a second (sliding-window) group; None: one full group
    sliding_window: int | None
    policy: str
    # write mode of a disk tier, or None
    disk: str | None
    # write mode of a Redis tier, or None
    redis: str | None
    min_offers: int
    num_slots: int
    num_blocks: int
    max_tokens_per_step: int
    max_deferrals: int
    evict_lookahead: int | None
    # a key of `LOAD_COSTS`, "off" (no decision: every found chunk loads), or "measured" (the cost model
    # measures the tiers; the engine's prefill speed is fixed: `MEASURED_PREFILL_TOKENS_PER_S`)
    load_costs: str = "off"
    # CPU-tier slots per tenant ("tenant-b", "*"), or none
    quotas: tuple[tuple[str, int], ...] = ()
    # write mode of an S3 tier, or None
    s3: str | None = None
    # tensor-parallel ranks
    num_workers: int = 1
    # what requests draw their tenant from (): one in ten "tenant-b"
    tenants: tuple[str | None, ...] = ()
    # disk files per tenant, or none
    disk_quotas: tuple[tuple[str, int], ...] = ()
    # some requests ask to keep their own prompts (`keeper_hints`)
    keepers: bool = False
    # after each step, wait until the tiers are quiet (see `Stack.is_quiet`)
    lockstep: bool = False

    @classmethod
    def draw(cls, seed: int) -> FuzzConfig:
        rng = random.Random(seed)
        bpc = rng.choice([1, 2, 4])
        tiers = rng.choice(
            [
                (None, None),
                ("write_through", None),
                ("on_evict", None),
                (None, "write_through"),
                ("write_through", "write_through"),
                ("on_evict", "write_through"),
                ("write_through", "on_evict"),
            ]
        )
        window = rng.choice([None, None, None, 2 * BLOCK, 3 * BLOCK])
        # several KV-cache groups always load asynchronously (`kvtier.integrations.vllm.convert.load_mode_for`)
        load_mode = rng.choice(["sync", "async"]) if window is None else "async"
        # issue 32's fields: a generator of their own, so the draws above stay what they were for every seed
        extra = cls._draw_issue32(random.Random(seed * 7919 + 4), bpc, tiers[0] is not None)
        quotas = random.Random(seed * 7919 + 2).choice(
            [(), (), (("tenant-b", 1),), (("*", 2 * bpc),)]
        )
        return cls(
            seed=seed,
            store_mode=rng.choice(["eager", "lazy"]),
            load_mode=load_mode,
            blocks_per_chunk=bpc,
            sliding_window=window,
            policy=rng.choice(["lru", "arc", "turns"]),
            disk=tiers[0],
            redis=tiers[1],
            min_offers=rng.choice([1, 1, 2]),
            num_slots=rng.randint(2, 6) * bpc,
            num_blocks=rng.randint(12, 28) * (1 if window is None else 2),
            max_tokens_per_step=rng.choice([5, 8, 16, 64]),
            max_deferrals=rng.choice([0, 2, 8]),
            evict_lookahead=rng.choice([None, 1, 2, 4]),
            # a generator of its own: the draws above stay what they were for every seed
            **{
                "load_costs": random.Random(seed * 7919 + 1).choice(["off", *LOAD_COSTS]),
                "quotas": quotas,
                **extra,
            },
        )

    @staticmethod
    def _draw_issue32(rng: random.Random, bpc: int, has_disk: bool) -> dict:
        """Issue 32's fields: an S3 tier, two ranks, several tenants with quotas, keepers."""
        drawn = {
            "s3": rng.choice([None, None, "write_through", "on_evict"]),
            "num_workers": rng.choice([1, 1, 2]),
            "keepers": rng.random() < 0.5,
        }
        if rng.random() < 0.5:
            # several tenants: tenant-b may hold less than anyone else ("*"), tenant-c sometimes more
            small = rng.choice([1, bpc])
            quotas = [("tenant-b", small), ("*", small + rng.choice([1, bpc, 2 * bpc]))]
            if rng.random() < 0.5:
                quotas.insert(1, ("tenant-c", 8 * bpc))
            drawn["tenants"] = TENANTS
            drawn["quotas"] = tuple(quotas)
            if has_disk:
                drawn["disk_quotas"] = (("tenant-b", rng.choice([1, 2])), ("*", rng.choice([3, 6])))
        drawn["lockstep"] = rng.random() < 0.5
        if rng.random() < 0.25:
            drawn["load_costs"] = "measured"
        return drawn

    def groups(self) -> tuple[GroupSpec, ...]:
        full = GroupSpec(tokens_per_block=BLOCK, blocks_per_chunk=self.blocks_per_chunk)
        if self.sliding_window is None:
            return (full,)
        window = GroupSpec(
            GroupKind.SLIDING_WINDOW,
            BLOCK,
            self.blocks_per_chunk,
            sliding_window=self.sliding_window,
        )
        return (full, window)

    def describe(self) -> str:
        groups = "full" if self.sliding_window is None else f"full+window{self.sliding_window}"
        return (
            f"seed={self.seed} {self.store_mode}/{self.load_mode} bpc={self.blocks_per_chunk} {groups} "
            f"{self.policy} disk={self.disk} redis={self.redis} min_offers={self.min_offers} "
            f"slots={self.num_slots} blocks={self.num_blocks} step={self.max_tokens_per_step} "
            f"deferrals={self.max_deferrals} lookahead={self.evict_lookahead} costs={self.load_costs} "
            f"quotas={dict(self.quotas) or None} s3={self.s3} workers={self.num_workers} "
            f"tenants={len(self.tenants) or 'few'} disk_quotas={dict(self.disk_quotas) or None} "
            f"keepers={self.keepers} lockstep={self.lockstep}"
        )


_FAST = ReadEstimate(1e12, 0.0)
_SLOW = ReadEstimate(1e3, 0.1)
# fixed figures for the decision (prefill 1,000 tokens/s: a 4-token block takes 4 ms); S3 as Redis
LOAD_COSTS: dict[str, tuple[str, CostSnapshot]] = {
    "always": (
        "always",
        CostSnapshot({"cpu": _FAST, "disk": _SLOW, "redis": _SLOW, "s3": _SLOW}, 1000.0),
    ),
    "cost-fast": (
        "cost",
        CostSnapshot({"cpu": _FAST, "disk": _FAST, "redis": _FAST, "s3": _FAST}, 1000.0),
    ),
    "cost-slow-disk": (
        "cost",
        CostSnapshot({"cpu": _FAST, "disk": _SLOW, "redis": _FAST, "s3": _FAST}, 1000.0),
    ),
    "cost-slow-redis": (
        "cost",
        CostSnapshot({"cpu": _FAST, "disk": _FAST, "redis": _SLOW, "s3": _SLOW}, 1000.0),
    ),
    "cost-slow-all": (
        "cost",
        CostSnapshot(
            {"cpu": ReadEstimate(1e3, 0.0), "disk": _SLOW, "redis": _SLOW, "s3": _SLOW}, 1000.0
        ),
    ),
}

# "measured": a chunk of 4 tokens takes 0.4 s to recompute, so a tier read (micro- to milliseconds
# here) is worth loading on any machine, until a stall makes it look slower (`fuzz_stack_episodes`)
MEASURED_PREFILL_TOKENS_PER_S = 10.0

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
        s3: the run's S3 server (used when `config.s3` is set).
        tier_timeout_s: the tier jobs' deadline (the manager's `job_timeout_s`; real seconds).
    """

    def __init__(
        self,
        config: FuzzConfig,
        redis_url: str | None,
        s3: S3Server | None = None,
        tier_timeout_s: float = 2.0,
    ):
        self.config = config
        if config.lockstep:
            # a job's real duration never decides anything: only a hang expires it
            tier_timeout_s = 30.0
        self.clock = FakeClock()
        self._is_closed = False
        self._tmp = tempfile.TemporaryDirectory(prefix="kvtier-fuzz-")
        kv = KVCache(len(config.groups()), config.num_blocks, BLOCK)
        slabs = [
            make_slab(kv, config.blocks_per_chunk, config.num_slots)
            for _ in range(config.num_workers)
        ]
        self.slab = slabs[0]
        slot_bytes = self.slab.rows.shape[1]
        self.namespace = Namespace(
            f"fuzz-{config.seed}",
            "float32",
            "sim",
            BLOCK,
            config.blocks_per_chunk,
            "sha256",
            config.num_workers,
            slot_bytes,
        )
        self.disk = None
        self.remote = None
        self.s3 = None
        self.file_faults: FileFaults | None = None
        # by medium: the remote tiers' stores, watched
        self.watches: dict[str, StoreWatch] = {}
        # the S3 store's requests
        self.put_faults: PutFaults | None = None
        tiers = []
        if config.disk is not None:
            self.disk = self._disk_tier(Path(self._tmp.name) / "disk")
            tiers.append((self.disk, TierRules(config.disk, config.min_offers)))
        if config.redis is not None and redis_url is not None:
            store = RedisStore(redis_url, timeout_ms=300, connect_timeout_ms=200)
            self.watches["redis"] = StoreWatch(store)
            self.remote = RemoteTier(
                store,
                self.namespace,
                prefix=f"fuzz-{config.seed}-{id(self)}",
                **self._remote_options(),
            )
            tiers.append((self.remote, TierRules(config.redis, config.min_offers)))
        if config.s3 is not None and s3 is not None:
            self.s3 = self._s3_tier(s3)
            tiers.append((self.s3, TierRules(config.s3, config.min_offers)))
        primary = CPUTierManager(
            config.num_slots, policy=config.policy, tenant_quotas=dict(config.quotas)
        )
        self.manager = primary
        if tiers:
            self.manager = TieredManager(
                primary, [slab.rows for slab in slabs], tiers, job_timeout_s=tier_timeout_s
            )
        self.primary = primary
        unlisted = ("cost" if config.load_costs == "measured" else "always", None)
        policy, costs = LOAD_COSTS.get(config.load_costs, unlisted)
        is_weighed = costs is not None or config.load_costs == "measured"
        chunk_bytes = slot_bytes * len(config.groups()) * config.num_workers if is_weighed else 0
        sched_config = SchedulerOffloadConfig(
            groups=config.groups(),
            max_deferrals=config.max_deferrals,
            max_defer_s=0.5,
            job_timeout_s=1.0,
            load_mode=config.load_mode,
            store_mode=config.store_mode,
            load_policy=policy,
            chunk_bytes=chunk_bytes,
            num_workers=config.num_workers,
        )
        self.scheduler = OffloadScheduler(sched_config, self.manager, clock=self.clock, costs=costs)
        # the fake engine's steps are no measure of a prefill
        if config.load_costs == "measured":
            self.scheduler.costs.prefill = PrefillRate(
                prior_tokens_per_s=MEASURED_PREFILL_TOKENS_PER_S
            )
        self.engine = FakeEngine(
            self.scheduler,
            num_blocks=config.num_blocks,
            block_size=BLOCK,
            max_tokens_per_step=config.max_tokens_per_step,
            clock=self.clock,
            slab=self.slab,
            evict_lookahead=config.evict_lookahead,
        )
        # every rank's copies, faulted alike or one rank alone (`Driver`)
        self.rank_faults = [self.engine.faults]
        for slab in slabs[1:]:
            self.rank_faults.append(Faults())
            add_second_rank(self.engine, slab, self.rank_faults[-1], self.clock)

    def _disk_tier(self, directory: Path) -> DiskTier:
        config = self.config
        file_bytes = ChunkFormat(b"", self.namespace.payload_bytes).file_bytes
        quotas = {tenant: files * file_bytes for tenant, files in config.disk_quotas}
        disk = DiskTier(
            directory, self.namespace, 3 * config.num_slots * file_bytes, tenant_quotas=quotas
        )
        disk.wait_scanned(10)
        self.file_faults = FileFaults(disk._files)
        return disk

    def _s3_tier(self, s3: S3Server) -> RemoteTier:
        # a loaded machine's SeaweedFS may take a second to answer: 2 s before a request is a timeout
        store = s3.store(timeout_ms=2000, connect_timeout_ms=1000, max_connections=4)
        self.put_faults = PutFaults(self.config.seed)
        attach_put_faults(store, self.put_faults)
        self.watches["s3"] = StoreWatch(store)
        return RemoteTier(
            store,
            self.namespace,
            prefix=f"fuzz-{self.config.seed}-{id(self)}",
            **self._remote_options(),
        )

    def _remote_options(self) -> dict:
        # jobs end in the order they were given; an absence is not re-asked by time
        if self.config.lockstep:
            return {"absent_ttl_s": 3600.0, "io_threads": 1}
        return {"absent_ttl_s": 0.05}

    @property
    def tiers(self) -> list:
        return [t for t in (self.disk, self.remote, self.s3) if t is not None]

    @property
    def remote_tiers(self) -> list[RemoteTier]:
        return [t for t in (self.remote, self.s3) if t is not None]

    def is_quiet(self) -> bool:
        """No tier job in flight (in a tier where the fuzzer holds a store call: never mind its jobs),
        no existence probe of a remote tier unanswered. (Read from the tiers' private state: no
        public call says whether a probe is under way.)"""
        held = {medium for medium, watch in self.watches.items() if watch.is_holding.is_set()}
        if self.put_faults is not None and self.put_faults.is_holding:
            held.add("s3")
        for tier in self.tiers:
            if tier.medium not in held and not tier.drain(0):
                return False
        for tier in self.remote_tiers:
            with tier._cond:
                if tier._keys._probing:
                    return False
        return True

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait for every tier job in flight; False when one is still running after `timeout`."""
        return all(tier.drain(timeout) for tier in self.tiers)

    def end_faults(self) -> None:
        """Every fault at the stores' edge off, every held request on its way."""
        if self.file_faults is not None:
            self.file_faults.mode = None
        if self.put_faults is not None:
            self.put_faults.end()
        for watch in self.watches.values():
            watch.release()

    def close_tiers(self) -> None:
        """Close the manager and its tiers (idempotent): their threads and requests end first."""
        if not self._is_closed:
            self._is_closed = True
            self.end_faults()
            self.manager.close()

    def close(self) -> None:
        self.close_tiers()
        self.engine.close()
        if self.s3 is not None:
            detach_put_faults(self.s3.store)
        self._tmp.cleanup()
