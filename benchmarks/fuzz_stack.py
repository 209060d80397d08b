"""The randomized full-stack checker (issue 20, extended by issue 32): random requests, resets and
faults over the real kvtier stack, with its invariants checked after every step.

    python benchmarks/fuzz_stack.py --minutes 30            # the long run
    python benchmarks/fuzz_stack.py --minutes 2 --seed 7    # another walk
    python benchmarks/fuzz_stack.py --mutation defect1      # with one of issue 20's defects put back
    python benchmarks/fuzz_stack.py --mutation i32-defect4 --config-seed 523127052  # issue 32's, on its configuration
    python benchmarks/fuzz_stack.py --config-seed 157866499 # again the configuration a failure named

Each configuration (`fuzz_stack_build.FuzzConfig`, drawn from the run's seed) builds the real
stack — fake engine (one rank or two), `OffloadScheduler`, `TieredManager` (CPU tier in a
shared-memory slab, a disk tier, a Redis tier on a real `redis-server`, an S3 tier on a real
SeaweedFS), `WorkerSide` and `TransferEngine` — takes `--steps` random actions
(`fuzz_stack_driver`, and the episodes of `fuzz_stack_episodes`), checking the invariants of
`fuzz_stack_checks` after each, then runs to a quiet end, checks the rest, closes the tiers and
reads what the remote ones left. A configuration that fails is reported with its seed and the
action it failed at, and the run goes on with the next one. A hang is an action that did not end
in `--hang-s` seconds (all threads' stacks are printed), or a bounded wait that ran out.
A `lockstep` configuration walks the same way on every run: `--config-seed` replays it exactly.

Prints one line per configuration, then how often the episodes got where they go (`REACHED`), then
`RESULT steps=<n> configs=<n> mismatches=<n> hangs=<n> violations=<n> crashes=<n>` (steps:
engine steps taken; mismatches: wrong KV bytes seen by a token; violations: any other
invariant; crashes: an exception out of kvtier into the engine). With
`--mutation`, it stops at the first failure and adds `found=<kind> after_steps=<n>`.
Exit status 0 when nothing failed (or, with `--mutation`, when the defect was found).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import random
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_mutations import MUTATIONS, mutation, reaches
from fuzz_stack_build import FuzzConfig, Stack
from fuzz_stack_checks import Violation, check_closed, check_quiet, check_step
from fuzz_stack_driver import Driver, HangError
from fuzz_stack_remote import S3Server, obstore_faults
from kvtier.sim import ContentMismatch
from kvtier.tiers.remote.redis import RedisStore
from servers.redis import RedisServer

__all__ = ["Outcome", "run_config", "run_fuzz"]


@dataclass
class Outcome:
    """How one configuration ended: `kind` is None, "mismatch", "hang", "violation" or "crash";
    `reached`: what its episodes got to (`fuzz_stack_episodes`)."""

    config: FuzzConfig
    num_steps: int
    kind: str | None = None
    detail: str = ""
    reached: Counter[str] = field(default_factory=Counter)

    def line(self) -> str:
        verdict = "ok" if self.kind is None else f"{self.kind.upper()}: {self.detail}"
        return f"{self.config.describe()} steps={self.num_steps} {verdict}"


def run_config(
    config: FuzzConfig, redis: RedisServer | None, num_actions: int, s3: S3Server | None = None
) -> Outcome:
    """Build the stack of `config`, walk it `num_actions` random actions, then to a quiet end."""
    stack = Stack(config, redis.url if redis is not None else None, s3)
    driver = Driver(stack, random.Random(config.seed), redis)
    outcome = Outcome(config, 0)
    action = "build"
    try:
        for i in range(num_actions):
            action = f"action {i}"
            action += f" ({driver.act()})"
            check_step(stack, driver)
        action = "quiesce"
        driver.quiesce()
        check_step(stack, driver)
        check_quiet(stack, driver)
        action = "close"
        stack.close_tiers()
        check_closed(stack, lambda medium: _fresh_store(medium, redis, s3))
    except ContentMismatch as exc:
        outcome.kind = "mismatch"
        outcome.detail = f"at {action}: {exc}"
    except HangError as exc:
        outcome.kind = "hang"
        outcome.detail = f"at {action}: {exc}"
        faulthandler.dump_traceback(all_threads=True)
    except Violation as exc:
        outcome.kind = "violation"
        outcome.detail = f"at {action}: {exc}"
    # an engine-facing path raised: kvtier must never do that
    except Exception as exc:
        outcome.kind = "crash"
        outcome.detail = f"at {action}: {type(exc).__name__}: {exc} ({_where(exc)})"
    finally:
        outcome.num_steps = driver.num_steps
        outcome.reached = driver.reached
        if redis is not None:
            redis.resume()
        stack.close()
    return outcome


def _fresh_store(medium: str, redis: RedisServer | None, s3: S3Server | None):
    """A new store on the server of a tier (`check_closed` reads what the closed tier left)."""
    if medium == "s3" and s3 is not None:
        return s3.store()
    return RedisStore(redis.url, timeout_ms=2000)


def _where(exc: BaseException) -> str:
    """The innermost frame of `exc` in kvtier's own code."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/kvtier/" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def _run_guarded(
    config: FuzzConfig,
    redis: RedisServer | None,
    num_actions: int,
    hang_s: float,
    s3: S3Server | None = None,
) -> Outcome:
    """`run_config` on a thread of its own; a configuration that does not end in time is a hang
    (its thread is abandoned: daemon)."""
    box: list[Outcome] = []
    thread = threading.Thread(
        target=lambda: box.append(run_config(config, redis, num_actions, s3)), daemon=True
    )
    thread.start()
    thread.join(hang_s)
    if box:
        return box[0]
    faulthandler.dump_traceback(all_threads=True)
    if redis is not None:
        redis.resume()
    return Outcome(config, 0, "hang", f"did not end in {hang_s:.0f} s (threads' stacks above)")


def run_fuzz(
    *,
    seed: int,
    minutes: float | None = None,
    max_configs: int | None = None,
    num_actions: int = 300,
    mutation_name: str | None = None,
    hang_s: float = 300.0,
    config_seed: int | None = None,
    out=print,
) -> list[Outcome]:
    """Run configurations drawn from `seed` until `minutes` pass or `max_configs` ran (or, with a
    mutation, the first failure; only configurations where the mutated code runs are drawn then);
    `config_seed`: only the configuration a failure named. Returns their outcomes."""
    deadline = None if minutes is None else time.monotonic() + 60 * minutes
    rng = random.Random(seed)
    outcomes = []
    if config_seed is not None:
        max_configs = 1
    # started when a configuration first has an S3 tier
    s3 = S3Server()
    with (
        RedisServer.temporary(prefix="kvtier-bench-redis-") as redis,
        obstore_faults(),
        mutation(mutation_name),
        contextlib.closing(s3),
    ):
        while (deadline is None or time.monotonic() < deadline) and (
            max_configs is None or len(outcomes) < max_configs
        ):
            config = FuzzConfig.draw(rng.randrange(1 << 31) if config_seed is None else config_seed)
            if config_seed is None and not reaches(mutation_name, config):
                # a defect put back is looked for only where its code runs
                continue
            outcome = _run_guarded(config, redis, num_actions, hang_s, s3)
            outcomes.append(outcome)
            out(outcome.line())
            if mutation_name is not None and outcome.kind is not None:
                break
    return outcomes


def summary(outcomes: list[Outcome], mutation_name: str | None) -> str:
    count = {
        kind: sum(o.kind == kind for o in outcomes)
        for kind in ("mismatch", "hang", "violation", "crash")
    }
    line = (
        f"RESULT steps={sum(o.num_steps for o in outcomes)} configs={len(outcomes)} "
        f"mismatches={count['mismatch']} hangs={count['hang']} violations={count['violation']} "
        f"crashes={count['crash']}"
    )
    if mutation_name is not None:
        failed = next((o for o in outcomes if o.kind is not None), None)
        found = "none" if failed is None else failed.kind
        line += f" mutation={mutation_name} found={found} after_steps={sum(o.num_steps for o in outcomes)}"
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--minutes", type=float, default=None, help="run this long (default: 2, or --configs)"
    )
    parser.add_argument(
        "--configs", type=int, default=None, help="run this many configurations at most"
    )
    parser.add_argument("--steps", type=int, default=300, help="random actions per configuration")
    parser.add_argument(
        "--seed", type=int, default=20, help="the run's seed (configurations derive from it)"
    )
    parser.add_argument(
        "--mutation",
        choices=MUTATIONS,
        default=None,
        help="put one of issue 20's or 32's defects back",
    )
    parser.add_argument(
        "--hang-s", type=float, default=300.0, help="a configuration longer than this is a hang"
    )
    parser.add_argument(
        "--config-seed",
        type=int,
        default=None,
        help="run only the configuration of this seed (the `seed=` a failure printed)",
    )
    parser.add_argument("--quick", action="store_true", help="2 minutes")
    args = parser.parse_args()
    minutes = args.minutes
    if args.quick or (args.minutes is None and args.configs is None):
        minutes = 2.0
    outcomes = run_fuzz(
        seed=args.seed,
        minutes=minutes,
        max_configs=args.configs,
        num_actions=args.steps,
        mutation_name=args.mutation,
        hang_s=args.hang_s,
        config_seed=args.config_seed,
        out=lambda s: print(s, flush=True),
    )
    reached = sum((o.reached for o in outcomes), Counter())
    print("REACHED " + ", ".join(f"{what}: {n}" for what, n in sorted(reached.items())), flush=True)
    print(summary(outcomes, args.mutation), flush=True)
    failed = any(o.kind is not None for o in outcomes)
    return int(failed != (args.mutation is not None))


if __name__ == "__main__":
    sys.exit(main())
