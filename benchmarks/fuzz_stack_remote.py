"""The shared stores under the stack fuzzer's remote tiers, and what it does at their edge.

Nothing here is inside kvtier: the S3 faults are placed in obstore (the client library a real
`S3Store` calls once per request), the others wrap a store object's public methods.

- `S3Server`: one SeaweedFS for the whole run (benchmarks/servers/s3.py), started when a
  configuration first asks for an S3 tier.
- `PutFaults`: one S3 store's PUT requests, made to fail (a connection reset, before a byte is
  sent) for a share of the names, to wait until released (a slow server), or one batch torn: its
  first request fails once its second is running, and the second waits until released — the
  order in which issue 32's defect 4 showed (a batch that returned at its first failure).
- `StoreWatch`: one store's `put` and `list_names`. It records which names each put call wrote
  and in which reset epoch (the fuzzer counts its `reset_cache()` calls), can hold the next put
  call until released (a job in flight across a reset), and sees the reset's sweep list the
  namespace.
- `check_values(store, codec, ...)`: every value of a tier's namespace read back: its header
  names its own key and its payload's checksum holds (the fuzzer never damages a value), and no
  value written before the last reset is left, unless written again since.

Thread-safety: the faults and the watch are read on the stores' pool threads and set by the
fuzzer's thread, under a lock of their own.
"""

from __future__ import annotations

import contextlib
import logging
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import obstore

from kvtier.tiers.remote.store import RemoteStore
from kvtier.tiers.remote.values import ValueCodec
from kvtier.tiers.secondary import HEADER_BYTES
from servers.s3 import SeaweedFS

__all__ = [
    "CEILING_S",
    "PutFaults",
    "S3Server",
    "StoreWatch",
    "check_values",
    "logged",
    "obstore_faults",
]

# a held request or a wait for the tier's answer gives up after this long (only a hang reaches it)
CEILING_S = 30.0


class S3Server:
    """One SeaweedFS for the run, started on first use; `close()` stops it."""

    def __init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.server: SeaweedFS | None = None

    def get(self) -> SeaweedFS:
        if self.server is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvtier-fuzz-s3-")
            self.server = SeaweedFS(Path(self._tmp.name))
            self.server.start()
        return self.server

    def store(self, **kwargs):
        from kvtier.tiers.remote.s3 import S3Store

        server = self.get()
        return S3Store(
            server.endpoint,
            server.bucket,
            access_key_id=server.access_key_id,
            secret_access_key=server.secret_access_key,
            **kwargs,
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class PutFaults:
    """Faults on the PUT requests of one S3 store (see the module docstring); `seed` picks which
    names fail."""

    def __init__(self, seed: int):
        # PUTs failing, by name
        self.fail_share = 0.0
        self._seed = seed
        self._lock = threading.Lock()
        # set: PUTs wait for it
        self._slow: threading.Event | None = None
        # (failing, held) names of the torn batch
        self._torn: tuple[str, str] | None = None
        self.torn_failed = threading.Event()
        self.torn_held = threading.Event()
        self._torn_release = threading.Event()
        self.num_failed = 0

    # -- the fuzzer's side ---------------------------------------------------------------------

    def slow_down(self) -> None:
        with self._lock:
            self._slow = self._slow or threading.Event()

    def speed_up(self) -> None:
        with self._lock:
            slow, self._slow = self._slow, None
        if slow is not None:
            slow.set()

    def tear(self, failing: str, held: str) -> None:
        """The PUT of `failing` fails once that of `held` runs, which waits for `release_torn()`."""
        with self._lock:
            self.torn_failed = threading.Event()
            self.torn_held = threading.Event()
            self._torn_release = threading.Event()
            self._torn = (failing, held)

    def release_torn(self) -> None:
        """The held PUT goes on; later PUTs of those names pass (a store of them again, after a reset)."""
        with self._lock:
            self._torn = None
            self._torn_release.set()

    @property
    def is_holding(self) -> bool:
        """A PUT waits for the fuzzer now (torn or slow)."""
        with self._lock:
            return (
                self.torn_held.is_set() and not self._torn_release.is_set()
            ) or self._slow is not None

    def end(self) -> None:
        """Every fault off, every held request on its way (a configuration's end)."""
        self.fail_share = 0.0
        self.speed_up()
        self.release_torn()

    # -- the request's side --------------------------------------------------------------------

    def before_put(self, name: str) -> None:
        """Called in the request's thread before it is sent: raises, waits or returns."""
        with self._lock:
            torn = self._torn
            slow = self._slow
            held = self.torn_held
            failed = self.torn_failed
            release = self._torn_release
        if torn is not None and name == torn[1]:
            held.set()
            release.wait(CEILING_S)
            return
        if torn is not None and name == torn[0]:
            held.wait(CEILING_S)
            failed.set()
            raise ConnectionResetError(
                f"injected: connection reset during the PUT of {name} (torn batch)"
            )
        if self.fail_share and random.Random(f"{self._seed}:{name}").random() < self.fail_share:
            self.num_failed += 1
            raise ConnectionResetError(f"injected: connection reset during the PUT of {name}")
        if slow is not None:
            slow.wait(CEILING_S)


# id(obstore's store object) -> its faults
_FAULTS: dict[int, PutFaults] = {}


@contextlib.contextmanager
def obstore_faults() -> Iterator[None]:
    """obstore's `put`, routed through the `PutFaults` of the store it is called for (for the run)."""
    real = obstore.put

    def put(store: object, name: str, *args: object, **kwargs: object) -> object:
        faults = _FAULTS.get(id(store))
        if faults is not None:
            faults.before_put(name)
        return real(store, name, *args, **kwargs)

    obstore.put = put
    try:
        yield
    finally:
        obstore.put = real
        _FAULTS.clear()


def attach_put_faults(s3_store: object, faults: PutFaults) -> None:
    """Route the PUTs of a real `S3Store` through `faults` (its obstore store is private: the
    only way to tell its requests from another store's)."""
    _FAULTS[id(s3_store._store)] = faults


def detach_put_faults(s3_store: object) -> None:
    _FAULTS.pop(id(s3_store._store), None)


class StoreWatch:
    """One store's `put` and `list_names`, watched (see the module docstring)."""

    def __init__(self, store: RemoteStore):
        self.store = store
        # the fuzzer's reset_cache() calls so far
        self.epoch = 0
        # names a put call started in that epoch wrote
        self.names_by_epoch: dict[int, set[str]] = {}
        # set by every listing (the reset's sweep)
        self.listed = threading.Event()
        # told each put call's names first
        self.on_batch: Callable[[list[str]], None] | None = None
        self._lock = threading.Lock()
        # armed: the next put call waits for it
        self._hold: threading.Event | None = None
        # a put call waits now
        self.is_holding = threading.Event()
        self._real_put = store.put
        self._real_list = store.list_names
        store.put = self._put  # type: ignore[method-assign]
        store.list_names = self._list_names  # type: ignore[method-assign]

    def hold_next_put(self) -> None:
        with self._lock:
            self._hold = threading.Event()
            self.is_holding.clear()

    def release(self) -> None:
        """Let the held put call (if any) run, and hold no other."""
        with self._lock:
            hold, self._hold = self._hold, None
            self.is_holding.clear()
        if hold is not None:
            hold.set()

    def new_epoch(self) -> None:
        self.epoch += 1
        self.listed.clear()

    def _put(self, items, keep_s=None):
        names = [name for name, _ in items]
        with self._lock:
            self.names_by_epoch.setdefault(self.epoch, set()).update(names)
            hold = self._hold
            if hold is not None and self.is_holding.is_set():
                # one call held at a time: the others pass
                hold = None
            if hold is not None:
                self.is_holding.set()
        on_batch = self.on_batch
        if on_batch is not None:
            on_batch(names)
        if hold is not None:
            hold.wait(CEILING_S)
        return self._real_put(items, keep_s)

    def _list_names(self, prefix: str) -> Iterator[str]:
        names = list(self._real_list(prefix))
        self.listed.set()
        yield from names


def check_values(
    store: RemoteStore, codec: ValueCodec, names_by_epoch: dict[int, set[str]] | None, epoch: int
) -> list[str]:
    """What is wrong with the values of `codec`'s namespace in `store` (an empty list: nothing):
    a value whose header is not its own key's or whose checksum fails, and (with `names_by_epoch`)
    a name written before epoch `epoch` began (the last reset) and not written since."""
    problems = []
    names = sorted(store.list_names(codec.name_prefix))
    values = store.get(names) if names else []
    written_since = (names_by_epoch or {}).get(epoch, set())
    for name, value in zip(names, values, strict=True):
        if value is None:
            # dropped between the listing and the read (a TTL)
            continue
        view = memoryview(value).cast("B")
        key = bytes.fromhex(name.rpartition(codec.name_prefix)[2])
        why = codec.check(key, view.nbytes, [view[:HEADER_BYTES], view[HEADER_BYTES:]])
        if why is not None:
            problems.append(f"…{name[-16:]}: {why}")
        earlier = [written for e, written in (names_by_epoch or {}).items() if e < epoch]
        if any(name in written for written in earlier) and name not in written_since:
            problems.append(f"…{name[-16:]}: written before the last reset, still there after it")
    return problems


@contextlib.contextmanager
def logged(logger_name: str, text: str) -> Iterator[threading.Event]:
    """An event set once `logger_name` logs a message containing `text` (DEBUG included, for the
    time of the block)."""
    logger = logging.getLogger(logger_name)
    said = threading.Event()

    class Listener(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                said.set()

    listener = Listener(logging.DEBUG)
    level = logger.level
    logger.addHandler(listener)
    logger.setLevel(logging.DEBUG)
    try:
        yield said
    finally:
        logger.removeHandler(listener)
        logger.setLevel(level)


def first_of(conditions: dict[str, Callable[[], bool]], timeout: float = CEILING_S) -> str | None:
    """The name of the first condition found true (checked in order, every 2 ms); None after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, condition in conditions.items():
            if condition():
                return name
        time.sleep(0.002)
    return None
