"""An out-of-tree tier, written as a user would write one outside `src/kvtier/`: a folder of files,
one per chunk. This one file is all of it — its configuration slice (`FolderConfig`, whose `TIER`
descriptor says what the rest of kvtier needs to know of it) and the tier (`FolderTier`, the
secondary-tier contract of `kvtier.tiers.secondary`). A user enables it with two keys:

    {"extra_tiers": ["folder_tier:FolderConfig"], "folder_path": "/var/kvtier-folder"}

It uses only kvtier's public names. Its I/O runs on a thread of its own; each value is a
`ValueHeader` and the payload, written to a temporary name and renamed, checked on every read.
Its reset forgets and deletes every file without announcing each (`announces_reset=False`).

Thread-safety: the manager calls it from one thread; its I/O thread shares `_lock`'d state.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvtier import (
    LookupResult,
    Namespace,
    OffloadingEvent,
    OffloadKey,
    ReadEstimate,
    SecondaryTier,
    TierDescriptor,
    TierJob,
    TierResult,
    TierRules,
)
from kvtier.settings import setting, size, text, validate
from kvtier.tiers.secondary import HEADER_BYTES, TierStats, ValueHeader, checksum

NAME = "folder"


@dataclass(frozen=True, slots=True)
class FolderConfig:
    """The folder tier's settings (user keys `folder_<field>`); no `path`: no folder tier."""

    KEY_PREFIX: ClassVar[str] = "folder_"
    TIER: ClassVar[TierDescriptor] = TierDescriptor(
        name=NAME,
        event_medium="STORAGE",
        locality="LOCAL",
        read_prior=ReadEstimate(5e8, 0.002),
        announces_reset=False,
        sized_by="folder_bytes",
    )

    path: str | None = setting(None, text, "Directory of the folder tier; without it, none.")
    bytes: int = setting(2**20, size, "Capacity of the folder tier, in whole chunk files.")

    def __post_init__(self) -> None:
        validate(self)

    @property
    def is_enabled(self) -> bool:
        return self.path is not None

    def build(
        self, namespace: Namespace, *, enable_events: bool, remote: Any = None
    ) -> tuple[SecondaryTier, TierRules]:
        """The folder tier, written through from RAM (`remote`: shared tiers' settings, unused)."""
        assert self.path is not None, "build only an enabled tier"
        tier = FolderTier(Path(self.path), namespace, self.bytes, enable_events=enable_events)
        return tier, TierRules()


class FolderTier(SecondaryTier):
    """Chunks as files `<root>/<namespace id>/<key hex>`, at most `capacity_bytes` of them (the
    least recently used go first)."""

    medium = NAME

    def __init__(
        self, root: Path, namespace: Namespace, capacity_bytes: int, *, enable_events: bool
    ):
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        self.enable_events = enable_events
        self._dir = root / namespace.id_hex
        self._dir.mkdir(parents=True, exist_ok=True)
        self._file_bytes = HEADER_BYTES + namespace.payload_bytes
        self._lock = threading.Lock()
        # key -> None, least recently used first: what the folder holds
        self._present: OrderedDict[OffloadKey, None] = OrderedDict()
        self._finished: list[TierResult] = []
        self._events: list[OffloadingEvent] = []
        self._counters: Counter[str] = Counter()
        self._queued_store_bytes = 0
        # a reset bumps it: a job that started before the reset keeps nothing it wrote
        self._generation = 0
        self._futures: list[Future] = []
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{NAME}")

    def lookup(self, key: OffloadKey) -> LookupResult:
        with self._lock:
            if key in self._present:
                return LookupResult.HIT
        return LookupResult.MISS

    def submit_load(self, job: TierJob) -> None:
        self._futures.append(self._io.submit(self._run, job, self._generation))

    def submit_store(self, job: TierJob) -> None:
        with self._lock:
            self._queued_store_bytes += job.num_bytes
        self._futures.append(self._io.submit(self._run, job, self._generation))

    def get_finished(self) -> list[TierResult]:
        with self._lock:
            finished = self._finished
            self._finished = []
        return finished

    @property
    def queued_store_bytes(self) -> int:
        return self._queued_store_bytes

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        with self._lock:
            for key in keys:
                if key in self._present:
                    self._present.move_to_end(key)

    def take_events(self) -> list[OffloadingEvent]:
        with self._lock:
            events = self._events
            self._events = []
        return events

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                medium=NAME,
                capacity_bytes=self.capacity_bytes,
                used_bytes=len(self._present) * self._file_bytes,
                queued_store_bytes=self._queued_store_bytes,
                counters=Counter(self._counters),
            )

    def reset(self) -> None:
        """Forget and delete every file, silently; jobs in flight end as failed."""
        with self._lock:
            self._generation += 1
            gone = list(self._present)
            self._present.clear()
        for key in gone:
            self._path(key).unlink(missing_ok=True)

    def drain(self, timeout: float) -> bool:
        _, running = wait(self._futures, timeout)
        self._futures = list(running)
        return not running

    def close(self) -> None:
        self._io.shutdown(wait=True)

    # -- on the I/O thread ---------------------------------------------------------------

    def _run(self, job: TierJob, generation: int) -> None:
        started = time.monotonic()
        failed: set[OffloadKey] = set()
        for key, buffers in zip(job.keys, job.buffers, strict=True):
            is_done = self._transfer(job, key, buffers, generation)
            if not is_done:
                failed.add(key)
        direction = "store" if job.is_store else "load"
        result = TierResult(
            job_id=job.job_id,
            failed_keys=frozenset(failed),
            num_bytes=job.num_bytes,
            seconds=time.monotonic() - started,
        )
        with self._lock:
            if job.is_store:
                self._queued_store_bytes -= job.num_bytes
            self._counters[f"{direction}_chunks"] += len(job.keys) - len(failed)
            self._counters[f"{direction}_failures"] += len(failed)
            self._finished.append(result)

    def _transfer(
        self, job: TierJob, key: OffloadKey, buffers: Sequence[memoryview], generation: int
    ) -> bool:
        """Key `key` of `job`, stored or loaded; False when it failed (or was not started in time)."""
        if time.monotonic() > job.deadline:
            return False
        if job.is_store:
            return self._store(key, buffers, generation)
        return self._load(key, buffers)

    def _store(self, key: OffloadKey, buffers: Sequence[memoryview], generation: int) -> bool:
        with self._lock:
            if key in self._present:
                return True
        header = ValueHeader(
            self.namespace.id, key, sum(b.nbytes for b in buffers), checksum(buffers)
        )
        path = self._path(key)
        temporary = path.with_suffix(".tmp")
        with open(temporary, "wb") as out:
            out.write(header.pack())
            for buffer in buffers:
                out.write(buffer)
        os.replace(temporary, path)
        with self._lock:
            if generation != self._generation:
                # reset while it was written: it must not become readable
                path.unlink(missing_ok=True)
                return False
            self._present[key] = None
            evicted = self._evict_over_capacity()
            if self.enable_events:
                self._events.append(OffloadingEvent([key], NAME, False))
                if evicted:
                    self._events.append(OffloadingEvent(evicted, NAME, True))
        return True

    def _evict_over_capacity(self) -> list[OffloadKey]:
        """Under `_lock`: drop the least recently used files past the capacity."""
        evicted = []
        while len(self._present) * self._file_bytes > self.capacity_bytes:
            key, _ = self._present.popitem(last=False)
            self._path(key).unlink(missing_ok=True)
            evicted.append(key)
        self._counters["evictions"] += len(evicted)
        return evicted

    def _load(self, key: OffloadKey, buffers: Sequence[memoryview]) -> bool:
        try:
            raw = self._path(key).read_bytes()
        except OSError:
            return False
        header = ValueHeader.unpack(raw[:HEADER_BYTES])
        payload = memoryview(raw)[HEADER_BYTES:]
        expected = sum(b.nbytes for b in buffers)
        is_valid = (
            isinstance(header, ValueHeader)
            and header.mismatch(self.namespace.id, key, expected) is None
            and len(payload) == expected
            and header.payload_checksum == checksum([payload])
        )
        if not is_valid:
            with self._lock:
                self._counters["corrupt"] += 1
            return False
        offset = 0
        for buffer in buffers:
            buffer[:] = payload[offset : offset + buffer.nbytes]
            offset += buffer.nbytes
        return True

    def _path(self, key: OffloadKey) -> Path:
        return self._dir / key.hex()
