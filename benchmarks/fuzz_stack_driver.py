"""One configuration's random walk: the actions the stack fuzzer takes, and the faults it injects.

`Driver(stack, rng, redis).act()` takes one action, drawn with fixed weights: add a request,
step the engine (the most common), abort or preempt a request, empty the engine's own prefix
cache, reset kvtier, let the tiers catch up, let time pass (job and deferral deadlines), or
start a fault for a few steps. Requests share prefixes that end anywhere (mid-block,
mid-chunk), repeat earlier prompts, or opt out of loading or storing. Faults: stores or loads
delayed, stores stuck, loads failing, the disk full / failing reads / failing renames, the
Redis server paused, or killed and started again empty. `quiesce()` ends every fault, runs
every request to its end, then asks for earlier prompts again after emptying the engine's
cache before each (so what kvtier stored is loaded and checked), and waits for the tiers. An
`audit` does the same for one prompt while the walk goes on.

Issue 32's actions come from a generator of their own, drawn before the others, so a
configuration without its features walks as before: requests of several tenants; keepers
(requests asking to keep their own prompts, `fuzz_stack_build.keeper_hints`); an S3 store's PUTs
failing or slow; with two ranks, a fault on one rank alone; and the episodes of
`fuzz_stack_episodes` (a torn S3 batch, a reset while a put runs, a stalled tier and its recovery).
Every request's kind (plain, hinted, keeper) is kept in `kinds` for the checks (`fuzz_stack_owners`).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from fuzz_stack_build import BLOCK, KEEPER_PRIORITIES, FileFaults, Stack, keeper_hints
from fuzz_stack_episodes import Episodes
from fuzz_stack_owners import HINTED, KEEPER, PLAIN, EvictionLog, Owners
from fuzz_stack_remote import CEILING_S, first_of
from kvtier.sim.faults import Faults
from servers.redis import RedisServer

__all__ = ["Driver", "HangError"]

# requests in the engine at once at most
_MAX_LIVE = 6
# tier I/O on small chunks takes milliseconds: longer than this is a hang
_DRAIN_S = 10.0
_ACTIONS = {
    "add": 3.0,
    "step": 6.0,
    "abort": 0.3,
    "preempt": 0.3,
    "engine_reset": 0.3,
    "kvtier_reset": 0.08,
    "settle": 0.8,
    "time": 0.5,
    "fault": 0.4,
    "audit": 0.5,
}
# earlier prompts asked for again at the end, at most
_MAX_REPLAYS = 40
# prompts that keepers ask for (each of one tenant, at one priority)
_NUM_KEEPER_PROMPTS = 3
# on the workers' copies
_RANK_FAULTS = ("store_delay", "load_delay", "stuck_stores", "fail_load")


class HangError(RuntimeError):
    """Something that must end in bounded time did not (a tier job, a close)."""


@dataclass
class _Fault:
    name: str
    until_step: int
    # the workers whose copies it faults
    ranks: list[Faults] = field(default_factory=list)


@dataclass
class Driver:
    stack: Stack
    rng: random.Random
    redis: RedisServer | None
    # engine steps taken
    num_steps: int = 0
    # False once the Redis server was restarted empty
    remote_kept_values: bool = True
    prompts: list[list[int]] = field(default_factory=list)
    # req_id -> (kind, keeper priority)
    kinds: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    # what the episodes got to (`fuzz_stack_episodes`)
    reached: Counter[str] = field(default_factory=Counter)
    # the last action drained the tiers
    is_settled: bool = False
    _faults: list[_Fault] = field(default_factory=list)
    _next_id: int = 0

    def __post_init__(self) -> None:
        # hints and tenants come from a generator of their own, so they leave every other draw of
        # a seed's walk as it was before they existed (the walks that meet issue 20's defects)
        self._hint_rng = random.Random(self.stack.config.seed * 7919 + 3)
        # issue 32's draws: one more generator of their own, for the same reason
        self.new_rng = random.Random(self.stack.config.seed * 7919 + 5)
        rng = self.rng
        limit = self.max_tokens()
        self._prefixes = [[rng.randrange(1, 1000) for _ in range(limit)] for _ in range(3)]
        config = self.stack.config
        new_rng = self.new_rng
        # keepers' prompts: tokens of their own (no other request shares a block with them)
        self._keepers = [
            (
                [
                    new_rng.randrange(5000, 6000)
                    for _ in range(new_rng.randint(BLOCK + 1, limit - 2))
                ],
                new_rng.choice(config.tenants or (None,)),
                new_rng.choice(KEEPER_PRIORITIES),
            )
            for _ in range(_NUM_KEEPER_PROMPTS if config.keepers else 0)
        ]
        # several tenants: each prompt's, for replays
        self._salts: dict[tuple[int, ...], str | None] = {}
        self.owners = Owners(self.stack.engine, self.kinds)
        self.evictions = EvictionLog(self.stack.primary) if config.keepers else None
        self.episodes = Episodes(self)

    def max_tokens(self) -> int:
        """Tokens of a request at most (prompt and output): half the engine's cache, so two fit
        (every KV-cache group takes a block per position from one pool; one block is the null block)."""
        config = self.stack.config
        return ((config.num_blocks - 1) // (2 * len(config.groups()))) * BLOCK

    # -- actions ----------------------------------------------------------------------------

    def act(self) -> str:
        self.is_settled = False
        episode = self.episodes.draw()
        if episode is not None:
            return episode()
        if self._keepers and self.new_rng.random() < 0.1:
            self._keep()
            return "keep"
        action = self.rng.choices(list(_ACTIONS), weights=list(_ACTIONS.values()))[0]
        getattr(self, f"_{action}")()
        return action

    def is_full(self) -> bool:
        engine = self.stack.engine
        return len(engine.waiting) + len(engine.running) + len(engine.parked) >= _MAX_LIVE

    def new_id(self, name: str) -> str:
        self._next_id += 1
        return f"{name}{self._next_id}"

    def _add(self) -> None:
        engine = self.stack.engine
        rng = self.rng
        if self.is_full():
            return self._step()
        new_tokens = rng.randint(1, 3)
        if self.prompts and rng.random() < 0.3:
            # an earlier prompt again
            prompt = list(rng.choice(self.prompts))
        else:
            shared = rng.choice(self._prefixes)[: rng.randint(0, self.max_tokens() - 8)]
            prompt = shared + [
                rng.randrange(1000, 2000) for _ in range(rng.randint(1, 2 * BLOCK + 1))
            ]
        prompt = prompt[: self.max_tokens() - new_tokens]
        params = rng.choice(
            [None] * 8 + [{"kvtier": {"store": False}}, {"kvtier": {"load": False}}]
        )
        hint_rng = self._hint_rng
        # hints: kept, ranked, dropped chunks in every tier
        if params is None and hint_rng.random() < 0.4:
            params = {
                "kvtier": {
                    "session": hint_rng.choice(["s0", "s1"]),
                    "retain_s": hint_rng.choice([0, 0.05, 5]),
                    "priority": hint_rng.choice([-1, 0, 0, 2]),
                    "next_turn_s": hint_rng.choice([0, 1]),
                    "end_session": hint_rng.random() < 0.2,
                }
            }
        tenant = hint_rng.choice([None] * 9 + ["tenant-b"])
        if self.stack.config.tenants:
            tenant = self.new_rng.choice(self.stack.config.tenants)
            self._salts[tuple(prompt)] = tenant
        req_id = self.new_id("r")
        engine.add_request(
            req_id, prompt, max_new_tokens=new_tokens, kv_transfer_params=params, cache_salt=tenant
        )
        self.kinds[req_id] = (HINTED if params is not None and _has_hints(params) else PLAIN, None)
        self.prompts.append(prompt)
        return None

    def _keep(self) -> None:
        """A keeper asks for its prompt (retained an hour, at its priority; see `keeper_hints`)."""
        if self.is_full():
            return self._step()
        self.add_keeper(
            self.new_rng.choice(self._keepers), max_new_tokens=self.new_rng.randint(1, 2)
        )
        return None

    def add_keeper(
        self, keeper: tuple[list[int], str | None, int], max_new_tokens: int = 1
    ) -> None:
        prompt, tenant, priority = keeper
        req_id = self.new_id("k")
        self.stack.engine.add_request(
            req_id,
            prompt,
            max_new_tokens=max_new_tokens,
            kv_transfer_params=keeper_hints(priority),
            cache_salt=tenant,
        )
        self.kinds[req_id] = (KEEPER, priority)

    def step(self) -> None:
        self._step()

    def _step(self) -> None:
        self.stack.engine.step()
        self.stack.clock.now += 0.05
        self.num_steps += 1
        self._end_faults()
        if self.stack.config.lockstep and first_of({"quiet": self.stack.is_quiet}) is None:
            raise HangError(f"the tiers were not quiet {CEILING_S:.0f} s after a step")

    def _abort(self) -> None:
        engine = self.stack.engine
        live = [r.req_id for r in engine.waiting + engine.running] + list(engine.parked)
        if live:
            engine.abort(self.rng.choice(live))

    def _preempt(self) -> None:
        running = [r.req_id for r in self.stack.engine.running]
        if running:
            self.stack.engine.preempt(self.rng.choice(running))

    def _audit(self) -> None:
        """Empty the engine's cache and ask for an earlier prompt again: what kvtier holds of it is
        loaded, and every block checked, before it can be evicted unseen."""
        if self.prompts:
            self.stack.engine.reset_prefix_cache()
            self._add_prompt(list(self.rng.choice(self.prompts)), "audit")

    def _add_prompt(self, prompt: list[int], name: str) -> None:
        """An earlier prompt again, for its own tenant (several tenants) or none, without hints."""
        self.stack.engine.add_request(
            self.new_id(name), prompt, max_new_tokens=1, cache_salt=self._salts.get(tuple(prompt))
        )

    def _engine_reset(self) -> None:
        self.stack.engine.reset_prefix_cache()

    def _kvtier_reset(self) -> None:
        self.kvtier_reset()

    def kvtier_reset(self) -> None:
        # what the remote stores are given from now on is the new epoch's (`StoreWatch`)
        for watch in self.stack.watches.values():
            watch.new_epoch()
        self.stack.scheduler.reset_cache()

    def settle(self) -> None:
        self._settle()

    def _settle(self) -> None:
        """Let the tiers catch up. A paused server holds its tier's jobs until their timeouts, and a
        reset's sweep until the server answers again (retried, by design): only the end of the
        pause lets that drain, so it is not a hang; nor are slow S3 PUTs, held until their fault ends."""
        is_paused = self.redis is not None and self.redis.is_paused
        # slow S3 PUTs wait for the fault's end, as a paused server's requests wait for their timeout
        is_paused = is_paused or (
            self.stack.put_faults is not None and self.stack.put_faults.is_holding
        )
        self.is_settled = self.stack.drain(1.0 if is_paused else _DRAIN_S)
        if not self.is_settled and not is_paused:
            raise HangError(f"tier jobs still running after {_DRAIN_S:.0f} s")

    def _time(self) -> None:
        self.stack.clock.now += self.rng.choice([0.3, 1.0, 2.5])

    def _fault(self) -> None:
        stack = self.stack
        rng = self.rng
        names = ["store_delay", "load_delay", "stuck_stores", "fail_load"]
        if stack.disk is not None:
            names += [f"disk_{mode}" for mode in FileFaults.MODES]
        # a lockstep walk leaves out the faults whose effect depends on real time (`fuzz_stack_build`)
        is_timed = not stack.config.lockstep
        if stack.remote is not None and self.redis is not None and is_timed:
            names += ["redis_pause", "redis_restart"]
        if stack.s3 is not None and is_timed:
            names += ["s3_fail_put", "s3_slow_put"]
        name = rng.choice(names)
        if any(f.name == name for f in self._faults):
            return
        # with two ranks, a copy fault hits both, or one alone
        ranks = stack.rank_faults
        if name in _RANK_FAULTS and len(ranks) > 1:
            ranks = self.new_rng.choice([ranks, ranks[:1], ranks[1:]])
        fault = _Fault(name, self.num_steps + rng.randint(1, 6), ranks)
        self._start(fault)
        self._faults.append(fault)

    # -- faults -----------------------------------------------------------------------------

    def _start(self, fault: _Fault) -> None:
        if fault.name in _RANK_FAULTS:
            self._start_rank_fault(fault)
        else:
            self._start_tier_fault(fault.name)

    def _start_rank_fault(self, fault: _Fault) -> None:
        """A fault of the workers' copies, on each of `fault.ranks` (one draw for all of them)."""
        name = fault.name
        rng = self.rng
        if name == "store_delay":
            delay = rng.randint(1, 2)
            for faults in fault.ranks:
                faults.store_delay_steps = delay
        elif name == "load_delay":
            delay = rng.randint(1, 2)
            for faults in fault.ranks:
                faults.load_delay_steps = delay
        elif name == "stuck_stores":
            for faults in fault.ranks:
                faults.stuck_stores = True
        elif name == "fail_load":
            seed = rng.randrange(1 << 30)
            for faults in fault.ranks:
                faults.fail_load = lambda job: random.Random(seed ^ job.job_id).random() < 0.5

    def _start_tier_fault(self, name: str) -> None:
        """A fault of a secondary tier: its store's requests, its files, or its server."""
        if name == "s3_fail_put":
            self.stack.put_faults.fail_share = 0.5
        elif name == "s3_slow_put":
            self.stack.put_faults.slow_down()
        elif name.startswith("disk_"):
            self.stack.file_faults.mode = name.removeprefix("disk_")
        elif name == "redis_pause":
            self.redis.pause()
        elif name == "redis_restart":
            self.redis.stop()
            self.redis.start()
            self.remote_kept_values = False

    def _stop(self, fault: _Fault) -> None:
        name = fault.name
        for faults in fault.ranks:
            if name == "store_delay":
                faults.store_delay_steps = 0
            elif name == "load_delay":
                faults.load_delay_steps = 0
            elif name == "stuck_stores":
                faults.stuck_stores = False
            elif name == "fail_load":
                faults.fail_load = lambda job: False
        if name == "s3_fail_put":
            self.stack.put_faults.fail_share = 0.0
        elif name == "s3_slow_put":
            self.stack.put_faults.speed_up()
        elif name.startswith("disk_"):
            self.stack.file_faults.mode = None
        elif name == "redis_pause":
            self.redis.resume()

    def end_faults(self) -> None:
        self._end_faults(everything=True)

    def _end_faults(self, everything: bool = False) -> None:
        for fault in [f for f in self._faults if everything or f.until_step <= self.num_steps]:
            self._stop(fault)
            self._faults.remove(fault)

    # -- the end ------------------------------------------------------------------------------

    def quiesce(self) -> None:
        """End every fault, finish every request, ask for earlier prompts again, drain the tiers."""
        self._end_faults(everything=True)
        engine = self.stack.engine
        self._run_all()
        distinct = list({tuple(p): p for p in self.prompts}.values())
        for prompt in self.rng.sample(distinct, min(_MAX_REPLAYS, len(distinct))):
            # kvtier, not the engine's cache, serves what it holds
            engine.reset_prefix_cache()
            # what was written is there to be found
            self._settle()
            self._add_prompt(prompt, "again")
            self._run_all()
        # the keepers' prompts, as they asked for them
        for keeper in self._keepers:
            engine.reset_prefix_cache()
            self._settle()
            self.add_keeper(keeper)
            self._run_all()
        self._settle()
        # past every deadline: jobs a worker never reported expire
        self.stack.clock.now += 10.0
        self._run_all(at_least=2)
        self._settle()

    def run_all(self, at_least: int = 0) -> None:
        self._run_all(at_least)

    def _run_all(self, at_least: int = 0) -> None:
        engine = self.stack.engine
        for i in range(5000):
            if i >= at_least and not (engine.waiting or engine.running or engine.parked):
                return
            self._step()
        raise HangError("requests still unfinished after 5000 steps")


def _has_hints(params: dict) -> bool:
    """Whether a request's kv_transfer_params carry a hint (not only store/load opt-outs)."""
    return any(name not in ("store", "load") for name in params.get("kvtier", {}))
