"""Equal CPU binding for A/B runs of vLLM on CPU, and a check that it held.

vLLM on CPU binds each worker's OpenMP threads to cores and reserves some for its own
processes: one per worker, plus one more per worker whenever a KV connector is configured
(`vllm/utils/ompmultiprocessing.py`, "reserve one more core for nixl_connector"). On a
2-core machine that reservation equals the core count, vLLM falls back to reserving none,
and an engine *with* a connector computes on 2 threads where the same engine without one
gets 1: identical prefills ran 1.86x faster on the kvtier engine for that reason alone.
So every comparison pins the reservation (`pin_reserved_cpus`) and checks the core ids
each engine logged (`CoreBindingLog`).
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

__all__ = ["RESERVED_CPUS_ENV", "CoreBindingLog", "pin_reserved_cpus"]

RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
_CORE_IDS = re.compile(r"local_rank=(\d+), core ids=\[([\d, ]*)\]")


def pin_reserved_cpus(num_reserved: int = 1) -> str:
    """Reserve the same cores for every engine this process starts (unless the user chose).

    1 is what vLLM reserves for an engine without a connector: the baseline is stock vLLM.
    Returns the value in force.
    """
    os.environ.setdefault(RESERVED_CPUS_ENV, str(num_reserved))
    return os.environ[RESERVED_CPUS_ENV]


class CoreBindingLog:
    """vLLM's log, also written to `path`, to read the core ids each engine bound to.

    Construct it before the first engine starts: vLLM's processes read the logging config
    (`VLLM_LOGGING_CONFIG_PATH`) when they import vllm. The console output stays as it was.
    With `install=False` it only reads `path`, a log that the caller captures itself (e.g.
    every process's stdout and stderr, as `kvtier demo` does), from its current end on.
    """

    def __init__(self, path: Path, install: bool = True):
        self.path = Path(path)
        self._read = 0
        if not install:
            if self.path.exists():
                self._read = len(self.path.read_text(errors="replace"))
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        config_path = self.path.with_suffix(".logging.json")
        config_path.write_text(json.dumps(self._config()))
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)

    def _config(self) -> dict:
        from vllm.logger import DEFAULT_LOGGING_CONFIG

        config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
        config["handlers"]["kvtier_file"] = {
            "class": "logging.FileHandler",
            "formatter": "vllm",
            "filename": str(self.path),
            "mode": "a",
        }
        config["loggers"]["vllm"]["handlers"].append("kvtier_file")
        return config

    def next_engine_core_ids(self) -> list[list[int]]:
        """Core ids per worker of the engine that started since the previous call.

        Raises:
            RuntimeError: no binding was logged (nothing to compare: the check cannot pass).
        """
        text = self.path.read_text(errors="replace")
        new, self._read = text[self._read :], len(text)
        ranks: dict[int, list[int]] = {}
        for rank, ids in _CORE_IDS.findall(new):
            ranks[int(rank)] = [int(i) for i in ids.replace(" ", "").split(",") if i]
        if not ranks:
            raise RuntimeError(
                f"no 'core ids=' line in vLLM's log {self.path}: cannot check the engines' binding"
            )
        return [ranks[r] for r in sorted(ranks)]
