"""A KVTierConnector whose worker fails loads while a flag file exists (tests only).

The flag path comes from the KVTIER_TEST_FAIL_LOADS environment variable, which the
engine's worker process inherits when it is spawned; the test creates and removes the
file to inject a failure at a chosen moment.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.integrations.vllm import KVTierConnector
from kvtier.integrations.vllm.worker_side import WorkerSide


class _FailingWorkerSide(WorkerSide):
    def start_load_kv(self, plan):
        flag = os.environ.get("KVTIER_TEST_FAIL_LOADS")
        if not (flag and Path(flag).exists() and plan.load_jobs):
            return super().start_load_kv(plan)
        # drop every load of this step: report all its chunks failed, copy nothing
        for job in plan.load_jobs:
            self._track(job)
            self._finish(job.job_id, set(range(job.num_chunks)))
        Path(flag).with_suffix(".seen").write_text(str(len(plan.load_jobs)))
        return None


class FaultyKVTierConnector(KVTierConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        if self._worker is not None:
            self._worker.__class__ = _FailingWorkerSide
