"""Where kvtier's copy threads run: off the cores the engine computes on, when there are others.

vLLM on CPU binds each worker's main thread to its compute cores and keeps the rest of the
machine (`VLLM_CPU_NUM_OF_RESERVED_CPU`) for everything else; threads inherit the binding of
the thread that starts them, so kvtier's copy threads would otherwise take time from the
forward pass on the compute cores (as vLLM's own CPU transfer threads avoid doing). Threads
started inside `copy_threads_off_compute_cores()` get the cores this process may use minus
the calling thread's. Where there are none (a GPU worker is bound to nothing; a machine all of
whose cores compute), or the platform cannot say, nothing changes.

Thread-safety: changes only the calling thread's binding, and restores it on exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["copy_threads_off_compute_cores", "usable_cpus"]

logger = logging.getLogger(__name__)

_CPUSET = Path("/sys/fs/cgroup/cpuset.cpus.effective")


def usable_cpus() -> set[int]:
    """The cores this process may run on (its cgroup's cpuset, else every online core)."""
    try:
        text = _CPUSET.read_text().strip()
    except OSError:
        text = ""
    if not text:
        return set(range(os.cpu_count() or 1))
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


@contextlib.contextmanager
def copy_threads_off_compute_cores() -> Iterator[set[int] | None]:
    """Threads started inside run on the usable cores the calling thread is not bound to.

    Yields:
        The cores they get, or None when their binding stays the caller's.
    """
    try:
        mine = os.sched_getaffinity(0)
        others = usable_cpus() - mine
        if others:
            os.sched_setaffinity(0, others)
    # no such call here, or a cpuset we misread
    except (AttributeError, OSError, ValueError):
        yield None
        return
    if not others:
        yield None
        return
    try:
        yield others
    finally:
        os.sched_setaffinity(0, mine)
