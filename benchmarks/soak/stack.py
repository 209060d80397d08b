"""The servers of the served soak: the baseline (stock vLLM), and the kvtier server with the
Redis server and the disk directory it stores into (`open_stack`, `close_stack`).

Thread-safety: none. Start and stop from the main thread (see serving.py).
"""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

from servers.redis import RedisServer

from .config import SoakConfig
from .disk import DiskDir
from .faults import Fault
from .report import Check
from .run import Stack, disk_leftovers
from .serving import EngineSpec, ServedEngine, is_alive

__all__ = ["close_stack", "open_stack", "start_baseline"]


def _spec(model: Path, cfg: SoakConfig, kvtier: dict | None = None, **kwargs) -> EngineSpec:
    return EngineSpec(
        model, kvtier, num_gpu_blocks=cfg.num_gpu_blocks, max_num_seqs=cfg.concurrency, **kwargs
    )


def start_baseline(model: Path, cfg: SoakConfig, log_dir: Path) -> ServedEngine:
    engine = ServedEngine(_spec(model, cfg), log_dir / "baseline.log")
    engine.start()
    return engine


def open_stack(model: Path, cfg: SoakConfig, log_dir: Path, faults: list[Fault] = ()) -> Stack:
    """Redis, a disk directory and a kvtier server started as `faults` need (at most one connector)."""
    connectors = {f.connector for f in faults} - {None}
    if len(connectors) > 1:
        raise ValueError(f"faults need different connector classes: {connectors}")
    redis = RedisServer.temporary(prefix="kvtier-soak-redis-", start_timeout_s=20.0)
    redis.start()
    disk = DiskDir(cfg.tmpfs_bytes if any(f.needs_tmpfs for f in faults) else None)
    flags = Path(tempfile.mkdtemp(prefix="kvtier-soak-flags-"))
    env = {k: v for f in faults for k, v in f.env(flags, cfg.job_timeout_s).items()}
    settings = {
        "cpu_bytes": cfg.cpu_bytes,
        "disk_path": str(disk.path),
        "disk_bytes": cfg.disk_bytes,
        "redis_url": redis.url,
        "job_timeout_s": cfg.job_timeout_s,
    }
    connector = None
    if connectors:
        connector = connectors.pop()
    engine = ServedEngine(
        _spec(model, cfg, settings, connector=connector, env=env),
        log_dir / "kvtier.log",
    )
    try:
        engine.start()
    except BaseException:
        redis.close()
        disk.close()
        flags.rmdir()
        raise
    return Stack(engine, redis, disk, flags)


def close_stack(stack: Stack, damaged: set[str] = frozenset()) -> list[Check]:
    """SIGTERM the kvtier server; check what it leaves behind; remove Redis and the disk directory."""
    engine = stack.engine
    shm = set(engine.remember_shm())
    tree = engine.pids()
    try:
        status = engine.stop(signal.SIGTERM)
        shm_left = sorted(n for n in shm if Path("/dev/shm", n).exists())
        alive = [pid for pid in tree if is_alive(pid)]
        num_tmp, bad = disk_leftovers(stack.disk.path)
        # files the fault damaged and nothing read since stay bad
        torn = sorted(set(bad) - set(damaged))
        return [
            Check("shutdown: exit status 0", status == 0, f"status={status}"),
            Check("shutdown: no process left", not alive, f"alive={alive}"),
            Check(
                "shutdown: no /dev/shm segment left",
                bool(shm) and not shm_left,
                f"mapped={sorted(shm)} left={shm_left}",
            ),
            Check(
                "shutdown: no temp file, no torn chunk file",
                num_tmp == 0 and not torn,
                f"tmp={num_tmp} bad={torn[:3]}",
            ),
        ]
    finally:
        stack.redis.close()
        stack.disk.close()
        for path in stack.flags_dir.iterdir():
            path.unlink()
        stack.flags_dir.rmdir()
