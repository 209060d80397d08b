"""Take one of kvtier's defences out of a soak's servers, to see that the soak's checks catch it.

Not part of kvtier. docs/reliability.md ("Does each check have teeth?") runs, for example:

    PYTHONPATH=benchmarks/soak/breaks KVTIER_SOAK_BREAK=disk_checksum \\
        .venv/bin/python benchmarks/soak.py --quick --fault disk_corrupt

Every Python process started with this folder on PYTHONPATH imports this module first (the
`site` module does); the soak's servers inherit PYTHONPATH, so the named defence is patched
out in vLLM's API server, engine core and worker alike, right after kvtier's module defining
it is imported. No source file changes. Only the soak's servers are patched (they run with
KVTIER_SOAK_SERVER=1), not the soak or pytest process that starts them. KVTIER_SOAK_BREAK
takes names separated by commas (see `BREAKS`).
"""

from __future__ import annotations

import importlib.abc
import os
import sys


# redis_kill: the circuit breaker
def _breaker_never_opens(m) -> None:
    m.CircuitBreaker.record_failure = lambda self: False
    m.CircuitBreaker.open_now = lambda self: None


# disk_corrupt: every read is verified (size, header, checksum)
def _no_checksum(m) -> None:
    def read(self, fd, key, views):
        m._preadv_all(fd, [memoryview(m._header_block()), *views])
        return None

    m.ChunkFormat.read = read


# disk_full: a failed write is a failed chunk, never an exception
def _store_errors_escape(
    m,
) -> None:
    def store_one(self, state, key, bufs, ticket):
        # ENOSPC now escapes the tier's own handling
        tmp, direct = self._files.write_tmp(key, bufs)
        published = self._publish(key, tmp, ticket)
        with self._lock:
            self._queued_store_bytes -= sum(b.nbytes for b in bufs)
            self._index.give_back(key, ticket)
            self._book.chunk_done(
                state,
                key,
                sum(b.nbytes for b in bufs) if published else 0,
                direct,
                None if published else "discarded",
                self._generation,
            )

    m.DiskTier._store_one = store_one


# stuck_store: the worker cancels jobs at their deadline
def _no_worker_cancel(m) -> None:
    m.WorkerSide._cancel = lambda self, jobs: None


# delayed_reports: the scheduler fails jobs not reported in time
def _no_job_expiry(m) -> None:
    m.TransferJobBook.expire = lambda self, now: []


# reset_prefix_cache: kvtier forgets every tier's chunks
def _no_connector_reset(m) -> None:
    m.SchedulerSide.reset_cache = lambda self: True


# sigterm_restart: shared memory unlinked at shutdown
def _slab_not_unlinked(m) -> None:
    release = m._release

    def keep(segment) -> None:
        segment.unlink_on_close = False
        release(segment)

    m._release = keep


# sigterm_restart: the disk index is rebuilt from the directory at start
def _no_start_scan(
    m,
) -> None:
    m.ChunkFiles.scan = lambda self: m.FileScan()


# the memory check: 8 MiB kept per finished request
def _leak_per_request(m) -> None:
    finished = m.SchedulerSide.request_finished
    kept = []

    def request_finished(self, request) -> None:
        kept.append(b"\x01" * (8 << 20))
        finished(self, request)

    m.SchedulerSide.request_finished = request_finished


BREAKS = {
    "redis_breaker": ("kvtier.tiers.remote.breaker", _breaker_never_opens),
    "disk_checksum": ("kvtier.tiers.disk.format", _no_checksum),
    "disk_store_errors": ("kvtier.tiers.disk.tier", _store_errors_escape),
    "worker_cancel": ("kvtier.worker.side", _no_worker_cancel),
    "job_expiry": ("kvtier.scheduler.jobs", _no_job_expiry),
    "connector_reset": ("kvtier.integrations.vllm.scheduler_side", _no_connector_reset),
    "slab_unlink": ("kvtier.slab", _slab_not_unlinked),
    "disk_scan": ("kvtier.tiers.disk.files", _no_start_scan),
    "rss_leak": ("kvtier.integrations.vllm.scheduler_side", _leak_per_request),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs each patch right after its module is executed (before anything uses it)."""

    def __init__(self, pending: dict[str, list]):
        self.pending = pending

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        patches = self.pending.pop(fullname)
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            for patch in patches:
                patch(module)
            print(
                f"kvtier soak break: patched {fullname} in pid {os.getpid()}",
                file=sys.stderr,
                flush=True,
            )

        spec.loader.exec_module = exec_module
        return spec


def _install() -> None:
    names = [n for n in os.environ.get("KVTIER_SOAK_BREAK", "").split(",") if n]
    # set for the soak's servers only
    if not names or os.environ.get("KVTIER_SOAK_SERVER") != "1":
        return
    pending: dict[str, list] = {}
    for name in names:
        module, patch = BREAKS[name]
        pending.setdefault(module, []).append(patch)
    sys.meta_path.insert(0, _PatchAfterImport(pending))


_install()
