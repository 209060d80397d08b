"""The served soak: vLLM's OpenAI-compatible server with kvtier (CPU + disk + Redis tiers), under faults.

`python benchmarks/soak.py` runs it (main.py says what it checks); tests/test_soak.py runs its
quick variant through the names below. The modules, in the order a run uses them:

- `config.py`: `SoakConfig` (`FULL`, `QUICK`): the workload, requests per run, tiers, bounds.
- `serving.py`: `ServedEngine`, one vLLM server (stock, or with kvtier) as a subprocess.
- `disk.py`: the kvtier server's disk directory (its Redis server: benchmarks/servers/redis.py).
- `stack.py`: the baseline server; the kvtier server with its tiers (`open_stack`, `close_stack`).
- `workload.py`: the conversations, the clients that replay them, the memory sampler.
- `faults.py`: the faults (`FAULTS`), one per run, and each one's checks.
- `run.py`: one run on a stack (`run_fault`): the clients, the fault, the shared checks.
- `report.py`: `Check`, `RunReport`: what a run found.
- `main.py`: the command line, the tables it prints.
- `breaks/`: a `sitecustomize` that takes one of kvtier's defences out of the soak's servers
  (PYTHONPATH=benchmarks/soak/breaks; see docs/reliability.md).
"""

from __future__ import annotations

from .config import FULL, QUICK, SoakConfig
from .faults import FAULTS, Fault
from .main import main, table
from .report import Check, RunReport
from .run import run_fault
from .stack import close_stack, open_stack, start_baseline
from .workload import baseline_outputs

__all__ = [
    "FAULTS",
    "FULL",
    "QUICK",
    "Check",
    "Fault",
    "RunReport",
    "SoakConfig",
    "baseline_outputs",
    "close_stack",
    "main",
    "open_stack",
    "run_fault",
    "start_baseline",
    "table",
]
