"""`kvtier serve` as a subprocess for the tests that serve over HTTP (test_cli_serve.py,
test_cli_proxy.py): `Server` starts one on the tiny model on a free loopback port, its output in
a file (shown when something fails); `mapped_slabs` finds the /dev/shm segments its processes map.
Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvtier.shm import SLAB_PREFIX
from vllm_helpers import SHM, mapped_shm

__all__ = [
    "GRACE_S",
    "KVTIER",
    "START_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "Server",
    "free_port",
    "mapped_slabs",
]

KVTIER = shutil.which("kvtier", path=str(Path(sys.executable).parent))
# an engine start is 20-40 s on 2 idle cores; far more when they are busy
START_TIMEOUT_S = 300
# vLLM's grace period at Ctrl-C (`--shutdown-timeout`; kvtier serve's default is 10 s): both how long
# the engine drains its requests and how long it waits for each process to exit before killing it.
# Idle here, the processes' own exit (torch and vLLM tearing down, with or without kvtier) takes
# ~4 s of it; once in CI, on 2 busy cores, over 10 s, and the engine was killed. The test gives it room.
GRACE_S = 30
STOP_TIMEOUT_S = 2 * GRACE_S + 30


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A `kvtier serve` subprocess and its address; `extra_args` are more flags (a flag given again wins)."""

    def __init__(self, model: Path, log_path: Path, extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [
                KVTIER,
                "serve",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--served-model-name",
                "tiny",
                "--skip-tokenizer-init",
                "--dtype",
                "float32",
                "--max-model-len",
                "2048",
                "--enforce-eager",
                "--seed",
                "0",
                "--cpu-bytes",
                "256MiB",
                "--max-defer-s",
                "1.0",
                "--shutdown-timeout",
                str(GRACE_S),
                *extra_args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # the engine's own wait for its workers (vLLM: 5 s, then SIGTERM) gets room too, within
            # the grace, so that a stuck worker is still signalled before the EngineCore is killed
            env={**os.environ, "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(GRACE_S // 2)},
        )

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(
                    f"kvtier serve exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        pytest.fail(f"kvtier serve not ready after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return response.status, response.read().decode()

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, {"error": exc.read().decode(errors="replace")}

    def stop(self) -> int | None:
        """SIGINT (Ctrl-C, what a person stopping the server sends); the exit status, or None if it hung."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
                self._log.close()
                return None
        self._log.close()
        return self.process.returncode


def mapped_slabs(root_pid: int) -> set[Path]:
    """kvtier's /dev/shm segments that process `root_pid` or any process under it maps: the server's
    own, not those of tests running beside it (another pytest worker's engines and slabs)."""
    import psutil

    root = psutil.Process(root_pid)
    return {
        SHM / name
        for proc in [root, *root.children(recursive=True)]
        for name in mapped_shm(proc.pid, SLAB_PREFIX)
    }
