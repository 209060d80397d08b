"""KVTierConnectors whose worker fails loads, or makes them slow — or, for the served soak
(benchmarks/soak.py), leaves stores stuck or reports jobs late — while a flag file exists
(tests only).

The flag paths come from the KVTIER_TEST_FAIL_LOADS / KVTIER_TEST_SLOW_LOADS environment
variables, which the engine's worker process inherits when it is spawned; the test creates
and removes the file to inject the fault at a chosen moment. A slow load is held, then starts
its copies once `<flag>.release` exists (at the latest `HOLD_LIMIT_S` after it was submitted),
on a thread of its own (as a slow device would: the engine's thread is never blocked by it):
the test, not a timer, says when it ends. A failed load is where a real one would be: in the
transfer engine, which reports every chunk of such a load failed and copies nothing; the real
`WorkerSide` and connector handle the rest.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kvtier.integrations.vllm import KVTierConnector
from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata
from kvtier.jobs import TransferJob
from kvtier.worker import TransferEngine


class _LoadFailingTransferEngine(TransferEngine):
    def submit(self, job: TransferJob, slices=None) -> None:
        flag = os.environ.get("KVTIER_TEST_FAIL_LOADS")
        if not (job.is_load and flag and Path(flag).exists()):
            return super().submit(job, slices)
        _count_seen(Path(flag))
        return self._report(job.failed("injected load failure"))


class FaultyKVTierConnector(KVTierConnector):
    transfer_factory = _LoadFailingTransferEngine


# A held load starts at the latest this long after it was submitted (a test that never releases
# it must not hang). A fixed delay (1 s, then 2.5 s) was twice too short on a loaded machine.
HOLD_LIMIT_S = 120.0


def release_path(flag: Path) -> Path:
    return flag.with_suffix(".release")


class _LoadHoldingTransferEngine(TransferEngine):
    def submit(self, job: TransferJob, slices=None) -> None:
        flag = os.environ.get("KVTIER_TEST_SLOW_LOADS")
        if not (job.is_load and flag and Path(flag).exists()):
            return super().submit(job, slices)
        _write_seen(Path(flag), str(job.req_id))
        release, start = release_path(Path(flag)), super().submit

        def start_once_released() -> None:
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            start(job, slices)

        threading.Thread(target=start_once_released, daemon=True).start()
        return None


class SlowLoadKVTierConnector(KVTierConnector):
    transfer_factory = _LoadHoldingTransferEngine


# -- the served soak's faults (benchmarks/soak.py): a stuck store copy, late job reports ---------
#
# KVTIER_TEST_STUCK_STORES names a flag file: while it exists, every store job the worker is given
# is accepted and never copies (as a wedged copy queue would): only the worker's deadline
# cancellation ends it, reported failed. KVTIER_TEST_DELAY_REPORTS names another: while it exists,
# the worker's job reports are held back KVTIER_TEST_REPORT_DELAY_S seconds (default 10; the soak
# sets it past the scheduler's expiry) and then sent, late. Each fault counts what it did in
# `<flag>.seen`.


def _flag(env: str) -> Path | None:
    flag = os.environ.get(env)
    return Path(flag) if flag and Path(flag).exists() else None


def _write_seen(flag: Path, text: str) -> None:
    """`<flag>.seen` := text, written whole and then renamed into place: a test in another process
    polls for it and must never read it between its creation and its write."""
    partial = flag.with_suffix(".seen-tmp")
    partial.write_text(text)
    os.replace(partial, flag.with_suffix(".seen"))


def _count_seen(flag: Path, num: int = 1) -> None:
    seen = flag.with_suffix(".seen")
    _write_seen(flag, str(int(seen.read_text() or 0) + num) if seen.exists() else str(num))


class _StoreStickingTransferEngine(TransferEngine):
    """Stores submitted while the flag exists stay in flight until `cancel` (or `shutdown`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stuck: dict[int, TransferJob] = {}

    def submit(self, job: TransferJob, slices=None) -> None:
        flag = _flag("KVTIER_TEST_STUCK_STORES")
        if not (job.is_store and job.parts and flag):
            return super().submit(job, slices)
        _count_seen(flag)
        # in flight for `wait` (a flush waits for it in vain), but no copy ever starts
        with self._cond:
            self._stuck[job.job_id] = job
            self._open[job.job_id] = None  # type: ignore[assignment]
        return None

    def _release(self, job_ids: set[int], why: str) -> set[int]:
        with self._cond:
            jobs = [self._stuck.pop(i) for i in job_ids if i in self._stuck]
            for job in jobs:
                del self._open[job.job_id]
        for job in jobs:
            self._report(job.failed(why))
        return {job.job_id for job in jobs}

    def cancel(self, job_ids, timeout: float | None = None) -> bool:
        wanted = set(job_ids)
        wanted -= self._release(wanted, "cancelled: past its deadline (stuck store)")
        return super().cancel(wanted) if timeout is None else super().cancel(wanted, timeout)

    def shutdown(self) -> None:
        self._release(set(self._stuck), "engine shut down (stuck store)")
        super().shutdown()


class SoakFaultKVTierConnector(KVTierConnector):
    """The stock connector plus the soak's two worker-side faults (inert while no flag file exists)."""

    transfer_factory = _StoreStickingTransferEngine

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (when to send, results)
        self._held: list[tuple[float, list]] = []

    def build_connector_worker_meta(self):
        meta = super().build_connector_worker_meta()
        flag, now = _flag("KVTIER_TEST_DELAY_REPORTS"), time.monotonic()
        if flag is not None and meta is not None and meta.results:
            _count_seen(flag, len(meta.results))
            delay_s = float(os.environ.get("KVTIER_TEST_REPORT_DELAY_S", "10"))
            self._held.append((now + delay_s, list(meta.results)))
            meta = KVTierWorkerMetadata([], meta.slab_slots) if meta.slab_slots else None
        due = [r for when, results in self._held if when <= now for r in results]
        if not due:
            return meta
        self._held = [(when, results) for when, results in self._held if when > now]
        return KVTierWorkerMetadata(
            due + (list(meta.results) if meta else []), meta.slab_slots if meta else ()
        )
