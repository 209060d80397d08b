"""A shared tier's reset: the generation of what it knows, the jobs it has in flight, and the
sweep that deletes its namespace's values after `reset()` (or, on a store that cannot list,
starts a new epoch of the namespace: see the end).

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

**A store that cannot list** (`RemoteStore.lists` False, memcached-like) has nothing to list or
delete. Its values are named under the namespace's epoch (`ValueCodec.use_epoch`), a random token kept in
the store itself, in the epoch record (`kvtier.tiers.remote.epoch`); a reset replaces the token,
so every value from before it is unreachable by name, and ages out by the store's own eviction or
TTL. The rest of the rule above holds as it is: the sweep waits for the jobs from before the reset,
then replaces the record instead of listing and deleting, and names values under the new epoch
before it admits jobs again (a job names its values when it runs, so no job runs while the epoch
changes: none writes a value from before the reset under the new epoch). This is not the
per-value generation rejected above: the value format is the same, and the epoch is one record
shared by the replicas, not a counter each keeps.

The replicas sharing the namespace follow one rule:

- A tier reads the epoch before it names any value: at start it is sweeping (lookups MISS, jobs
  refused) until the record is read, or made when there is none.
- Its probe thread reads the record again every `epoch_check_s` (while the breaker is closed and
  no sweep runs). A token other than its own means that another replica reset the namespace (or
  the record was lost, which is made again with a new token): the tier then does what a reset
  does, except that the sweep reads the record instead of replacing it (a load in flight then
  fails, as at a reset). So a replica serves a value from before another replica's reset for
  about `epoch_check_s` at most (plus the probe round trip in progress), and what it stores
  meanwhile is named under the old epoch: unreachable, never wrong. While its breaker is open it
  does not read the record, and serves nothing either; the ping that would close the breaker is
  followed by a read of the record before it closes (a read that fails keeps it open), so a
  replica cut off during another's reset serves nothing from before it once it answers again.
  Following a reset, the tier announces every key it knew as removed (its own reset leaves that
  to the engine's adapter, which knows of it; another replica's it alone learns of).
- Who can write the store can also write an old token back into the record and make the replicas
  name values of a past epoch again (keyed values still pass their tags: they were this
  namespace's). A store that lists deletes them at a reset instead. Keys are no defence against a
  writer of the store here; the store's own access control is.
- A reset deletes the record and makes a new one with put-if-absent; when another replica made one
  first (after the delete, so it is as new), that one is the epoch. A record that holds no token
  is replaced. Tokens are random, never counted up: a record evicted or expired comes back as a
  new epoch (a reset), never as an old one, so losing it costs hits, never serves stale values.
  Where values expire, every read renews the record's TTL.

Thread-safety: the state changes only under the tier's lock (`cond`); `sweep` and `rejoin` run
on the tier's housekeeping thread and hold the lock only between their round trips.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtier.tiers.rate_limited_log import RateLimitedLog
from kvtier.tiers.remote.credentials import redact
from kvtier.tiers.remote.epoch import EpochRecord
from kvtier.tiers.remote.store import RemoteStore
from kvtier.tiers.remote.values import ValueCodec
from kvtier.tiers.workers import Workers

__all__ = ["ResetSweep"]

logger = logging.getLogger(__name__)

# names per delete call
_DELETE_BATCH = 512
# how often a sweep waiting for old jobs looks whether the tier closed
_WAIT_POLL_S = 0.1


class ResetSweep:
    """Args:
    cond: the tier's condition; its lock guards `generation`, `is_sweeping` and the job count.
    store: where the values are.
    codec: the namespace's names (the sweep lists them, or changes their epoch).
    workers: the tier's threads (the sweep gives up once they are closed).
    log: the tier's rate-limited log.
    retry_s: how long to wait before listing again after a failure.
    """

    def __init__(
        self,
        cond: threading.Condition,
        store: RemoteStore,
        codec: ValueCodec,
        workers: Workers,
        log: RateLimitedLog,
        retry_s: float,
    ):
        self.generation = 0
        self.is_sweeping = False
        # admitted, not over
        self._num_jobs = 0
        self._cond = cond
        self._store = store
        self._codec = codec
        self._workers = workers
        self._log = log
        self._retry_s = retry_s
        # a store that cannot list: the namespace's epoch record (else None)
        self.epoch_record = None if store.lists else EpochRecord(store, codec.epoch_name)

    @property
    def activity(self) -> str:
        """What a sweep does, for the message of a job refused meanwhile."""
        if self.epoch_record is None:
            return "deleting its values"
        return "reading or starting its namespace's epoch"

    def admit_locked(self) -> int:
        """Count a job in flight (the caller holds the lock and has checked `is_sweeping`); its
        generation."""
        self._num_jobs += 1
        return self.generation

    def job_over(self) -> None:
        """A job admitted by `admit_locked` does no more I/O: every store call it made has returned."""
        with self._cond:
            self._num_jobs -= 1
            self._cond.notify_all()

    def start_locked(self) -> int:
        """A reset: a new generation, sweeping until `sweep(generation)` (or `rejoin`) is over. The
        caller holds the lock."""
        self.generation += 1
        self.is_sweeping = True
        return self.generation

    def follow_locked(self, epoch: str, generation: int) -> int | None:
        """The probe thread read `epoch` from the record at `generation`. Where it is not the epoch
        in use and nothing changed meanwhile (another replica reset the namespace), a new
        generation starts, sweeping until `rejoin` of it is over: that generation, else None. The
        caller holds the lock, forgets what the tier knew, and then calls `rejoin_soon`."""
        if epoch == self._codec.epoch or generation != self.generation or self.is_sweeping:
            return None
        return self.start_locked()

    def rejoin_soon(self, generation: int) -> None:
        """Queue `rejoin(generation)` on the housekeeping thread (call it without the lock)."""
        self._workers.housekeep(self.rejoin, generation)

    def sweep(self, generation: int) -> None:
        """After a reset: wait for the jobs from before it, then delete every value of the
        namespace, or start a new epoch on a store that cannot list; retried until it succeeds or
        the tier closes (see the module docstring)."""
        if self.epoch_record is None:
            self._after_jobs(generation, self._delete_all)
        else:
            self._after_jobs(generation, self.epoch_record.replace)

    def rejoin(self, generation: int) -> None:
        """A store that cannot list, at start or after another replica's reset: wait for the jobs
        from before `generation`, then name values under the epoch in the record."""
        self._after_jobs(generation, self.epoch_record.read)  # type: ignore[union-attr]

    def _after_jobs(self, generation: int, step: Callable[[], str | None]) -> None:
        """Wait for the jobs admitted before `generation`, run `step` until it succeeds (an epoch
        to name values under, or None), then end the sweep, unless a later one started."""
        if not self._jobs_over(generation):
            return
        epoch = None
        is_done = False
        while not self._workers.is_closed:
            try:
                epoch = step()
                is_done = True
                break
            except Exception as exc:
                self._log.log_once("reset", f"{self._store.medium} tier: {self._not_yet(exc)}")
                time.sleep(self._retry_s)
        # closed first: a store that cannot list has no epoch to name values under
        if not is_done and self.epoch_record is not None:
            return
        with self._cond:
            if generation != self.generation:
                return
            if epoch is not None:
                self._codec.use_epoch(epoch)
            self.is_sweeping = False

    def _jobs_over(self, generation: int) -> bool:
        """Wait until every job admitted before is over; False when a later reset came meanwhile
        (its own sweep, queued behind this one, does the work)."""
        with self._cond:
            if self._num_jobs:
                logger.debug(
                    "kvtier: %s tier reset waits for %d job(s) admitted before it",
                    self._store.medium,
                    self._num_jobs,
                )
            while self._num_jobs and generation == self.generation and not self._workers.is_closed:
                self._cond.wait(_WAIT_POLL_S)
            return generation == self.generation

    def _not_yet(self, exc: Exception) -> str:
        """The log line of a sweep's step that failed (it is tried again)."""
        if self.epoch_record is None:
            return f"reset could not delete values yet: {redact(str(exc))}"
        return f"could not read or start the namespace's epoch yet: {redact(str(exc))}"

    def _delete_all(self) -> None:
        names: list[str] = []
        for name in self._store.list_names(self._codec.name_prefix):
            names.append(name)
            if len(names) >= _DELETE_BATCH:
                self._store.delete(names)
                names = []
        self._store.delete(names)
