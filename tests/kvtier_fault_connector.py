"""A KVTierConnector whose worker fails loads while a flag file exists (tests only).

The flag path comes from the KVTIER_TEST_FAIL_LOADS environment variable, which the
engine's worker process inherits when it is spawned; the test creates and removes the
file to inject a failure at a chosen moment. The fault sits where a real one would: in
the transfer engine, which reports every chunk of such a load failed and copies nothing;
the real `WorkerSide` and connector handle the rest.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.integrations.vllm import KVTierConnector
from kvtier.jobs import TransferJob
from kvtier.worker import TransferEngine


class _LoadFailingTransferEngine(TransferEngine):
    def submit(self, job: TransferJob) -> None:
        flag = os.environ.get("KVTIER_TEST_FAIL_LOADS")
        if not (job.is_load and flag and Path(flag).exists()):
            return super().submit(job)
        seen = Path(flag).with_suffix(".seen")
        seen.write_text(str(int(seen.read_text() or 0) + 1) if seen.exists() else "1")
        return self._report(job.failed("injected load failure"))


class FaultyKVTierConnector(KVTierConnector):
    transfer_factory = _LoadFailingTransferEngine
