"""A shared tier's reset: the generation of what it knows, the jobs it has in flight, and the
sweep that deletes its namespace's values after `reset()`.

The rule that keeps a reset from leaving phantom hits (a key the tier calls present whose value
the sweep deleted: its lookup answers HIT, its load then fails):

1. `reset()` starts a new generation, and the tier forgets every key; until the sweep is over
   the tier admits no job (`RemoteTier` fails them at once, counted `reset_rejects`) and
   answers every lookup MISS. A store admitted then could be listed and deleted by the sweep
   while the tier remembers it; a load could serve a value from before the reset.
2. The sweep first waits for every job admitted before the reset (they end as failed, their
   generation is gone): what they write is then there to be listed, what they delete (bad
   values) is gone before any new value can take its name.
3. Only then it lists and deletes; it ends the sweep (admitting jobs again) after its last
   delete has returned. A job admitted after that writes nothing the sweep could still see.

So no interleaving lets the sweep delete a value the tier remembers, including a store
submitted just before the sweep ends (refused) and one from before the reset that ends after
it (waited for). Refusing is the simplest rule that holds: a generation per value would change
the value format, and forgetting what the sweep deletes would need the key of each listed name
(keyed names cannot be turned back into keys). What is refused would mostly have been deleted.

Nor does a value written before the reset outlive the sweep (issue 32: an S3 job reported
while an upload of it still ran let that upload land after the sweep, and a later probe served
the pre-reset value as a HIT). Waiting for the jobs covers every write from before the reset:

- Every write of the tier is made by a job: `put` and `renew` by stores, `delete` of bad
  values by loads (`RemoteTier._load`); the probe thread and `check()` only ask `exists`,
  and only the sweep itself deletes otherwise.
- A job is counted from its admission (`admit_locked`, before it is queued) until its last
  store call has returned (`job_over`, in a `finally` around the whole job).
- A store call returns, or raises, only once every request it started has ended (the
  `RemoteStore` contract; an S3 batch waits for each of its requests even after one failed).

So when the count reaches zero, every write from before the reset is in the store, for the
sweep to list, or has failed. A generation in each value's header would not need the wait,
but it changes the value format and needs one generation shared by every replica of the
namespace.

What the rule cannot see: a request the client gave up on (its timeout, or the first attempt
of an S3 request it retried) that the server still applies afterwards. The call has raised by
then, so the sweep may list before that write lands; the value then stays until the next reset
or the server's own eviction, and a probe can find it. It takes a server that keeps working on
a request for longer than the client's timeout (seconds).

Another replica sharing the namespace is not covered: its sweep can delete what this tier
stored; this tier's load then fails (`load_missing`) and forgets the key, as for any value
the server drops.

Thread-safety: the state changes only under the tier's lock (`cond`); `sweep` runs on the
tier's housekeeping thread and holds the lock only between its round trips.
"""

from __future__ import annotations

import logging
import threading
import time

from kvtier.tiers.rate_limited_log import RateLimitedLog
from kvtier.tiers.remote.credentials import redact
from kvtier.tiers.remote.store import RemoteStore
from kvtier.tiers.workers import Workers

__all__ = ["ResetSweep"]

logger = logging.getLogger(__name__)

_DELETE_BATCH = 512  # names per delete call
_WAIT_POLL_S = 0.1  # how often a sweep waiting for old jobs looks whether the tier closed


class ResetSweep:
    """Args:
    cond: the tier's condition; its lock guards `generation`, `is_sweeping` and the job count.
    store: where the values are.
    name_prefix: every name of the namespace starts with it.
    workers: the tier's threads (the sweep gives up once they are closed).
    log: the tier's rate-limited log.
    retry_s: how long to wait before listing again after a failure.
    """

    def __init__(
        self,
        cond: threading.Condition,
        store: RemoteStore,
        name_prefix: str,
        workers: Workers,
        log: RateLimitedLog,
        retry_s: float,
    ):
        self.generation = 0
        self.is_sweeping = False
        self._num_jobs = 0  # admitted, not over
        self._cond, self._store, self._prefix = cond, store, name_prefix
        self._workers, self._log, self._retry_s = workers, log, retry_s

    def admit_locked(self) -> int:
        """Count a job in flight (the caller holds the lock and has checked `is_sweeping`); its generation."""
        self._num_jobs += 1
        return self.generation

    def job_over(self) -> None:
        """A job admitted by `admit_locked` does no more I/O: every store call it made has returned."""
        with self._cond:
            self._num_jobs -= 1
            self._cond.notify_all()

    def start_locked(self) -> int:
        """A reset: a new generation, sweeping until `sweep(generation)` is over. The caller holds the lock."""
        self.generation += 1
        self.is_sweeping = True
        return self.generation

    def sweep(self, generation: int) -> None:
        """Wait for the jobs from before the reset, then delete every value of the namespace;
        retried until it succeeds or the tier closes (see the module docstring)."""
        with self._cond:
            if self._num_jobs:
                logger.debug(
                    "kvtier: %s tier reset waits for %d job(s) admitted before it",
                    self._store.medium,
                    self._num_jobs,
                )
            while self._num_jobs and generation == self.generation and not self._workers.is_closed:
                self._cond.wait(_WAIT_POLL_S)
            if generation != self.generation:
                return  # a later reset came: its own sweep (queued behind this one) does the work
        while not self._workers.is_closed:
            try:
                self._delete_all()
                break
            except Exception as exc:
                self._log.log_once(
                    "reset",
                    f"{self._store.medium} tier: reset could not delete values yet: "
                    f"{redact(str(exc))}",
                )
                time.sleep(self._retry_s)
        with self._cond:
            if generation == self.generation:
                self.is_sweeping = False

    def _delete_all(self) -> None:
        names: list[str] = []
        for name in self._store.list_names(self._prefix):
            names.append(name)
            if len(names) >= _DELETE_BATCH:
                self._store.delete(names)
                names = []
        self._store.delete(names)
