"""The byte operations of a shared remote store (Redis / Valkey, S3-compatible), and nothing else.

A `RemoteStore` is a thin, blocking adapter over one client library. Everything a tier
decides — which keys to probe, when to give up, the circuit breaker, the value header and
its checks, key names — lives in `kvtier.tiers.remote.tier.RemoteTier`, which calls a store only
from its own threads. The primitives:

1. `exists(names)`: which names are present, one batched round trip where the store allows.
2. `get(names)`: the whole value of each name (None when absent), batched; `get_into(names,
   buffers)` the same, received into the caller's buffers (the tier's load path).
3. `put(items)`: write each value (its parts back to back) unless the name already exists.
4. `delete(names)`, `ping()`, `close()`; `renew(names)` where values expire (a value read or
   found again lives another TTL from then).
5. `list_names(prefix)`, only where `lists` is True: a reset's sweep lists the namespace's
   values to delete them. A store that cannot list (memcached-like) says `lists = False` and
   need not implement it; a tier on it names its values under the namespace's epoch instead,
   and a reset starts a new epoch (`kvtier.tiers.remote.reset`): nothing to list or delete.

A store raises on any failure (connection refused, timeout, an authentication error, a
server error); `is_timeout(exc)` says which of them were timeouts, for the tier's counters.
A store whose batch runs its items as separate requests (S3) may see some fail and others
succeed: it then raises `ItemsFailed`, which holds the others' results, so that the tier fails
only the keys that failed.

A call returns, or raises, only once every request it started has ended: once it returns, no
request of it reads or writes the buffers it was given, and none of its writes is still on its
way. The tier relies on both: it hands a job's slab rows to other chunks when the job is
reported, after its calls returned, and a reset's sweep lists the values once the jobs from
before it are over (`kvtier.tiers.remote.reset`). A store that raised at its first failure
while other requests still ran broke both (issue 32).
Values are opaque bytes to a store; it never interprets or logs them, and never logs a
credential (`describe()` names the endpoint without one).

Thread-safety: every method may be called from several threads at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from kvtier.errors import KVTierError

__all__ = ["ItemsFailed", "RemoteStore", "ValueParts"]

# one value = its parts back to back (header, then one per rank)
ValueParts = Sequence[bytes | memoryview]


class ItemsFailed(KVTierError):
    """Some items of a batch failed and others did not; raised once every item has ended.

    Attributes:
        results: each item's result, in order (None where it failed).
        errors: each failed item's exception, by its index.
        first: the failure of the lowest index (the message's; `is_timeout` asks about it).
    """

    def __init__(
        self, results: Sequence[object], errors: dict[int, BaseException], first: BaseException
    ):
        super().__init__(f"{len(errors)} of {len(results)} items failed; the first: {first}")
        self.results = list(results)
        self.errors = errors
        self.first = first


class RemoteStore(ABC):
    """Blocking byte operations on one remote store; see the module docstring."""

    # "redis", "s3": the tier's name in metrics and events
    medium: str = "remote"
    # between the parts of a name: "<prefix>:<namespace id>:<key hex>" ("/" for S3)
    separator: str = ":"
    # whether `list_names` works (a reset then deletes the namespace's values)
    lists: bool = True

    def __new__(cls, *args: object, **kwargs: object) -> RemoteStore:
        """A store that says it lists implements `list_names` (checked when one is made, so that
        an abstract base may leave it to its subclasses)."""
        if cls.lists and cls.list_names is RemoteStore.list_names:
            raise TypeError(f"{cls.__name__}: lists = True needs a list_names() method")
        return super().__new__(cls)

    def __init__(self) -> None:  # noqa: B027 (a store's own arguments are its subclass's)
        """Nothing to set up here (and a store that takes no arguments refuses any)."""

    @abstractmethod
    def describe(self) -> str:
        """The endpoint for logs and errors (scheme, host, port, bucket), never a credential."""

    @abstractmethod
    def exists(self, names: Sequence[str]) -> list[bool]:
        """Whether each name is present, in order."""

    @abstractmethod
    def get(self, names: Sequence[str]) -> list[bytes | memoryview | None]:
        """Each name's whole value (None when absent), in order."""

    def get_into(
        self, names: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        """Each name's value written into `buffers[i]` (back to back); returns each value's size
        (None when absent). Where the size is not the bytes of `buffers[i]` they are left
        unspecified. Stores that can receive straight into the buffers override this (it
        saves a fresh buffer per value, whose page faults cost more than the copy).

        `buffers[i]` may have a `received(piece)` method (`values.IncomingValue`): a store may
        call it with each piece of a value of the expected size once written into them, in
        order, every byte once, so that the value is hashed while in cache. One that does not
        (this default) leaves the tier's check to hash the buffers afterwards."""
        sizes: list[int | None] = []
        for value, bufs in zip(self.get(names), buffers, strict=True):
            if value is None:
                sizes.append(None)
                continue
            view = memoryview(value).cast("B")
            sizes.append(view.nbytes)
            if view.nbytes == sum(buf.nbytes for buf in bufs):
                offset = 0
                for buf in bufs:
                    buf.cast("B")[:] = view[offset : offset + buf.nbytes]
                    offset += buf.nbytes
        return sizes

    @abstractmethod
    def put(
        self, items: Sequence[tuple[str, ValueParts]], keep_s: Sequence[float] | None = None
    ) -> list[bool]:
        """Write each value unless its name exists; True where written, False where it existed.

        The parts are read (not kept) before this returns; a store sends them with as few
        copies as its client allows. A store with a TTL sets it on every value it writes, and
        never shorter than the value's `keep_s` (seconds a request asked it be kept, or 0).
        """

    @property
    def expires(self) -> bool:
        """Whether values expire (a TTL): then `renew` gives a value used again another TTL."""
        return False

    def renew(self, names: Sequence[str], keep_s: Sequence[float] | None = None) -> None:  # noqa: B027
        """Restart each present name's TTL from now, never shorter than its `keep_s` and never
        shortening a longer one; absent names are ignored. A store without a TTL does nothing."""

    @abstractmethod
    def delete(self, names: Sequence[str]) -> None:
        """Remove the names (absent ones are ignored)."""

    def list_names(self, prefix: str) -> Iterator[str]:
        """Every name that starts with `prefix` (incrementally: SCAN, paged listings); only a store
        whose `lists` is True implements it."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its names (lists = False)")

    @abstractmethod
    def ping(self) -> None:
        """One cheap round trip; raises when the store cannot serve."""

    def is_timeout(self, exc: BaseException) -> bool:
        """Whether `exc` (raised by a method of this store) was a timeout."""
        return isinstance(exc, TimeoutError)

    def close(self) -> None:  # noqa: B027 (an optional hook)
        """Release connections; idempotent."""
