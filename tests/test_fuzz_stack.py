"""The randomized full-stack checker (benchmarks/fuzz_stack.py), a bounded slice of it.

Random requests with shared prefixes, aborts, preemptions, resets and faults (stuck, slow and
failing copies; a full, failing or read-only disk; a paused or restarted Redis server) over
the real stack: the fake engine, the real `OffloadScheduler`, `TieredManager` (CPU tier in a
shared-memory slab, a real disk tier, a real Redis tier on a real `redis-server`),
`WorkerSide` and `TransferEngine`. Every configuration is drawn from a seed, so a failure
names the seed that reproduces it (`python benchmarks/fuzz_stack.py --configs 1 --seed S`
runs the configurations of seed S). `python benchmarks/fuzz_stack.py --minutes 30` is the
long run.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from fuzz_stack import run_fuzz, summary

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

SLICE_MINUTES = 1.5


def test_a_slice_of_the_stack_fuzzer_finds_nothing():
    lines: list[str] = []
    outcomes = run_fuzz(seed=20, minutes=SLICE_MINUTES, num_actions=250, out=lines.append)
    print("\n".join([*lines, summary(outcomes, None)]))
    failed = [o.line() for o in outcomes if o.kind is not None]
    assert not failed, "\n".join(failed)
    assert len(outcomes) >= 3 and sum(o.num_steps for o in outcomes) >= 200


# a seed whose walk meets each defect early (benchmarks/README.md lists how soon other seeds do)
MUTATION_SEEDS = {"defect1": 20, "defect2": 22, "defect3": 21, "defect4": 22}
MUTATION_CONFIGS = 300  # at most, of those the defect reaches: the seeds above needed 3-12 (2026-12-02)


@pytest.mark.parametrize("defect", sorted(MUTATION_SEEDS))
def test_the_fuzzer_finds_a_defect_put_back(defect):
    """Issue 20's defects 1-4 put back one at a time (benchmarks/fuzz_mutations.py): the checker
    that passes above fails — it has teeth."""
    outcomes = run_fuzz(seed=MUTATION_SEEDS[defect], max_configs=MUTATION_CONFIGS, num_actions=250,
                        mutation_name=defect, out=lambda line: None)
    assert any(o.kind is not None for o in outcomes), summary(outcomes, defect)
