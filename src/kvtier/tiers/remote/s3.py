"""`S3Store`: the remote-store operations on one bucket of an S3-compatible server (AWS S3,
MinIO, SeaweedFS, Ceph RGW, ...), through obstore (Rust `object_store` + reqwest): one store and
the client errors it maps, each choice below explained where it is made.

One object per name, written by one plain PUT (never multipart) with `If-None-Match: *`, so
a name that exists is never overwritten (the server answers 412; SeaweedFS 4.x, MinIO and
AWS S3 support it). The client was chosen by measurement (benchmarks/s3_bench.py --boto3,
16 requests in flight, one SeaweedFS on the same 2 cores): both put 1-4 MiB objects at
~0.25 GB/s (the server is the bottleneck), obstore with a third to a half of boto3's CPU per
byte; obstore gets them 1.3-2x faster (boto3 0.49-0.76x), hands the body to Python without a
copy and gathers a value's parts itself; its conditional put is built in.

Choices that a reader might not expect:

- **Unsigned payload.** SigV4 otherwise hashes every body with SHA-256 before sending it
  (~0.6 s of CPU per GB here, on the engine host); integrity comes from TLS on `https` and
  from the value header's checksum, which every load checks.
- **Credentials** are passed in already resolved (`kvtier.tiers.remote.credentials`) and handed to the
  client through a provider, so an `AWS_SESSION_TOKEN` in the environment cannot get mixed
  into them; without them, the client's own chain applies (environment, web identity,
  container or instance metadata). Requests are path-style (`endpoint/bucket/name`).
- **One retry at most,** within `timeout_ms` of the first attempt (a pooled connection the
  server closed), so a hung server costs one timeout; the tier's circuit breaker does the rest.
- **`get_into` reads a body only when its size is the one expected.** The size comes with the
  response's headers (the object's metadata), before the body: whoever can write the bucket
  chooses it, and a body of another size is never read (the response is dropped unread). The
  body is then copied into the caller's buffers piece by piece on the pool thread that received
  it (numpy's copy releases the GIL, a memoryview's does not), each piece reported to an
  `IncomingValue` that hashes it while in cache: the value is verified by the time it is copied.
- A batch runs its items on a pool of `max_connections` threads (the client releases the GIL
  while it waits), one request per item; a batch of one runs in the calling thread.
- **A batch returns only once every request of it has ended,** even after one failed. A PUT
  reads the caller's buffers until its request ends (obstore sends them without copying) and a
  GET copies into them: the tier hands a job's slab rows to other chunks once the call returns,
  and a reset's sweep lists the bucket once the jobs from before it are over (issue 32: a batch
  that raised at its first failure left PUTs uploading the rows' next owner under the old names,
  and after a reset). The first failure cancels the requests not started yet (a failing server
  would fail them too, one timeout per round of the pool); failures are reported per item
  (`ItemsFailed`), or as the first one's error when no item succeeded.
- Names are object_store paths: `/`-separated, no empty, `.` or `..` segments.

Errors: every client failure is raised as `S3StoreError`, one line long (the client's own
message runs to 40 lines of debug output), with `timed_out` set for timeouts; a batch whose
items failed in part raises `ItemsFailed`, which holds each item's `S3StoreError`.

Thread-safety: every method may be called from several threads at once; obstore's store is
shared (it is `Send + Sync` in Rust) and the pool is the only other state.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, PreconditionError
from obstore.store import S3Store as _ObjectStore

from kvtier.errors import ConfigError, KVTierError
from kvtier.tiers.remote.store import ItemsFailed, RemoteStore, ValueParts

__all__ = ["S3Store", "S3StoreError"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")
# names per batch from the lister (S3 pages hold 1,000 at most)
_LIST_CHUNK = 1000
# a listing of it is empty: one cheap signed request that needs the bucket
_PING_PREFIX = "kvtier-ping-none"
# obstore says "timeout" only in its Debug dump: `HttpError { kind: Timeout, ... }`, reqwest's `TimedOut`
_TIMEOUT_MARK = re.compile(r"kind: Timeout|TimedOut|timed out", re.IGNORECASE)
# A body is copied into the slab rows (and hashed, see `values.IncomingValue`) in pieces of this
# size: each is hashed while it is still in the core's cache (2 MiB of L2 here).
_COPY_PIECE = 256 << 10
# `kind: ConnectionRefused`, `error: X(Y)`
_CAUSE = re.compile(r"(?:error|kind): (\w+)(?:\(\s*(\w+),?\s*\))?")


class S3StoreError(KVTierError):
    """An S3 request failed (`timed_out`: it ran out of time); the message is one line."""

    def __init__(self, message: str, *, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class S3Store(RemoteStore):
    """Byte operations on one bucket of an S3-compatible server.

    Args:
        endpoint: `http[s]://host[:port]` of the server (for AWS, the regional endpoint).
        bucket: an existing bucket.
        region: the signing region (most other servers accept any).
        access_key_id, secret_access_key: both or neither (neither: the client's own chain).
        ca_file: a PEM bundle trusted for `https`, beside the system roots.
        connect_timeout_ms, timeout_ms: to open a connection; for a whole request.
        max_connections: requests in flight at most (the batch pool) and idle connections kept.
    """

    medium = "s3"
    separator = "/"

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        *,
        region: str = "us-east-1",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        ca_file: str | None = None,
        connect_timeout_ms: int = 1000,
        timeout_ms: int = 5000,
        max_connections: int = 16,
    ) -> None:
        parts = urlsplit(endpoint)
        if parts.username or parts.password:
            raise ConfigError(
                "s3 endpoint must not hold credentials: give them in s3_credentials_file"
            )
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"s3 endpoint must look like https://host[:port] or http://host[:port], "
                f"got {parts.scheme or 'no'} scheme and host {parts.hostname or 'none'}"
            )
        if not bucket:
            raise ConfigError("s3 bucket must be named")
        if (access_key_id is None) != (secret_access_key is None):
            raise ConfigError("s3: give both an access key id and a secret access key, or neither")
        if min(connect_timeout_ms, timeout_ms, max_connections) <= 0:
            raise ConfigError("s3 connect_timeout_ms, timeout_ms and max_connections must be > 0")
        port = f":{parts.port}" if parts.port else ""
        self._endpoint = f"{parts.scheme}://{parts.hostname}{port}{parts.path.rstrip('/')}/{bucket}"
        client_options: dict[str, Any] = {
            "allow_http": parts.scheme == "http",
            "connect_timeout": f"{connect_timeout_ms}ms",
            "timeout": f"{timeout_ms}ms",
            "pool_max_idle_per_host": str(max_connections),
        }
        if ca_file is not None:
            client_options["root_certificate"] = _read_pem(ca_file)
        retry = {
            "max_retries": 1,
            "retry_timeout": timedelta(milliseconds=timeout_ms),
            "backoff": {
                "init_backoff": timedelta(milliseconds=20),
                "max_backoff": timedelta(milliseconds=100),
            },
        }
        credentials = None
        if access_key_id is not None:
            credentials = _StaticCredentials(access_key_id, secret_access_key or "")
        self._store = _ObjectStore(
            bucket,
            endpoint=endpoint,
            region=region,
            client_options=client_options,
            retry_config=retry,
            credential_provider=credentials,
            unsigned_payload=True,
            skip_signature=False,
            virtual_hosted_style_request=False,
            s3_express=False,
            conditional_put="etag",
        )
        self._pool = ThreadPoolExecutor(max_connections, thread_name_prefix="kvtier-s3")
        self._is_closed = False

    def describe(self) -> str:
        return self._endpoint

    def exists(self, names: Sequence[str]) -> list[bool]:
        return self._each("HEAD", self._exists_one, names)

    def get(self, names: Sequence[str]) -> list[bytes | memoryview | None]:
        return self._each("GET", self._get_one, names)

    def get_into(
        self, names: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        """Each name's value copied into `buffers[i]` when its size is theirs; its size (None when absent)."""
        return self._each(
            "GET", lambda item: self._get_one_into(*item), list(zip(names, buffers, strict=True))
        )

    def put(
        self, items: Sequence[tuple[str, ValueParts]], keep_s: Sequence[float] | None = None
    ) -> list[bool]:
        """PUT if absent, per item; `keep_s` needs nothing: kvtier never expires an object (a bucket's
        lifecycle rule may, and then the value is a miss)."""
        return self._each("PUT", self._put_one, items)

    def delete(self, names: Sequence[str]) -> None:
        """One DeleteObjects request per 1,000 names (S3 ignores absent ones)."""
        if names:
            self._check_open()
            _call("DELETE", names[0], lambda: obstore.delete(self._store, list(names)))

    def list_names(self, prefix: str) -> Iterator[str]:
        """Paged listing (1,000 names a page). S3 lists by whole `/`-separated segments here, so
        a prefix that ends mid-segment lists its parent and keeps the names that match."""
        self._check_open()
        parent = prefix.rpartition("/")[0] or None
        pages = _call(
            "LIST", prefix, lambda: iter(obstore.list(self._store, parent, chunk_size=_LIST_CHUNK))
        )
        while True:
            page = _call("LIST", prefix, lambda: next(pages, None))
            if page is None:
                return
            yield from (meta["path"] for meta in page if meta["path"].startswith(prefix))

    def ping(self) -> None:
        """An empty listing: checks the server, the credentials and the bucket in one request."""
        self._check_open()
        _call(
            "LIST",
            _PING_PREFIX,
            lambda: next(iter(obstore.list(self._store, _PING_PREFIX, chunk_size=1)), None),
        )

    def is_timeout(self, exc: BaseException) -> bool:
        """Whether `exc` timed out (for `ItemsFailed`: its first failure)."""
        if isinstance(exc, ItemsFailed):
            exc = exc.first
        return isinstance(exc, TimeoutError) or (isinstance(exc, S3StoreError) and exc.timed_out)

    def close(self) -> None:
        """Stop the batch pool (its running requests finish first); idempotent."""
        self._is_closed = True
        self._pool.shutdown(wait=True)

    def _exists_one(self, name: str) -> bool:
        try:
            _call("HEAD", name, lambda: obstore.head(self._store, name))
        except FileNotFoundError:
            return False
        return True

    def _get_one(self, name: str) -> memoryview | None:
        # obstore's Bytes exports the received body as a buffer: no copy
        try:
            return memoryview(_call("GET", name, lambda: obstore.get(self._store, name).bytes()))
        except FileNotFoundError:
            return None

    def _get_one_into(self, name: str, buffers: Sequence[memoryview]) -> int | None:
        # the response's headers only: the body is read by `bytes()`, when at all
        try:
            result = _call("GET", name, lambda: obstore.get(self._store, name))
        except FileNotFoundError:
            return None
        expected = sum(buf.nbytes for buf in buffers)
        if result.meta["size"] != expected:
            return result.meta["size"]
        body = np.frombuffer(memoryview(_call("GET", name, result.bytes)), np.uint8)
        if body.nbytes != expected:
            return body.nbytes
        # an IncomingValue hashes each piece as it lands
        report = getattr(buffers, "received", None)
        offset = 0
        for buf in buffers:
            dest = np.frombuffer(_byte_view(buf), np.uint8)
            for start in range(0, dest.nbytes, _COPY_PIECE):
                piece = dest[start : start + _COPY_PIECE]
                # without the GIL
                np.copyto(piece, body[offset + start : offset + start + piece.nbytes])
                if report is not None:
                    report(memoryview(piece))
            offset += dest.nbytes
        return expected

    def _put_one(self, item: tuple[str, ValueParts]) -> bool:
        name, parts = item
        views = [_byte_view(part) for part in parts]
        # several parts: the client gathers them, we do not join
        body = views[0] if len(views) == 1 else views
        try:
            _call(
                "PUT",
                name,
                lambda: obstore.put(self._store, name, body, mode="create", use_multipart=False),
            )
        except (AlreadyExistsError, PreconditionError):
            return False
        return True

    def _each(self, op: str, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """`fn` of every item, in order: on the pool, or in this thread for a single item. Returns
        (or raises) only once every item's request has ended; see the module docstring.

        Raises:
            ItemsFailed: some items failed, others did not (`results` holds the others').
            S3StoreError: every item failed (the first one's error), or the store is closed.
        """
        self._check_open()
        if len(items) <= 1:
            return [fn(item) for item in items]
        futures = self._submit_all(fn, items)
        done, running = wait(futures, return_when=FIRST_EXCEPTION)
        if running and any(future.exception() is not None for future in done):
            # the requests not started yet are not sent; those running are waited for
            for future in running:
                future.cancel()
            still_running = [future for future in running if not future.cancelled()]
            logger.debug(
                "kvtier: an S3 %s of a batch of %d failed; waiting for the %d request(s) still running",
                op,
                len(items),
                len(still_running),
            )
            wait(still_running)
        return _results(op, futures)

    def _submit_all(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[Future[_R]]:
        """One future per item on the pool; a pool that shut down meanwhile (`close()`) raises,
        once the items already submitted have ended."""
        futures: list[Future[_R]] = []
        try:
            for item in items:
                futures.append(self._pool.submit(fn, item))
        except RuntimeError as exc:
            for future in futures:
                future.cancel()
            wait(futures)
            raise S3StoreError(f"S3 store {self._endpoint} is closed") from exc
        return futures

    def _check_open(self) -> None:
        if self._is_closed:
            raise S3StoreError(f"S3 store {self._endpoint} is closed")


class _StaticCredentials:
    """A credential provider that obstore calls once (no expiry); its repr hides the secret."""

    def __init__(self, access_key_id: str, secret_access_key: str):
        self._credential = {
            "access_key_id": access_key_id,
            "secret_access_key": secret_access_key,
            "token": None,
            "expires_at": None,
        }

    def __call__(self) -> dict[str, Any]:
        return dict(self._credential)

    def __repr__(self) -> str:
        return f"_StaticCredentials(access_key_id={self._credential['access_key_id']!r}, secret_access_key=***)"


def _call(op: str, name: str, fn: Callable[[], _R]) -> _R:
    """`fn()`, with a client failure raised as a one-line `S3StoreError`; an absent object and an
    existing one pass through (FileNotFoundError, AlreadyExistsError), an absent bucket does not."""
    try:
        return fn()
    except FileNotFoundError as exc:
        # a GET's 404 says which (a HEAD's cannot: no body)
        if "<Code>NoSuchBucket</Code>" in str(exc):
            raise _error(op, name, exc) from exc
        raise
    except (AlreadyExistsError, PreconditionError):
        raise
    except (BaseError, OSError) as exc:
        raise _error(op, name, exc) from exc


def _error(op: str, name: str, exc: BaseException) -> S3StoreError:
    """obstore's first line, plus what its Debug dump alone says: a timeout, the server's error
    code, or the innermost cause (e.g. `InvalidCertificate(UnknownIssuer)`, `ConnectionRefused`)."""
    text = str(exc)
    head, _, dump = text.partition("\n\nDebug source:")
    summary = head.split(": <?xml", 1)[0].splitlines()[0].rstrip(": ")
    timed_out = isinstance(exc, TimeoutError) or _TIMEOUT_MARK.search(text) is not None
    detail = ""
    if timed_out:
        detail = " [timed out]"
    elif (code := re.search(r"<Code>([^<]+)</Code>", text)) is not None:
        detail = f" ({code[1]})"
    elif "HttpError" in dump and (causes := _CAUSE.findall(dump)):
        outer, inner = causes[-1]
        detail = f" ({outer}({inner}))" if inner else f" ({outer})"
    return S3StoreError(f"S3 {op} {name}: {summary}{detail}", timed_out=timed_out)


def _results(op: str, futures: Sequence[Future[_R]]) -> list[_R]:
    """Each ended future's result, in order; its failures raised as the `_each` docstring says."""
    results: list[_R | None] = []
    errors: dict[int, BaseException] = {}
    for i, future in enumerate(futures):
        if future.cancelled():
            errors[i] = S3StoreError(
                f"S3 {op}: not sent (another request of its batch failed first)"
            )
        elif (exc := future.exception()) is not None:
            errors[i] = exc
        results.append(None if i in errors else future.result())
    if not errors:
        return results  # type: ignore[return-value]  (no item failed: every one has its result)
    first = next(
        (exc for i, exc in errors.items() if not futures[i].cancelled()), errors[min(errors)]
    )
    if len(errors) == len(futures):
        raise first
    raise ItemsFailed(results, errors, first)


def _byte_view(part: bytes | memoryview) -> memoryview:
    """A 1-D unsigned-byte view (what obstore accepts) of a contiguous buffer, without a copy."""
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _read_pem(path: str) -> str:
    try:
        return Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"s3 ca_file {path}: cannot read it as a PEM file ({type(exc).__name__})"
        ) from None
