"""benchmarks/gpu_check.py on a machine without a GPU: it says so and claims no figure, and its
steps (round trips, the failed chunk, throughput, the per-run child) run through kvtier's CPU
backend with `--cpu-dry-run`, so a GPU machine's few minutes are not spent on the script's bugs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
# the dry run takes ~5 s here: a hang, not slowness
TIMEOUT_S = 300


def run_script(*argv: str) -> list[str]:
    """The script's output lines; it must exit 0. No CUDA device is visible to it."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.splitlines()


def test_without_a_gpu_it_says_so_and_claims_no_figure():
    lines = run_script()
    assert "no CUDA GPU found" in lines[0]
    assert lines[-1] == "RESULT skipped=no-gpu"


def test_dry_run_on_cpu_round_trips_every_layout_on_both_paths():
    lines = run_script("--cpu-dry-run")
    # 3 layouts x 2 dtypes x 2 block sizes, as built and again in the per-run child
    round_trips = [line for line in lines if "round trip" in line]
    assert len(round_trips) == 24
    assert all(": ok (" in line for line in round_trips), round_trips
    assert sum(line.startswith("  [per-run] round trip") for line in lines) == 12
    assert lines[-1] == "RESULT skipped=cpu-dry-run roundtrip_ok=1"
