"""The faults of the served soak (benchmarks/soak/), one per run, and what each must show.

A `Fault` says how the kvtier server must be started for it (a fault-injecting connector
class, environment, a small tmpfs), injects itself from the main thread while the clients
run (`inject`, at fractions of the run's requests, through `Run.at`), may hold the end of
the run until the server has recovered (`settled`), and returns its own checks. The checks
every run shares (all requests completed, outputs equal the baseline's, hits, no job in
flight, no slot pinned, bounded memory) are in run.py.

Thread-safety: none; the main thread drives a fault.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from .report import Check
from .run import Run, chunk_files, disk_leftovers, resend_served_prompt, wait_until
from .serving import Metrics

__all__ = ["FAULTS", "Fault"]


def _metric(run: Run, name: str, **labels: str) -> float:
    with contextlib.suppress(OSError):
        return run.engine.metrics().sum(name, **labels)
    return 0.0


class Fault:
    name = ""
    # the fault, in words
    what = ""
    # of the conversations its runs replay (each fault has its own)
    seed = 0
    # a class of tests/kvtier_fault_connector.py
    connector: str | None = None
    needs_tmpfs = False
    # clients resend requests that fail while the server is down
    retry = False

    def env(self, stack_flags: Path, job_timeout_s: float) -> dict[str, str]:
        return {}

    def inject(self, run: Run) -> None:
        raise NotImplementedError

    def settled(self, metrics: Metrics) -> bool:
        return True

    def checks(self, run: Run) -> list[Check]:
        return []


class RedisKill(Fault):
    name = "redis_kill"
    what = "Redis server SIGKILLed mid-run, restarted (empty) later"
    seed = 4

    def inject(self, run: Run) -> None:
        run.at(0.2)
        run.snap("fault")
        run.stack.redis.kill()
        opened = wait_until(
            lambda: _metric(run, "kvtier:tier_breaker_open", tier="redis") >= 1, 60, 1.0
        )
        run.facts["breaker_seen_open"] = opened
        run.at(0.35)
        run.stack.redis.start()
        run.snap("recovered")

    def settled(self, metrics: Metrics) -> bool:
        return metrics.sum("kvtier:tier_breaker_open", tier="redis") == 0

    def checks(self, run: Run) -> list[Check]:
        opens = run.delta("kvtier:tier_breaker_opens_total", "fault", tier="redis")
        closes = run.delta("kvtier:tier_breaker_closes_total", "fault", tier="redis")
        failed = run.delta("kvtier:tier_errors_total", "fault", tier="redis") + run.delta(
            "kvtier:tier_timeouts_total", "fault", tier="redis"
        )
        # the restarted server started empty: all written since
        keys = run.stack.redis.num_keys()
        run.facts.update(
            breaker_opens=opens, breaker_closes=closes, redis_errors=failed, redis_keys_after=keys
        )
        return [
            Check(
                "redis: breaker opened on the dead server",
                opens >= 1 and failed >= 1,
                f"opens={opens:.0f} errors+timeouts={failed:.0f}",
            ),
            Check("redis: breaker closed after the restart", closes >= 1, f"closes={closes:.0f}"),
            Check("redis: written again after the restart", keys > 0, f"keys={keys}"),
        ]


class DiskCorrupt(Fault):
    name = "disk_corrupt"
    what = "every chunk file on disk damaged under the server (bytes flipped / truncated)"
    seed = 2

    def inject(self, run: Run) -> None:
        run.at(0.3)
        run.snap("fault")
        damaged = []
        for i, path in enumerate(chunk_files(run.stack.disk.path)):
            with contextlib.suppress(FileNotFoundError):
                size = path.stat().st_size
                if i % 2:
                    os.truncate(path, size // 2)
                else:
                    # a run of bytes in the middle of the payload
                    with path.open("r+b") as f:
                        f.seek(size // 2)
                        data = f.read(64)
                        f.seek(size // 2)
                        f.write(bytes(b ^ 0xFF for b in data))
                damaged.append(str(path))
        run.facts["files_damaged"] = len(damaged)
        run.facts["damaged_paths"] = set(damaged)

    def checks(self, run: Run) -> list[Check]:
        corrupt = run.delta("kvtier:tier_corrupt_total", "fault", tier="disk")
        run.facts["corrupt_counted"] = corrupt
        return [
            Check(
                "disk: damaged files found",
                run.facts["files_damaged"] > 0,
                f"{run.facts['files_damaged']}",
            ),
            Check(
                "disk: damaged files read as corrupt (counted, never served)",
                corrupt >= 1,
                f"corrupt={corrupt:.0f}",
            ),
        ]


class DiskFull(Fault):
    name = "disk_full"
    what = "the disk tier's filesystem (a tmpfs) filled to the last byte, then freed"
    seed = 3
    needs_tmpfs = True

    def inject(self, run: Run) -> None:
        run.at(0.15)
        run.snap("fault")
        run.facts["ballast_mib"] = round(run.stack.disk.fill() / 2**20)
        run.facts["free_bytes_when_full"] = run.stack.disk.free_bytes()
        run.at(0.4)
        run.snap("recovered")
        run.stack.disk.unfill()

    def checks(self, run: Run) -> list[Check]:
        failed = run.delta(
            "kvtier:tier_failures_total", "fault", "recovered", tier="disk", direction="store"
        )
        stored = run.delta("kvtier:tier_chunks_total", "recovered", tier="disk", direction="store")
        run.facts.update(disk_store_failures=failed, disk_stores_after=stored)
        return [
            Check(
                "disk: stores failed while full (counted)", failed >= 1, f"failures={failed:.0f}"
            ),
            Check("disk: stores succeed again once freed", stored >= 1, f"stored={stored:.0f}"),
        ]


class _FlagFault(Fault):
    """A fault of SoakFaultKVTierConnector, on while its flag file exists."""

    connector = "SoakFaultKVTierConnector"
    env_name = ""

    def flag(self, run: Run) -> Path:
        return run.stack.flags_dir / f"{self.name}.flag"

    def env(self, flags_dir: Path, job_timeout_s: float) -> dict[str, str]:
        return {self.env_name: str(flags_dir / f"{self.name}.flag")}

    def inject(self, run: Run) -> None:
        run.at(0.2)
        run.snap("fault")
        self.flag(run).touch()
        run.at(0.4)
        self.flag(run).unlink()
        run.snap("recovered")

    def seen(self, run: Run) -> int:
        seen = self.flag(run).with_suffix(".seen")
        return int(seen.read_text() or 0) if seen.exists() else 0


class StuckStore(_FlagFault):
    name = "stuck_store"
    what = "store copies that never run (only their deadline ends them)"
    seed = 7
    env_name = "KVTIER_TEST_STUCK_STORES"

    def checks(self, run: Run) -> list[Check]:
        cancelled = run.delta("kvtier:cancelled_jobs_total", "fault")
        failed = run.delta("kvtier:transfer_failed_chunks_total", "fault", direction="store")
        run.facts.update(
            stuck_stores=self.seen(run), cancelled_jobs=cancelled, failed_store_chunks=failed
        )
        return [
            Check("stuck stores injected", self.seen(run) >= 1, f"stuck={self.seen(run)}"),
            Check(
                "stuck stores cancelled at their deadline, chunks dropped",
                cancelled >= 1 and failed >= 1,
                f"cancelled={cancelled:.0f} failed_chunks={failed:.0f}",
            ),
        ]


class DelayedReports(_FlagFault):
    name = "delayed_reports"
    what = "worker job reports held back past the jobs' expiry, then sent"
    seed = 1
    env_name = "KVTIER_TEST_DELAY_REPORTS"

    def env(self, flags_dir: Path, job_timeout_s: float) -> dict[str, str]:
        # a job expires job_timeout_s after its deadline, itself job_timeout_s after dispatch
        return {
            **super().env(flags_dir, job_timeout_s),
            "KVTIER_TEST_REPORT_DELAY_S": str(3 * job_timeout_s + 1),
        }

    def checks(self, run: Run) -> list[Check]:
        expired = run.delta("kvtier:expired_jobs_total", "fault")
        run.facts.update(delayed_reports=self.seen(run), expired_jobs=expired)
        return [
            Check("reports delayed", self.seen(run) >= 1, f"delayed={self.seen(run)}"),
            Check(
                "jobs expired by the scheduler, late reports ignored",
                expired >= 1,
                f"expired={expired:.0f}",
            ),
        ]


class ResetPrefixCache(Fault):
    name = "reset_prefix_cache"
    what = "POST /reset_prefix_cache?reset_external=true mid-run (3 times)"
    seed = 5

    def env(self, flags_dir: Path, job_timeout_s: float) -> dict[str, str]:
        # vLLM serves /reset_prefix_cache only in its dev mode
        return {"VLLM_SERVER_DEV_MODE": "1"}

    def _reset(self, run: Run, running: bool) -> bool:
        query = "reset_external=true" + ("&reset_running_requests=true" if running else "")
        status, body = run.engine.post(f"/reset_prefix_cache?{query}", timeout=120)
        run.facts.setdefault("resets", []).append(f"{status}:{body.get('success')}")
        return status == 200 and body.get("success") is True

    def inject(self, run: Run) -> None:
        run.at(0.25)
        run.snap("fault")
        # requests running: vLLM's own cache refuses, kvtier's resets
        self._reset(run, running=False)
        run.at(0.4)
        # running requests preempted, then both reset
        self._reset(run, running=True)
        run.at(0.55)
        # a quiet moment, to look at what the reset left
        run.clients.pause()
        try:
            run.clients.wait_idle(run.timeout_s)
            run.facts["quiet_reset"] = wait_until(lambda: self._reset(run, running=False), 60, 1.0)
            self._look(run)
        finally:
            run.clients.resume()

    def _look(self, run: Run) -> None:
        """After a reset nothing old is served: every tier is empty and a served prompt is computed anew."""
        redis = run.stack.redis
        disk = run.stack.disk.path
        run.facts["tiers_emptied"] = wait_until(
            lambda: redis.num_keys() == 0 and not chunk_files(disk), 30
        )
        run.facts["redis_keys_after_reset"] = redis.num_keys()
        run.facts["disk_files_after_reset"] = len(chunk_files(disk))
        run.facts["probe_cached_tokens"], run.facts["probe_equal"] = resend_served_prompt(run)

    def checks(self, run: Run) -> list[Check]:
        f = run.facts
        return [
            Check(
                "reset: accepted over the API",
                bool(f.get("quiet_reset")),
                ", ".join(f.get("resets", [])),
            ),
            Check(
                "reset: Redis and disk emptied",
                bool(f.get("tiers_emptied")),
                f"redis keys={f.get('redis_keys_after_reset')} disk files={f.get('disk_files_after_reset')}",
            ),
            Check(
                "reset: a served prompt is recomputed, same output",
                f.get("probe_cached_tokens") == 0 and bool(f.get("probe_equal")),
                f"cached={f.get('probe_cached_tokens')} equal={f.get('probe_equal')}",
            ),
        ]


class SigtermRestart(Fault):
    name = "sigterm_restart"
    what = "server SIGTERMed mid-run, restarted on the same disk directory"
    seed = 6
    retry = True

    def inject(self, run: Run) -> None:
        run.at(0.4)
        run.snap("fault")
        engine = run.engine
        shm = set(engine.remember_shm())
        # Requests in flight stay in flight; new ones wait (those failing now are sent again after the
        # probe below). vLLM's HTTP server keeps accepting requests while its engine drains, and one
        # accepted then never ends: the server then waits for its connection and does not exit.
        run.clients.pause()
        try:
            run.facts["sigterm_at"] = round(time.monotonic(), 1)
            run.facts["exit_status"] = engine.stop(signal.SIGTERM)
            run.facts["shm_left"] = sorted(n for n in shm if Path("/dev/shm", n).exists())
            num_tmp, bad = disk_leftovers(run.stack.disk.path)
            run.facts.update(
                tmp_files_left=num_tmp,
                torn_files=len(bad),
                files_on_disk=len(chunk_files(run.stack.disk.path)),
            )
            engine.start()
            run.facts["restarted_at"] = round(time.monotonic(), 1)
            run.snap("restarted")
            self._probe(run)
        finally:
            run.clients.resume()

    def _probe(self, run: Run) -> None:
        """Alone on the new server: a prompt the old one served must load its prefix from disk."""
        run.facts["probe_cached_tokens"], run.facts["probe_equal"] = resend_served_prompt(run)
        run.snap("probed")

    def checks(self, run: Run) -> list[Check]:
        f = run.facts
        warm = run.delta(
            "kvtier:tier_chunks_total", "restarted", "probed", tier="disk", direction="load"
        )
        loads = run.delta("kvtier:tier_chunks_total", "restarted", tier="disk", direction="load")
        corrupt = run.delta("kvtier:tier_corrupt_total", "restarted", tier="disk")
        f.update(
            probe_disk_loads=warm,
            disk_loads_after_restart=loads,
            retried=sum(o.attempts > 1 for o in run.clients.outcomes),
        )
        return [
            Check(
                "sigterm: graceful exit", f["exit_status"] == 0, f"exit status {f['exit_status']}"
            ),
            Check(
                "sigterm: no shared memory, temp or torn file left",
                not f["shm_left"] and f["tmp_files_left"] == 0 and f["torn_files"] == 0,
                f"shm={f['shm_left']} tmp={f['tmp_files_left']} torn={f['torn_files']}",
            ),
            Check(
                "restart: warm from the old server's disk files, same output",
                warm >= 1 and f["probe_cached_tokens"] > 0 and f["probe_equal"],
                f"files={f['files_on_disk']} probe: disk loads={warm:.0f} cached={f['probe_cached_tokens']} "
                f"equal={f['probe_equal']}",
            ),
            Check(
                "restart: nothing corrupt read",
                corrupt == 0,
                f"disk loads after restart={loads:.0f} corrupt={corrupt:.0f}",
            ),
        ]


class NoFault(Fault):
    name = "none"
    what = "no fault (the control run)"
    seed = 8

    def inject(self, run: Run) -> None:
        pass


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        RedisKill(),
        DiskCorrupt(),
        DiskFull(),
        StuckStore(),
        DelayedReports(),
        ResetPrefixCache(),
        SigtermRestart(),
        NoFault(),
    )
}
