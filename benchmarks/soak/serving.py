"""The vLLM servers of the served soak (benchmarks/soak/).

- `ServedEngine`: one OpenAI-compatible vLLM server on a free loopback port, as a subprocess
  of `kvtier serve` (kvtier configured from flags), of `kvtier vllm serve` with a
  `--kv-transfer-config` naming a fault-injecting connector class (tests/kvtier_fault_connector.py),
  or of `kvtier vllm serve` without kvtier (the baseline). Its output goes to a log file;
  every wait is bounded. It reads `/metrics`, the resident memory of its process tree, and
  the shared-memory segments that tree maps.

The Redis server the kvtier server uses is benchmarks/servers/redis.py's; its disk directory is in disk.py.

Thread-safety: none. Start, stop and restart from the main thread: `setpriv --pdeathsig`
sends SIGTERM to a child when the *thread* that started it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["EngineSpec", "Metrics", "ServedEngine", "is_alive"]

KVTIER = str(Path(sys.executable).parent / "kvtier")
# the fault-injecting connectors live there
TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
# a kvtier server's --shutdown-timeout: how long a stopped engine drains its requests and its
# processes get to exit on their own (idle: ~4 s), before vLLM kills the EngineCore, which then
# leaves kvtier's host slab in /dev/shm (the shutdown checks count that as a fault). Its workers
# get half of it before they are signalled. The baseline keeps vLLM's default (0: abort at once).
SHUTDOWN_GRACE_S = 30
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Metrics:
    """A `/metrics` page, parsed: `sum(name, **labels)` adds the samples that match."""

    def __init__(self, text: str = ""):
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m and not line.startswith("#"):
                self.samples.append(
                    (m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3)))
                )

    def sum(self, name: str, **labels: str) -> float:
        return sum(
            v
            for n, lab, v in self.samples
            if n == name and all(lab.get(k) == x for k, x in labels.items())
        )

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)


@dataclass
class EngineSpec:
    """What one server runs: the model, vLLM's flags, and kvtier's settings (None: no kvtier)."""

    model: Path
    # kv_connector_extra_config; None: the baseline, stock vLLM
    kvtier: dict | None = None
    # a class of tests/kvtier_fault_connector.py instead of KVTierConnector
    connector: str | None = None
    # vLLM's KV cache, in blocks of 128 tokens: small, so it evicts
    num_gpu_blocks: int = 40
    max_model_len: int = 2048
    max_num_seqs: int = 4
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, port: int) -> list[str]:
        vllm = [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            "--seed",
            "0",
            "--num-gpu-blocks-override",
            str(self.num_gpu_blocks),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
        ]
        if self.kvtier is None:
            return [KVTIER, "vllm", "serve", str(self.model), *vllm]
        vllm += ["--shutdown-timeout", str(SHUTDOWN_GRACE_S)]
        # what users run: kvtier's flags
        if self.connector is None:
            return [KVTIER, "serve", str(self.model), *vllm, *_flags(self.kvtier)]
        from kvtier.cli.config import transfer_config

        config = {
            **transfer_config(self.kvtier),
            "kv_connector": self.connector,
            "kv_connector_module_path": "kvtier_fault_connector",
        }
        return [
            KVTIER,
            "vllm",
            "serve",
            str(self.model),
            *vllm,
            "--kv-transfer-config",
            json.dumps(config),
        ]


def _flags(extra: dict) -> list[str]:
    """`kvtier serve` flags for kv_connector_extra_config keys (`disk_path` -> `--disk-path`)."""
    flags = []
    for key, value in extra.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags.append(f"{flag}={value}")
    return flags


class ServedEngine:
    """A vLLM server subprocess (see the module docstring). `url` stays the same across `restart`."""

    def __init__(self, spec: EngineSpec, log_path: Path, start_timeout_s: float = 600.0):
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None
        self.num_starts = 0
        # answering: started and not being stopped
        self.ready = False
        self._log = None
        # kvtier segments this server's processes mapped
        self.shm_names: set[str] = set()

    # -- life cycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the server (again, on the same port) and return once `/health` answers."""
        from kvtier.integrations.vllm.binding import RESERVED_CPUS_ENV

        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "KVTIER_SOAK_SERVER": "1",
            "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(SHUTDOWN_GRACE_S // 2),
            **self.spec.env,
        }
        # both servers compute on the same cores (see binding.py)
        env.setdefault(RESERVED_CPUS_ENV, "1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("a")
        self._log.write(
            f"\n===== start {self.num_starts + 1}: {' '.join(self.spec.argv(self.port))}\n"
        )
        self._log.flush()
        self.process = subprocess.Popen(
            DIE_WITH_PARENT + self.spec.argv(self.port),
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.num_starts += 1
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode} at start:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                if self.get("/health", timeout=5)[0] == 200:
                    self.ready = True
                    return
            time.sleep(1.0)
        self.stop(signal.SIGKILL)
        raise RuntimeError(
            f"server not ready after {self.start_timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 90.0) -> int | None:
        """Send `sig`; wait (bounded) for the server and every process it started. Returns its exit
        status, or None when it had to be killed (its process group gets SIGKILL)."""
        if self.process is None:
            return None
        self.ready = False
        self.remember_shm()
        tree = self.pids()
        status: int | None = None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            status = self.process.wait(timeout_s)
            _wait_gone(tree, deadline=time.monotonic() + 30)
        except subprocess.TimeoutExpired:
            pass
        if any(is_alive(pid) for pid in tree) or status is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.wait(10)
            status = None
        self._log.close()
        return status

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # -- HTTP -------------------------------------------------------------------------

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return response.status, response.read().decode()

    def post(self, path: str, body: dict | None = None, timeout: float = 300.0) -> tuple[int, dict]:
        """POST JSON; (status, parsed body). HTTP errors are returned; connection errors raise OSError."""
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, {"error": exc.read().decode(errors="replace")}

    def metrics(self) -> Metrics:
        return Metrics(self.get("/metrics")[1])

    # -- the process tree ---------------------------------------------------------------

    def pids(self) -> list[int]:
        """The server and every process under it (vLLM's engine core, its workers, helpers)."""
        if not self.is_running():
            return []
        found = []
        todo = [self.process.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += _children(pid)
        return found

    def rss_by_process(self) -> dict[str, int]:
        """Resident bytes of each process of the tree, keyed "<comm>:<pid>" (shared pages count in each)."""
        out = {}
        for pid in self.pids():
            with contextlib.suppress(OSError, ValueError):
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[f"{comm}:{pid}"] = int(line.split()[1]) * 1024
        return out

    def rss_bytes(self) -> int:
        """Resident memory of the process tree, summed."""
        return sum(self.rss_by_process().values())

    def remember_shm(self) -> set[str]:
        """Note the kvtier shared-memory segments the tree maps now (checked after shutdown)."""
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                    path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                    if path.startswith("/dev/shm/kvtier-"):
                        self.shm_names.add(path.split()[0].removeprefix("/dev/shm/"))
        return self.shm_names

    def core_ids(self) -> list[list[int]]:
        """The core ids vLLM logged for this server's workers (the last start)."""
        from kvtier.integrations.vllm.binding import _CORE_IDS

        text = self.log_path.read_text(errors="replace").rsplit("===== start", 1)[-1]
        ranks = {
            int(r): [int(i) for i in ids.replace(" ", "").split(",") if i]
            for r, ids in _CORE_IDS.findall(text)
        }
        return [ranks[r] for r in sorted(ranks)]

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        out = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
        return out
    return []


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_gone(pids: list[int], deadline: float) -> None:
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
