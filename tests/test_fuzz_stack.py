"""The randomized full-stack checker (benchmarks/fuzz_stack.py), a bounded slice of it.

Random requests with shared prefixes, aborts, preemptions, resets and faults (stuck, slow and
failing copies; a full, failing or read-only disk; a paused or restarted Redis server; failing,
slow and torn S3 uploads; a tier stalled, then fast again) over the real stack: the fake engine,
the real `OffloadScheduler`, `TieredManager` (CPU tier in a shared-memory slab, a real disk tier,
a real Redis tier on a real `redis-server`, a real S3 tier on SeaweedFS), `WorkerSide` and
`TransferEngine` (one rank or two), with tenants, quotas and hints. Every configuration is drawn
from a seed, so a failure names the seed that reproduces it (`python benchmarks/fuzz_stack.py
--config-seed S` runs it again). `python benchmarks/fuzz_stack.py --minutes 30` is the
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


# Issue 32's defects put back, each on one configuration (`--config-seed`) whose walk reaches the
# defect's code and the check that finds it: CPU-only or `lockstep` configurations, whose walk is the
# same on every run (found 2026-12-03; benchmarks/README.md lists them). The finding's text says which
# check found it, so a seed whose walk drifted away fails here instead of passing by another route.
I32_MUTATIONS = [
    # lazy stores, tenant-b's quota 1 below "*"'s 5: the defect charges its lazy stores to "", and it holds 3
    ("i32-defect1", 62483857, "tenant 'tenant-b' holds"),
    # RAM stalled then fast (two ranks): without exploration, no decision loads from it again
    ("i32-defect2", 95872739, "was not loaded from again"),
    # lazy stores of a keeper's chunks: the defect leaves them ordinary
    ("i32-defect3", 1048948905, "a keeper's chunk ('') ranks (0, 0)"),
    # a torn S3 batch reported at its failure: its held upload sends another chunk's bytes
    ("i32-defect4", 523127052, "payload checksum mismatch"),
    # a Redis put held across a reset: a sweep that does not wait for it leaves its value
    ("i32-defect5", 1830941901, "redis values after a reset during a put"),
    # the same on S3
    ("i32-defect5", 882552464, "s3 values after a reset during a put"),
]


@pytest.mark.parametrize("defect,config_seed,finding", I32_MUTATIONS, ids=[f"{d}-{s}" for d, s, _ in I32_MUTATIONS])
def test_the_fuzzer_finds_an_issue_32_defect_put_back_on_its_configuration(defect, config_seed, finding):
    (outcome,) = run_fuzz(seed=0, config_seed=config_seed, mutation_name=defect, out=lambda line: None)
    assert outcome.kind == "violation" and finding in outcome.detail, outcome.line()
