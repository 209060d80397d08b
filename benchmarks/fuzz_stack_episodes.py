"""The stack fuzzer's episodes: short scripts inside the random walk that bring a remote tier to
the interleaving where issue 32's defects 4 and 5 lived, and check what is left afterwards.

Each waits for the condition it needs (a request held, the tier's answer), never for a time,
so a configuration's walk meets the same interleaving on any machine.

- **A torn S3 batch** (defect 4): the next PUT batch of two values or more has its first request
  fail once its second is running, and the second held. The tier must not report the job while
  that upload still reads the job's slab rows: the episode waits until the tier either reported
  it (the defect) or says its batch waits for the request still running (the fix); then runs a
  burst of new prompts, which takes every RAM slot it can (a slot given back is reused), releases
  the held upload, and reads every value of the namespace back: each must hold its own key's
  bytes (`fuzz_stack_remote.check_values`).
- **A reset while a put runs** (defect 5): the next put call of a remote tier (Redis or S3) is
  held; kvtier is reset; once the reset's sweep has listed the namespace (the defect: it did not
  wait for the job) or says it waits for the job (the fix), the put is released. When the tier is
  quiet, no value written before the reset may be left.
- **A stall, then recovery** (defect 2; configurations whose cost model measures, `measured`):
  RAM or the first secondary tier turns slow — its reads are reported as taking `STALL_FACTOR`
  times what recomputing their chunk takes (the copies or the tier's jobs, reported late: a
  slow device, with no real time spent) — for requests on prefixes it alone holds, until the
  cost model writes it off. Then it is fast again, and requests on other prefixes it alone holds
  come every `RECOVERY_GAP_S` fake seconds: within `RECOVERY_REQUESTS` of them, one must decide
  to load from it again, other than to explore it (the cost model explores a tier it wrote off
  and then trusts it again; before issue 32 nothing measured such a tier again, and no decision
  ever chose it).

`Episodes.draw()` picks one now and then (from the driver's own generator of issue 32's draws),
where the configuration has the tier it needs; `reached` counts how far each one got.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from fuzz_stack_checks import Violation
from fuzz_stack_remote import check_values, first_of, logged
from kvtier.keys import make_offload_key

if TYPE_CHECKING:
    from fuzz_stack_driver import Driver

__all__ = ["Episodes"]

S3_LOG = "kvtier.tiers.remote.s3"
RESET_LOG = "kvtier.tiers.remote.reset"
# of the actions, in a configuration that has the tier an episode needs
_EPISODE_SHARE = 0.01
# steps an episode waits for the store call it holds; then it gives up
_MAX_WAIT_STEPS = 60
# a stalled read takes this many times what recomputing its chunk takes
STALL_FACTOR = 2.5
# requests on the stalled tier at most, until the cost model writes it off
_STALL_REQUESTS = 4
# fake seconds between two requests after the stall
RECOVERY_GAP_S = 4.0
# requests after the stall by which the tier was loaded from again: the first exploration waits 3x
# the slow read (10 s at most), three explorations (one per request here) make it trusted again
RECOVERY_REQUESTS = 8


class Episodes:
    """The episodes of one driver's walk (see the module docstring)."""

    def __init__(self, driver: Driver):
        self.driver = driver
        self.stack = driver.stack

    def draw(self) -> Callable[[], str] | None:
        """An episode to run now, or None (most actions)."""
        stack = self.stack
        rng = self.driver.new_rng
        choices = []
        if stack.s3 is not None:
            choices.append(self.torn_batch)
        if stack.remote_tiers:
            choices.append(self.reset_during_put)
        if stack.config.load_costs == "measured":
            choices.append(self.stall)
        if not choices or rng.random() >= _EPISODE_SHARE * len(choices):
            return None
        return rng.choice(choices)

    # -- a torn S3 batch (issue 32, defect 4) -----------------------------------------------------

    def torn_batch(self) -> str:
        driver = self.driver
        stack = self.stack
        tier = stack.s3
        faults = stack.put_faults
        watch = stack.watches["s3"]
        self._quiet()
        armed: list[list[str]] = []

        def arm(names: list[str]) -> None:
            if not armed and len(names) >= 2:
                armed.append(names)
                faults.tear(names[0], names[1])

        errors_before = tier.stats().counters["errors"]
        with logged(S3_LOG, "still running") as batch_waits:
            watch.on_batch = arm
            try:
                self._fresh_request_until(lambda: bool(armed))
            finally:
                watch.on_batch = None
            if not armed:
                return self._reached("torn batch: no batch of two values")
            driver.reached["torn batch: armed"] += 1
            answer = first_of(
                {
                    "reported": lambda: tier.stats().counters["errors"] > errors_before,
                    "waits": batch_waits.is_set,
                }
            )
        if answer is None:
            faults.release_torn()
            raise _hang(
                "the torn S3 batch was neither reported nor said to wait for its held request"
            )
        driver.reached[f"torn batch: {answer}"] += 1
        # a slot given back to the tier is taken by one of these prompts' chunks
        self._burst()
        faults.release_torn()
        driver.settle()
        self._check_values("s3", with_epochs=False, when="after a torn batch")
        return "torn_batch"

    # -- a reset while a put runs (issue 32, defect 5) --------------------------------------------

    def reset_during_put(self) -> str:
        driver = self.driver
        stack = self.stack
        medium = driver.new_rng.choice(sorted(stack.watches))
        watch = stack.watches[medium]
        self._quiet()
        with logged(RESET_LOG, "waits for") as sweep_waits:
            watch.hold_next_put()
            try:
                self._fresh_request_until(watch.is_holding.is_set)
                if not watch.is_holding.is_set():
                    return self._reached(f"reset during a {medium} put: no put")
                driver.kvtier_reset()
                answer = first_of({"waits": sweep_waits.is_set, "listed": watch.listed.is_set})
            finally:
                watch.release()
        if answer is None:
            raise _hang(
                f"the {medium} tier's reset sweep neither listed its values nor waited for the held put"
            )
        driver.reached[f"reset during a {medium} put: sweep {answer}"] += 1
        driver.settle()
        self._check_values(medium, with_epochs=True, when="after a reset during a put")
        return "reset_during_put"

    # -- a stall, then recovery (issue 32, defect 2) ------------------------------------------------

    def stall(self) -> str:
        driver = self.driver
        stack = self.stack
        tier = stack.tiers[0] if stack.tiers else None
        medium = driver.new_rng.choice(["cpu"] if tier is None else ["cpu", tier.medium])
        self._quiet()
        per_chunk = stack.config.blocks_per_chunk * 4
        # RAM: one prefix, of three chunks where they fit; a tier: a prefix of one chunk per request
        num_chunks = (
            max(1, min(3, (driver.max_tokens() - 2) // per_chunk)) if medium == "cpu" else 1
        )
        prefixes = [
            [driver.new_rng.randrange(9000, 10000) for _ in range(num_chunks * per_chunk + 1)]
            for _ in range(1 if medium == "cpu" else _STALL_REQUESTS + RECOVERY_REQUESTS)
        ]
        if medium != "cpu" and not self._has_room(tier, len(prefixes)):
            return self._reached(f"stall of {medium}: no room for its prefixes")
        if medium == "cpu":
            if not self._in_ram(prefixes[0]):
                return self._reached("stall of cpu: its prefix not in RAM")
            stalled = prefixes * _STALL_REQUESTS
            healthy = prefixes * RECOVERY_REQUESTS
        else:
            if not self._only_in(tier, prefixes):
                return self._reached(f"stall of {medium}: its prefixes not in it alone")
            stalled = prefixes[:_STALL_REQUESTS]
            healthy = prefixes[_STALL_REQUESTS:]
        slow = _SlowReads(stack, medium, STALL_FACTOR * self._recompute_s())
        try:
            for prefix in stalled:
                self._serve(prefix, gap_s=RECOVERY_GAP_S)
                if self._chunk_s(medium) > self._recompute_s():
                    break
        finally:
            slow.end()
        if not self._chunk_s(medium) > self._recompute_s():
            return self._reached(f"stall of {medium}: not written off")
        driver.reached[f"stall of {medium}: written off"] += 1
        stats = stack.scheduler.stats
        for i, prefix in enumerate(healthy):
            # a decision to load from it that is not an exploration (RAM's explorations load too): the
            # cost model trusts it again. (Not the tokens loaded: a promotion lands in RAM in real time,
            # which a request that waits a few steps at most may not see.)
            num_loads = stats.load_decisions[("load", medium)]
            num_explorations = stats.explorations[medium]
            self._serve(prefix, gap_s=RECOVERY_GAP_S)
            if (
                stats.load_decisions[("load", medium)] > num_loads
                and stats.explorations[medium] == num_explorations
            ):
                driver.reached[f"stall of {medium}: loaded again after {i + 1} request(s)"] += 1
                return "stall"
        raise Violation(
            f"{medium}, written off by a stall, was not loaded from again in the {len(healthy)} requests "
            f"({len(healthy) * RECOVERY_GAP_S:.0f} fake seconds) after it was fast again"
        )

    def _recompute_s(self) -> float:
        costs = self.stack.scheduler.costs
        return self.stack.scheduler.config.tokens_per_chunk / costs.prefill.tokens_per_s()

    def _chunk_s(self, medium: str) -> float:
        """What the cost model expects one chunk from `medium` to take now (the tier jobs that ended applied)."""
        scheduler = self.stack.scheduler
        scheduler.manager.stats()
        return scheduler.costs.snapshot().read(medium).seconds_for(scheduler.config.chunk_bytes)

    def _serve(self, prompt: list[int], gap_s: float = 0.0) -> int:
        """One request on `prompt` (after `gap_s` fake seconds; the engine's own cache emptied, the
        tiers quiet); the tokens it loaded."""
        driver = self.driver
        stack = self.stack
        stack.clock.now += gap_s
        stack.engine.reset_prefix_cache()
        driver.settle()
        req = stack.engine.add_request(driver.new_id("s"), prompt, max_new_tokens=1)
        driver.run_all()
        driver.settle()
        return req.num_external_tokens

    def _has_room(self, tier, num_chunks: int) -> bool:
        """Whether `tier` holds `num_chunks` chunks beside those the burst pushing them out of RAM writes."""
        capacity = getattr(tier, "capacity_files", None)
        config = self.stack.config
        return capacity is None or capacity >= (num_chunks + config.num_slots) * len(
            config.groups()
        )

    def _in_ram(self, prefix: list[int]) -> bool:
        """Compute `prefix` (then a prompt of new tokens: a lazy store mode stores a chunk when the
        engine is about to evict it): True when RAM then holds each of its whole chunks (every
        request after this one finds them there)."""
        self._serve(prefix)
        self._serve(
            [self.driver.new_rng.randrange(8000, 9000) for _ in range(self.driver.max_tokens() - 1)]
        )
        return all(self.stack.primary.place(k) is not None for k in self._chunk_keys(prefix))

    def _only_in(self, tier, prefixes: list[list[int]]) -> bool:
        """Compute `prefixes` (offered as often as the tier's admission asks) and push them out of
        RAM with new prompts: True when `tier` then holds each of their whole chunks, and RAM none."""
        driver = self.driver
        stack = self.stack
        for prefix in prefixes:
            for _ in range(stack.config.min_offers):
                self._serve(prefix)
        self._burst()
        driver.settle()
        stack.manager.stats()
        for prefix in prefixes:
            keys = self._chunk_keys(prefix)
            if any(stack.primary.place(k) is not None for k in keys):
                return False
            if any(self._answer(tier, k) != "HIT" for k in keys):
                return False
        return True

    def _chunk_keys(self, prefix: list[int]) -> list:
        """The keys of `prefix`'s whole chunks (tenant none), in its first KV-cache group."""
        stack = self.stack
        bpc = stack.config.blocks_per_chunk
        hashes = stack.engine.hasher.hash_blocks(prefix)
        return [make_offload_key(hashes[(c + 1) * bpc - 1], 0) for c in range(len(hashes) // bpc)]

    @staticmethod
    def _answer(tier, key) -> str:
        """The tier's answer for `key` once it knows (a remote tier probes an unknown key first)."""
        answers: list[str] = []

        def known() -> bool:
            answers.append(tier.lookup(key).name)
            return answers[-1] != "RETRY"

        return answers[-1] if first_of({"known": known}) is not None else "RETRY"

    # -- helpers ----------------------------------------------------------------------------------

    def _quiet(self) -> None:
        """No fault on, nothing in flight: the episode's own request is the next to store."""
        self.driver.end_faults()
        if self.driver.redis is not None:
            self.driver.redis.resume()
        self.driver.settle()

    def _fresh_request_until(self, condition: Callable[[], bool]) -> None:
        """Add a plain request on new tokens (as long as two fit) and step until `condition` holds
        or a few steps after the request ended (its last stores, and the tiers' copies of them).
        After each step, wait until the condition holds or the tiers are quiet: what the tiers do
        with the step's jobs does not race the next step."""
        driver = self.driver
        stack = self.stack
        tokens = [driver.new_rng.randrange(7000, 8000) for _ in range(driver.max_tokens() - 1)]
        req = stack.engine.add_request(driver.new_id("e"), tokens, max_new_tokens=1)
        steps_after = 0
        for _ in range(_MAX_WAIT_STEPS):
            if condition() or steps_after > 3:
                return
            driver.step()
            if (
                first_of(
                    {"met": condition, "quiet": lambda: all(tier.drain(0) for tier in stack.tiers)}
                )
                is None
            ):
                raise _hang("the tiers neither went quiet nor reached the episode's point")
            steps_after += req.is_finished

    def _burst(self) -> None:
        """New prompts, more chunks than the CPU tier has slots, each run to its end."""
        driver = self.driver
        config = self.stack.config
        num_chunks = max(1, (driver.max_tokens() - 1) // (config.blocks_per_chunk * 4))
        for _ in range(config.num_slots // num_chunks + 2):
            tokens = [driver.new_rng.randrange(8000, 9000) for _ in range(driver.max_tokens() - 1)]
            driver.stack.engine.add_request(driver.new_id("b"), tokens, max_new_tokens=1)
            driver.run_all()

    def _check_values(self, medium: str, with_epochs: bool, when: str) -> None:
        """Every value of the tier's namespace holds its own key's bytes; with `with_epochs`, none
        from before the last reset is left (unless a request of it timed out: the server may have
        applied it after the client gave up, a case `kvtier.tiers.remote.reset` names)."""
        stack = self.stack
        tier = {"s3": stack.s3, "redis": stack.remote}[medium]
        watch = stack.watches[medium]
        if tier.stats().counters["timeouts"] or tier.breaker.is_open:
            self.driver.reached[f"{medium} values not checked {when}: a timeout"] += 1
            return
        epochs = watch.names_by_epoch if with_epochs else None
        problems = check_values(tier.store, tier.codec, epochs, watch.epoch)
        if problems:
            raise Violation(
                f"{medium} values {when}: {len(problems)} wrong: {'; '.join(problems[:3])}"
            )

    def _reached(self, what: str) -> str:
        self.driver.reached[what] += 1
        return what


class _SlowReads:
    """Reads of `medium` reported as taking `seconds` each (until `end()`): the worker's copies
    (RAM: the loads' results) or the tier's jobs (a secondary tier: its promotions' results), at
    the edge where their durations are measured. Nothing waits: a fake slow device."""

    def __init__(self, stack, medium: str, seconds: float):
        self._seconds = seconds
        self._undo: list[tuple[object, str]] = []
        if medium == "cpu":
            worker = stack.engine.worker
            loads = stack.engine.transfer.loads
            self._patch(
                worker,
                "take_results",
                lambda real: lambda: self._slow(real(), {j.job_id for j in loads}),
            )
        else:
            tier = next(t for t in stack.tiers if t.medium == medium)
            reads: set[int] = set()

            def submit_load(real):
                def submit(job):
                    reads.add(job.job_id)
                    return real(job)

                return submit

            self._patch(tier, "submit_load", submit_load)
            self._patch(tier, "get_finished", lambda real: lambda: self._slow(real(), reads))

    def _patch(self, obj: object, name: str, make: Callable) -> None:
        real = getattr(obj, name)
        setattr(obj, name, make(real))
        self._undo.append((obj, name))

    def _slow(self, results: list, read_ids: set[int]) -> list:
        return [
            dataclasses.replace(r, seconds=self._seconds) if r.job_id in read_ids else r
            for r in results
        ]

    def end(self) -> None:
        for obj, name in self._undo:
            # the class's method again
            delattr(obj, name)


def _hang(what: str) -> Exception:
    from fuzz_stack_driver import HangError

    return HangError(what)
