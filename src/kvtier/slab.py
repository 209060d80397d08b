"""`HostSlab`: the host slab as one POSIX shared-memory segment per worker rank.

The CPU tier's slots live in shared memory that the scheduler-side process owns and every
worker maps (docs/architecture.md, "Who owns the bytes"): workers copy engine KV <-> slab, and the
scheduler side's tiered manager copies slab <-> disk or a remote store on its own threads,
without a round trip through the workers.

One segment is one file in `/dev/shm`, `kvtier-<instance>-dp<dp rank>-r<rank>`
(`slab_name`), of `num_slots x slot_bytes` bytes, mapped `MAP_SHARED`. How a segment is
created or joined, whose it may be, and when it is stale is `kvtier.shm` (a `SegmentOpener`
opens it; the module's names are re-exported here); this module is the mapping:

- **Unlink**: a slab opened with `owner=True` unlinks its name when closed, and at interpreter
  exit if it never was (`weakref.finalize`). The mapping outlives the name: views keep working.
- **Pin** (CUDA only, `pin_for_cuda`): the mapping is page-locked after the fact with vLLM's own
  `host_register` (a shared mapping cannot come from CUDA's pinned allocator), unregistered at
  close; a refusal leaves it pageable, with a warning. Unverified on a GPU.
- **Unmap**: `close` unmaps only when no view of it (`rows`, `tensor`, anything derived) is alive,
  since unmapping under a live view would turn its next access into a crash; otherwise the
  mapping goes with the last view.

Thread-safety: opening and closing are for one thread; `rows` and `tensor` may be read and
written from any thread and process, the slots' owner (the tier's bookkeeping) deciding who
touches which slot when.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import logging
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.shm import (
    SHM_DIR,
    SLAB_PREFIX,
    SegmentOpener,
    remove_stale_slabs,
    shm_free_bytes,
    slab_name,
)

__all__ = [
    "SHM_DIR",
    "SLAB_PREFIX",
    "HostRegistration",
    "HostSlab",
    "host_registration",
    "remove_stale_slabs",
    "shm_free_bytes",
    "slab_name",
]

# Linux >= 5.14; Python 3.11 lacks the name
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

logger = logging.getLogger(__name__)


class HostRegistration(NamedTuple):
    """How a host range is page-locked for CUDA: `register(ptr, num_bytes) -> bool` (True: it
    needs `unregister(ptr)` later) and where the pair comes from, for the log."""

    register: Callable[[int, int], bool]
    unregister: Callable[[int], None]
    via: str


def _cudart_register(ptr: int, num_bytes: int) -> bool:
    """`cudaHostRegister` through PyTorch's CUDA runtime bindings (flags 0: portable off)."""
    error = int(torch.cuda.cudart().cudaHostRegister(ptr, num_bytes, 0))
    if error != 0:
        logger.warning("kvtier: cudaHostRegister failed (code=%d)", error)
    return error == 0


def _cudart_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def host_registration() -> HostRegistration:
    """vLLM's own `host_register` / `host_unregister` (`vllm/v1/kv_offload/cpu/host_register.py`,
    vLLM 0.32 and 0.33: what its offloading worker pins its shared region with) where this vLLM
    has them; else `cudaHostRegister` through `torch.cuda.cudart()`. Import checks only."""
    try:
        vllm_pin = importlib.import_module("vllm.v1.kv_offload.cpu.host_register")
    # no vLLM, or one without the module
    except Exception:
        vllm_pin = None
    register = getattr(vllm_pin, "host_register", None)
    unregister = getattr(vllm_pin, "host_unregister", None)
    if register is not None and unregister is not None:
        return HostRegistration(register, unregister, "vLLM host_register")
    return HostRegistration(_cudart_register, _cudart_unregister, "torch cudaHostRegister")


@dataclass(slots=True)
class _Segment:
    """What closing needs, kept apart from `HostSlab` so a finalizer can hold it."""

    path: str
    fd: int
    mm: mmap.mmap | None
    unlink_on_close: bool
    # a forked child inherits the finalizer: only the opener's process unlinks
    pid: int
    pinned_ptr: int = 0
    # how `pinned_ptr` was registered, to unregister it the same way
    unpin: Callable[[int], None] | None = None


def _release(segment: _Segment) -> None:
    """Unpin, unmap (unless views are alive), unlock, and unlink if this process owns the name."""
    # a forked child inherits the finalizer, not the CUDA registration: only the pinning process
    if segment.pinned_ptr and segment.unpin is not None and segment.pid == os.getpid():
        try:
            segment.unpin(segment.pinned_ptr)
        # the mapping goes anyway; the driver drops its registration with it
        except Exception as e:
            logger.warning("kvtier: could not unpin the host slab %s: %r", segment.path, e)
    segment.pinned_ptr = 0
    if segment.mm is not None:
        try:
            segment.mm.close()
        # views still alive: the mapping ends with the last of them
        except BufferError:
            logger.debug("kvtier: %s stays mapped until its views are gone", segment.path)
        segment.mm = None
    if segment.fd >= 0:
        # drops our LOCK_SH
        os.close(segment.fd)
        segment.fd = -1
    if segment.unlink_on_close and segment.pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.path)


class HostSlab:
    """One rank's host slab in shared memory: `num_slots` rows of `slot_bytes` bytes.

    Creates the segment or opens the existing one (see the module docstring).
    Args:
        name: the segment's file name in `directory` (`slab_name`).
        num_slots, slot_bytes: the slab's shape; an existing segment must hold exactly their product.
        owner: unlink the name on `close` (and at interpreter exit, as a fallback).
        populate: map every page into this process at once: for the process that copies in its
            hot path (a worker); one that touches few rows, or off its hot path, skips the cost.
        directory: where segments live (tests may use another tmpfs).
    Raises:
        ConfigError: bad sizes, an existing segment of another size, or no room in `directory`.
    """

    def __init__(
        self,
        name: str,
        num_slots: int,
        slot_bytes: int,
        *,
        owner: bool = False,
        populate: bool = True,
        directory: str = SHM_DIR,
    ) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ConfigError(
                f"a host slab needs num_slots and slot_bytes >= 1, got {num_slots}, {slot_bytes}; "
                "raise cpu_bytes"
            )
        self.name = name
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.path = os.path.join(directory, name)
        self.num_bytes = num_slots * slot_bytes
        self.is_owner = owner
        opened = SegmentOpener(self.path, num_slots, slot_bytes).open()
        self.is_creator = opened.is_creator
        mm = opened.mm
        self._segment = _Segment(self.path, opened.fd, mm, owner, os.getpid())
        self._finalizer = weakref.finalize(self, _release, self._segment)
        if populate:
            try:
                _populate(mm, self.path)
            except BaseException:
                self._finalizer()
                raise
        self.rows: np.ndarray = np.frombuffer(mm, dtype=np.uint8).reshape(num_slots, slot_bytes)
        # through a memoryview: torch.frombuffer(mm) would not pin the mmap's buffer, so the mmap
        # could be closed under the tensor; a memoryview makes close() refuse while it lives
        self.tensor: torch.Tensor = torch.frombuffer(memoryview(mm), dtype=torch.int8).view(
            num_slots, slot_bytes
        )

    @property
    def is_closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def is_pinned(self) -> bool:
        """True while the mapping is page-locked by `pin_for_cuda`."""
        return bool(self._segment.pinned_ptr)

    def pin_for_cuda(self) -> bool:
        """Page-lock the mapping for fast, asynchronous CUDA copies (`host_registration`); `close`
        unregisters it.

        UNVERIFIED: no GPU on the development machines. Pinning only speeds copies up: on
        failure (or without CUDA) the slab stays pageable, copies still work, and it says so.
        Returns:
            True when the mapping is pinned (now or before).
        """
        if self._segment.pinned_ptr:
            return True
        if self.is_closed or not torch.cuda.is_available():
            return False
        registration = host_registration()
        ptr = self.tensor.data_ptr()
        why = "registration refused"
        try:
            is_pinned = bool(registration.register(ptr, self.num_bytes))
        # pinning is an optimization: say why it is off, go on
        except Exception as e:
            is_pinned = False
            why = repr(e)
        if not is_pinned:
            logger.warning(
                "kvtier: could not pin the host slab %s through %s (%s); CUDA copies use "
                "pageable memory (pinned=0)",
                self.name,
                registration.via,
                why,
            )
            return False
        self._segment.pinned_ptr = ptr
        self._segment.unpin = registration.unregister
        logger.info(
            "kvtier: host slab %s pinned through %s (pinned=1)", self.name, registration.via
        )
        return True

    def close(self) -> None:
        """Unpin, unmap (once no view is alive), release the lock; unlink if owner (idempotent)."""
        # our own views must not keep it mapped
        self.rows = None  # type: ignore[assignment]
        self.tensor = None  # type: ignore[assignment]
        self._finalizer()

    def __enter__(self) -> HostSlab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        closed = ", closed" if self.is_closed else ""
        return f"HostSlab({self.name!r}, {self.num_slots} x {self.slot_bytes} bytes{closed})"


def _populate(mm: mmap.mmap, path: str) -> None:
    """Map every page into this process now, so copies never fault on first touch (a first copy
    into 1 GiB ran at 40 % of the warm rate here; populating costs ~0.25 s per GiB)."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
        return
    except OSError as e:
        # EFAULT: pages that could not be allocated (no fallocate, no room)
        if e.errno != errno.EINVAL:
            raise ConfigError(
                f"could not allocate the host slab {path} ({len(mm)} bytes): {e.strerror}; lower "
                "cpu_bytes or enlarge /dev/shm (docker: --shm-size)"
            ) from None
    # kernels before 5.14: read one byte per page (a write could clobber another process's slots)
    int(np.frombuffer(mm, dtype=np.uint8)[:: mmap.PAGESIZE].max())
