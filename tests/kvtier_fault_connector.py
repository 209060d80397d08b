"""KVTierConnectors whose worker fails loads, or makes them slow, while a flag file exists
(tests only).

The flag paths come from the KVTIER_TEST_FAIL_LOADS / KVTIER_TEST_SLOW_LOADS environment
variables, which the engine's worker process inherits when it is spawned; the test creates
and removes the file to inject the fault at a chosen moment. A slow load starts its copies
`SLOW_LOAD_S` after it was submitted, on a thread of its own (as a slow device would: the
engine's thread is never blocked by it). The fault sits where a real one would: in
the transfer engine, which reports every chunk of such a load failed and copies nothing;
the real `WorkerSide` and connector handle the rest.
"""

from __future__ import annotations

import os
import threading
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


SLOW_LOAD_S = 1.0


class _LoadDelayingTransferEngine(TransferEngine):
    def submit(self, job: TransferJob) -> None:
        flag = os.environ.get("KVTIER_TEST_SLOW_LOADS")
        if not (job.is_load and flag and Path(flag).exists()):
            return super().submit(job)
        Path(flag).with_suffix(".seen").write_text(str(job.req_id))
        threading.Timer(SLOW_LOAD_S, super().submit, [job]).start()
        return None


class SlowLoadKVTierConnector(KVTierConnector):
    transfer_factory = _LoadDelayingTransferEngine
