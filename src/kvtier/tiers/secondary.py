"""The secondary-tier contract, its slab <-> tier job, and the header every stored value carries.

A secondary tier (disk, Redis, S3) holds chunks behind the CPU tier. Only the
`TieredManager` drives it, from the scheduler process: it moves bytes between host
buffers (rows of the shared host slab, one per worker rank) and its storage, on
threads of its own, and answers lookups from what it knows without blocking.

`TierJob` is kvtier's second kind of job, as in vLLM's offloading: slab <-> tier, submitted
by the manager and run by a tier. The first kind, engine <-> slab, is `kvtier.jobs.
TransferJob`, run by the workers. Both carry a deadline and spell their direction `is_store`.
The primitives, in call order:

1. `probe(keys)`: start a batched existence check in the background (tiers that keep a
   local index may ignore it); `lookup(key)` answers HIT / MISS / RETRY ("probe running").
2. `submit_load(job)` / `submit_store(job)`: start a `TierJob`; never blocks.
3. `get_finished()`: each submitted job's `TierResult` exactly once, with per-key success.
4. `touch(keys)`, `take_events()`, `stats()`, `reset()`, `drain(timeout)`, `close()`.

A tier is named once, by its `TierDescriptor` (`name`, the `medium` of everything it reports):
the name is unique among the registered tiers (`kvtier.tiers.registry` refuses a second tier of
a name, and the build refuses a tier whose `medium` is not its registered name), because read
estimates, events, stats and metrics are keyed on it. Everything else that depends on which tier
it is — how its events name it to a router, its read prior, whether its reset announces what it
drops, the setting that sizes it — is read from the descriptor, never from a table of names.

A tier never raises into the manager for an I/O failure: an error, a timeout, a short
or corrupt value is a failed key of the job's result, counted in `stats()`. A store of a
key the tier already holds succeeds without rewriting it.

Every value a tier keeps is `ValueHeader` + payload, where the payload is the chunk's
buffers (one per worker rank) back to back. The header names the namespace and the key
and carries an xxh3-64 checksum of the payload, checked on every read: a value that
fails any check is a miss, is deleted and counted — it is never served.
"""

from __future__ import annotations

import math
import re
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.base import LookupResult, OffloadingEvent, TierStats
from kvtier.costmodel.estimates import ReadEstimate
from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey
from kvtier.policies.retention import RetentionBook

__all__ = [
    "HEADER_BYTES",
    "SecondaryTier",
    "TierDescriptor",
    "TierJob",
    "TierResult",
    "TierStats",
    "ValueHeader",
    "checksum",
]

# fixed; file tiers pad it to their I/O alignment
HEADER_BYTES = 128
_MAGIC = b"KVTIER\x00\x01"
_VERSION = 1
_MAX_KEY_BYTES = 64
# magic, version, key length, namespace id (16 bytes), payload length, payload checksum, key (padded)
_LAYOUT = struct.Struct(f"<8sHH16sQQ{_MAX_KEY_BYTES}s")
# xxh3-64 of everything before it
_HEADER_CHECK = struct.Struct("<Q")
# a tier's name is a metric label, a thread name and part of an event's `ownership`
_TIER_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
# vLLM's localities of a KV-cache event's medium
LOCALITIES = ("LOCAL", "REMOTE")


def checksum(buffers: Sequence[memoryview | bytes]) -> int:
    """xxh3-64 of the buffers back to back (about 10+ GB/s: cheap beside any tier's I/O)."""
    hasher = xxhash.xxh3_64()
    for buf in buffers:
        hasher.update(buf)
    return hasher.intdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class TierDescriptor:
    """What the code outside a tier knows of it, declared once beside its configuration slice.

    Args:
        name: the tier's name, unique among registered tiers (see the module docstring): the
            `medium` of its events, stats and estimates, a metric label (lowercase letters,
            digits and `_`, at most 32).
        event_medium: the medium its KV-cache events name for a router, in vLLM's vocabulary
            (`"CPU"` for host RAM, `"STORAGE"` for anything else).
        locality: `"LOCAL"` (this machine only) or `"REMOTE"` (shared with other engines); an
            event's `ownership` is `kvtier:<name>`.
        read_prior: what reading from it costs until it has been measured (a local NVMe disk
            reads ~1 GB/s, an object store ~0.3 GB/s after 30 ms).
        announces_reset: True when its `reset` reports every chunk it drops as a removal event;
            False when it drops them silently (it cannot list them cheaply), and the engine
            adapter tells routers it dropped every chunk they were told it holds.
        sized_by: what an operator changes to make it bigger: its user key (`"disk_bytes"`) or
            what sizes it outside kvtier (`"the Redis server's maxmemory"`).
    """

    name: str
    event_medium: str
    locality: str
    read_prior: ReadEstimate
    announces_reset: bool
    sized_by: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _TIER_NAME.fullmatch(self.name):
            raise ConfigError(
                f"a tier's name must match {_TIER_NAME.pattern} (a metric label), got {self.name!r}"
            )
        if not isinstance(self.event_medium, str) or not self.event_medium:
            raise ConfigError(f"tier {self.name}: event_medium must be a name like 'STORAGE'")
        if self.locality not in LOCALITIES:
            raise ConfigError(f"tier {self.name}: locality must be one of {list(LOCALITIES)}")
        if not isinstance(self.read_prior, ReadEstimate):
            raise ConfigError(f"tier {self.name}: read_prior must be a ReadEstimate")
        if not isinstance(self.sized_by, str) or not self.sized_by:
            raise ConfigError(f"tier {self.name}: sized_by must name what sizes the tier")

    @property
    def ownership(self) -> str:
        """The `ownership` of its KV-cache events: a router tells kvtier's tiers apart by it."""
        return f"kvtier:{self.name}"


@dataclass(frozen=True, slots=True)
class ValueHeader:
    """What precedes every stored payload.

    Args:
        namespace_id: 16 bytes naming everything that makes bytes incompatible (see
            `kvtier.tiers.namespace`).
        key: the chunk's offload key (at most 64 bytes).
        payload_bytes: length of the payload that follows.
        payload_checksum: `checksum()` of the payload.
    """

    namespace_id: bytes
    key: OffloadKey
    payload_bytes: int
    payload_checksum: int

    def pack(self) -> bytes:
        """`HEADER_BYTES` bytes, with a checksum of the header itself at the end."""
        body = _LAYOUT.pack(
            _MAGIC,
            _VERSION,
            len(self.key),
            self.namespace_id,
            self.payload_bytes,
            self.payload_checksum,
            self.key,
        )
        packed = body + _HEADER_CHECK.pack(xxhash.xxh3_64_intdigest(body))
        return packed.ljust(HEADER_BYTES, b"\x00")

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> ValueHeader | str:
        """The header in `raw`, or a string saying why `raw` is not a valid one."""
        if len(raw) < _LAYOUT.size + _HEADER_CHECK.size:
            return f"short header ({len(raw)} bytes)"
        body = bytes(raw[: _LAYOUT.size])
        (stored_check,) = _HEADER_CHECK.unpack_from(raw, _LAYOUT.size)
        magic, version, key_len, namespace_id, payload_bytes, payload_checksum, key = (
            _LAYOUT.unpack(body)
        )
        if magic != _MAGIC:
            return "wrong magic (not a kvtier value)"
        if version != _VERSION:
            return f"format version {version}, this kvtier reads {_VERSION}"
        if stored_check != xxhash.xxh3_64_intdigest(body):
            return "header checksum mismatch"
        if key_len > _MAX_KEY_BYTES:
            return f"key length {key_len} > {_MAX_KEY_BYTES}"
        return cls(namespace_id, key[:key_len], payload_bytes, payload_checksum)

    def mismatch(self, namespace_id: bytes, key: OffloadKey, payload_bytes: int) -> str | None:
        """Why this header does not describe the value expected, or None when it does."""
        if self.namespace_id != namespace_id:
            return "another namespace"
        if self.key != key:
            return "another key"
        if self.payload_bytes != payload_bytes:
            return f"payload of {self.payload_bytes} bytes, expected {payload_bytes}"
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class TierJob:
    """One slab <-> tier transfer, named by an integer id, run by a secondary tier.

    `is_store`: the job's direction — write the buffers to the tier; else a load into them.
    `buffers[i]` are key i's bytes, one buffer per worker rank in rank order: a store
    reads them (they stay untouched until its result), a load writes them (checked, then
    reported). The manager pins the slab rows it passes for as long as the job runs.

    `deadline` (`time.monotonic()` seconds): I/O of the job that has not started by then never
    starts (those keys fail, counted `expired`); the manager fails the job itself at the
    deadline and frees what the job holds only when the tier reports it.
    """

    job_id: int
    is_store: bool
    keys: tuple[OffloadKey, ...]
    buffers: tuple[tuple[memoryview, ...], ...]
    deadline: float = math.inf

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.buffers):
            raise ValueError(
                f"TierJob {self.job_id}: {len(self.keys)} keys but {len(self.buffers)} buffer sets"
            )

    @property
    def num_bytes(self) -> int:
        return sum(buf.nbytes for bufs in self.buffers for buf in bufs)


@dataclass(frozen=True, slots=True, kw_only=True)
class TierResult:
    """A finished `TierJob`: the keys that failed (all others succeeded)."""

    job_id: int
    failed_keys: frozenset[OffloadKey] = frozenset()
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class SecondaryTier(ABC):
    """A tier behind the CPU tier; see the module docstring. Implementations state their
    thread-safety; the manager calls every method from one thread."""

    # the tier's registered name (`TierDescriptor.name`): its events, stats and estimates carry it
    medium: str = "unknown"

    def probe(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 (an optional hook)
        """Start checking in the background whether `keys` exist (tiers with an index ignore it)."""

    @abstractmethod
    def lookup(self, key: OffloadKey) -> LookupResult:
        """HIT (can be loaded), MISS, or RETRY (a probe for it is running). Never blocks on I/O."""

    @abstractmethod
    def submit_load(self, job: TierJob) -> None:
        """Start reading `job.keys` into `job.buffers`; the result comes from `get_finished`."""

    @abstractmethod
    def submit_store(self, job: TierJob) -> None:
        """Start writing `job.buffers` under `job.keys`; the result comes from `get_finished`."""

    @abstractmethod
    def get_finished(self) -> list[TierResult]:
        """Results of jobs finished since the last call, each job exactly once; never blocks."""

    @property
    @abstractmethod
    def queued_store_bytes(self) -> int:
        """Bytes of stores submitted and not finished (the manager's backpressure reads it)."""

    def recheck(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 (an optional hook)
        """Another engine says it wrote `keys` here: look for them afresh at their next lookup,
        past what the tier remembers of their absence (a tier that learns of other engines' writes
        only now and then, like a shared directory, looks now). A tier that sees every write at
        once needs nothing."""

    @property
    def is_reachable(self) -> bool:
        """False while the tier cannot answer (a shared tier's open circuit breaker, a reset's
        sweep): nothing will appear in it that a request should wait for."""
        return True

    def touch(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 (an optional hook)
        """`keys` were used (recency for the tier's own eviction)."""

    def use_retention(self, book: RetentionBook) -> None:  # noqa: B027 (an optional hook)
        """The requests' hints (`kvtier.policies.retention`), shared by every tier of the manager: a
        tier that evicts ranks its chunks by them; one whose values expire keeps kept ones longer.
        Called once, before any job."""

    def take_events(self) -> list[OffloadingEvent]:
        """Stored / removed events since the last call, with this tier's `medium`."""
        return []

    @abstractmethod
    def stats(self) -> TierStats:
        """Occupancy and counters."""

    @abstractmethod
    def reset(self) -> None:
        """Forget (and delete) every value of this tier's namespace; jobs in flight end as failed
        or are discarded, never as readable values."""

    @abstractmethod
    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every job in flight; True when none is left."""

    @abstractmethod
    def close(self) -> None:
        """Stop the tier's threads (after `drain`); idempotent."""
