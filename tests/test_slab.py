"""The host slab in shared memory: one segment per rank, shared across processes, never leaked.

Every segment here has a name unique to the test (`name` fixture), so a stale-segment sweep
in one test only sees its own, and nothing of a real engine on the same host is touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import types
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import HANG_S, store_job
from kvtier import shm as slab_module
from kvtier.errors import ConfigError
from kvtier.jobs import StepPlan
from kvtier.sim.kv_cache import KVCache
from kvtier.slab import (
    SHM_DIR,
    HostSlab,
    host_registration,
    remove_stale_slabs,
    shm_free_bytes,
    slab_name,
)
from kvtier.worker import TransferEngine, WorkerSide
from kvtier.worker.layouts import build_group_layouts, slot_bytes_of
from sched_helpers import make_engine

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)")


@pytest.fixture
def prefix():
    """A name prefix no other test or engine uses; whatever is left under it is removed afterwards."""
    # not "kvtier-": an engine beside us sweeps that
    prefix = f"kvtest-{uuid.uuid4().hex[:8]}-"
    yield prefix
    for leftover in [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]:
        os.unlink(os.path.join(SHM_DIR, leftover))


def segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def child(code: str) -> subprocess.Popen:
    """A Python process running `code` (which prints "ready" once it holds what it should)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert (
        proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    ), "the child did not start"
    return proc


def finish(proc: subprocess.Popen, reply: str = "") -> str:
    """Send `reply`, let the child end; its output after "ready"."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(reply)
    proc.stdin.close()
    # not communicate(): it would skip what readline() buffered
    out = proc.stdout.read()
    assert proc.wait(timeout=HANG_S) == 0, out
    return out


# -- sharing --------------------------------------------------------------------------------


def test_a_second_process_maps_the_same_bytes_both_ways(prefix):
    name = prefix + "dp0-r0"
    with HostSlab(name, num_slots=4, slot_bytes=5000, owner=True) as slab:
        assert slab.is_creator and os.path.getsize(slab.path) == 20_000
        # page-aligned base
        assert slab.rows.ctypes.data % os.sysconf("SC_PAGE_SIZE") == 0
        slab.rows[1, :3] = [7, 8, 9]
        # another process opens it by name (as a worker does), reads ours, writes its own
        proc = child(f"""
            from kvtier.slab import HostSlab
            slab = HostSlab({name!r}, 4, 5000)
            print("ready", flush=True)
            assert not slab.is_creator and slab.tensor.shape == (4, 5000)
            print(slab.tensor[1, :3].tolist())
            slab.tensor[3, -2:] = 42
            slab.close()
        """)
        assert finish(proc).strip() == "[7, 8, 9]"
        # its write, seen here
        assert slab.rows[3, -2:].tolist() == [42, 42]
    # the owner unlinked it
    assert not os.path.exists(slab.path)


def test_both_roles_in_one_process_share_one_segment(prefix):
    # the single-process engine: the worker maps what the scheduler side created
    owner = HostSlab(prefix + "r0", 2, 4096, owner=True)
    worker = HostSlab(prefix + "r0", 2, 4096)
    worker.tensor[0, 0] = 5
    assert owner.rows[0, 0] == 5 and owner.is_creator and not worker.is_creator
    worker.close()
    # a non-owner leaves the name
    assert segments(prefix) == [prefix + "r0"]
    owner.close()
    assert segments(prefix) == []


def resident_kib(address: int) -> int:
    """Rss of the mapping of this process that starts at `address` (from /proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith(f"{address:x}-")))
    return int(next(line.split()[1] for line in lines[start + 1 :] if line.startswith("Rss:")))


def test_a_new_segment_is_allocated_at_once_and_a_populating_opener_maps_every_page(prefix):
    # the scheduler side creates without populating its own mapping; the pages exist all the same
    owner = HostSlab(prefix + "r0", 64, 4096, owner=True, populate=False)
    # allocated: a full /dev/shm fails here
    assert os.stat(owner.path).st_blocks * 512 >= 64 * 4096
    # not mapped into this process yet
    assert resident_kib(owner.tensor.data_ptr()) == 0
    # a worker populates its mapping: its copies never fault on first touch
    worker = HostSlab(prefix + "r0", 64, 4096)
    assert resident_kib(worker.tensor.data_ptr()) == 64 * 4
    worker.close()
    owner.close()


def test_pinning_for_cuda_is_skipped_without_cuda_and_never_fails(prefix):
    # the pinned path (cudaHostRegister) is unverified: no GPU on the development machines
    with HostSlab(prefix + "r0", 2, 4096, owner=True) as slab:
        assert slab.pin_for_cuda() == torch.cuda.is_available()


class FakeVllmPinning:
    """Stands in for `vllm.v1.kv_offload.cpu.host_register` (no GPU here): records the calls,
    says yes or no as told. What is under test is HostSlab's handling, not the registration."""

    def __init__(self, monkeypatch, accepts: bool) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.accepts = accepts
        module = types.ModuleType("vllm.v1.kv_offload.cpu.host_register")
        module.host_register = self.register
        module.host_unregister = self.unregistered.append
        monkeypatch.setitem(sys.modules, module.__name__, module)
        # as on a CUDA machine
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def register(self, ptr: int, num_bytes: int) -> bool:
        self.registered.append((ptr, num_bytes))
        return self.accepts


def test_a_slab_is_pinned_through_vllms_host_register_and_unpinned_at_close(prefix, monkeypatch):
    vllm = FakeVllmPinning(monkeypatch, accepts=True)
    slab = HostSlab(prefix + "r0", 2, 4096, owner=True)
    ptr = slab.tensor.data_ptr()
    # the whole mapping is registered, once
    assert slab.pin_for_cuda() and slab.pin_for_cuda()
    assert slab.is_pinned
    assert vllm.registered == [(ptr, 2 * 4096)]
    # close unregisters the same range through the same module
    slab.close()
    assert vllm.unregistered == [ptr]
    assert not slab.is_pinned


def test_a_refused_registration_is_a_warning_and_a_pageable_slab(prefix, monkeypatch, caplog):
    vllm = FakeVllmPinning(monkeypatch, accepts=False)
    with HostSlab(prefix + "r0", 2, 4096, owner=True) as slab:
        assert not slab.pin_for_cuda()
        assert not slab.is_pinned
    assert "pinned=0" in caplog.text
    # nothing registered: nothing to unregister
    assert vllm.unregistered == []


def test_without_vllms_host_register_the_torch_cuda_runtime_pins(monkeypatch):
    # a vLLM without the module (or no vLLM): the fallback pair
    monkeypatch.setitem(sys.modules, "vllm.v1.kv_offload.cpu.host_register", None)
    assert host_registration().via == "torch cudaHostRegister"
    vllm_module = types.ModuleType("vllm.v1.kv_offload.cpu.host_register")
    vllm_module.host_register = vllm_module.host_unregister = print
    monkeypatch.setitem(sys.modules, vllm_module.__name__, vllm_module)
    assert host_registration().via == "vLLM host_register"


def test_an_existing_segment_of_another_size_is_a_config_error(prefix):
    with HostSlab(prefix + "r0", 4, 1000, owner=True):
        with pytest.raises(
            ConfigError, match=r"holds 4000 bytes but this process computed 4 slots x 1001 bytes"
        ):
            HostSlab(prefix + "r0", 4, 1001)
        # the creator's segment is untouched
        assert segments(prefix) == [prefix + "r0"]


def test_a_segment_too_big_for_dev_shm_is_a_config_error_naming_cpu_bytes(prefix):
    slot_bytes = 1 << 20
    # more than /dev/shm holds in all (checked before anything is allocated): never fits, whatever
    # another process frees meanwhile (free bytes + 16 MiB would, if an engine beside us exited)
    fs = os.statvfs(SHM_DIR)
    num_slots = fs.f_blocks * fs.f_frsize // slot_bytes + 16
    assert num_slots * slot_bytes > shm_free_bytes()
    with pytest.raises(ConfigError, match="free; lower cpu_bytes"):
        HostSlab(prefix + "r0", num_slots, slot_bytes, owner=True)
    assert segments(prefix) == []


def test_bad_shapes_and_names_are_config_errors(prefix):
    with pytest.raises(ConfigError, match="raise cpu_bytes"):
        HostSlab(prefix + "r0", 0, 4096)
    with pytest.raises(ConfigError, match="no instance id"):
        slab_name("", 0, 0)
    assert slab_name("1234_dp1/x", 1, 3) == "kvtier-1234_dp1_x-dp1-r3"


# -- unlinking and stale segments -----------------------------------------------------------


def test_views_outlive_close_and_the_name_goes(prefix):
    slab = HostSlab(prefix + "r0", 2, 4096, owner=True)
    rows = slab.rows
    rows[1, 7] = 3
    slab.close()
    assert segments(prefix) == [] and slab.is_closed
    # still mapped: it is unmapped with its last view
    assert rows[1, 7] == 3
    # idempotent
    slab.close()


def test_an_owner_that_exits_without_closing_leaves_nothing(prefix):
    # the interpreter's exit unlinks it (weakref.finalize), even with a view still alive
    proc = child(f"""
        from kvtier.slab import HostSlab
        slab = HostSlab({prefix + "r0"!r}, 2, 4096, owner=True)
        ROWS = slab.rows
        print("ready", flush=True)
        input()
    """)
    assert segments(prefix) == [prefix + "r0"]
    finish(proc, "exit\n")
    assert segments(prefix) == []


def test_stale_cleanup_removes_a_killed_processs_segment_and_keeps_a_live_ones(prefix):
    holder = """
        from kvtier.slab import HostSlab
        slab = HostSlab({name!r}, 2, 4096, owner=True)
        print("ready", flush=True)
        input()
    """
    killed = child(holder.format(name=prefix + "crashed"))
    alive = child(holder.format(name=prefix + "alive"))
    # no finalizer runs: its segment stays behind
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=HANG_S)
    assert segments(prefix) == [prefix + "alive", prefix + "crashed"]
    assert remove_stale_slabs(prefix) == [prefix + "crashed"]
    # its process still maps it
    assert segments(prefix) == [prefix + "alive"]
    finish(alive, "exit\n")
    assert segments(prefix) == []


def test_a_segment_this_process_maps_is_never_stale(prefix):
    with HostSlab(prefix + "r0", 2, 4096):
        assert remove_stale_slabs(prefix) == []
        assert segments(prefix) == [prefix + "r0"]


def test_a_cleaner_unlinking_a_new_segment_before_it_is_locked_makes_the_open_start_over(
    prefix, monkeypatch
):
    # the race between create and lock: a cleaner sees the new file unlocked and unlinks it
    real_lock, swept = slab_module._lock_shared, []

    def lock_after_a_sweep(fd):
        if not swept:
            swept.extend(remove_stale_slabs(prefix))
        real_lock(fd)

    monkeypatch.setattr(slab_module, "_lock_shared", lock_after_a_sweep)
    with HostSlab(prefix + "r0", 2, 4096, owner=True) as slab:
        # the first attempt was swept away...
        assert len(swept) == 1 and swept[0].startswith(prefix + "r0.new-")
        # ...this one is at the path
        assert os.stat(slab.path).st_ino == os.fstat(slab._segment.fd).st_ino
        # held, temp gone
        assert remove_stale_slabs(prefix) == [] and segments(prefix) == [prefix + "r0"]


def test_of_two_racing_creators_the_first_to_publish_wins_and_the_other_joins(prefix, monkeypatch):
    # another process publishes the segment while this one is still allocating its own
    real_allocate, rival = slab_module.SegmentOpener._allocate, []

    def allocate_while_a_rival_publishes(self, fd):
        real_allocate(self, fd)
        rival.append(
            child(f"""
            from kvtier.slab import HostSlab
            slab = HostSlab({prefix + "r0"!r}, 2, 4096)
            slab.rows[1, 0] = 9
            print("ready", flush=True)
            input()
        """)
        )

    monkeypatch.setattr(slab_module.SegmentOpener, "_allocate", allocate_while_a_rival_publishes)
    with HostSlab(prefix + "r0", 2, 4096, owner=True) as slab:
        # we mapped the rival's
        assert not slab.is_creator and slab.rows[1, 0] == 9
        # our temporary is gone
        assert segments(prefix) == [prefix + "r0"]
        finish(rival[0], "exit\n")


# -- the worker maps its rank's slab ---------------------------------------------------------


def test_a_worker_maps_the_slab_the_scheduler_side_made_and_stores_into_it(prefix):
    kv = KVCache(num_groups=1, num_blocks=8, block_size=4)
    slot_bytes = slot_bytes_of(build_group_layouts(kv.tensors, 1, kv.layer_groups))
    with HostSlab(prefix + "r0", 4, slot_bytes, owner=True) as owner:
        worker = WorkerSide(
            num_slots=4, blocks_per_chunk=1, layer_groups=kv.layer_groups, slab_name=owner.name
        )
        worker.register_kv_caches(kv.tensors)
        kv.write(0, [5], [kv.content(b"block five", 0)])
        # store block 5 into slot 2: the bytes land in the segment the scheduler side maps
        worker.wait_for_save(StepPlan(store_jobs=[store_job(1, np.array([5]), np.array([2]))]))
        assert worker.transfer.wait([1], timeout=HANG_S) and worker.take_results()[0].success
        expected = torch.cat(
            [kv.tensors[name][5].flatten().view(torch.int8) for name in kv.layer_groups[0]]
        )
        assert torch.equal(torch.from_numpy(owner.rows[2]).view(torch.int8), expected)
        worker.shutdown()
    assert segments(prefix) == []


def test_a_worker_whose_slab_is_pinned_counts_it_once_in_its_stats(prefix, monkeypatch):
    FakeVllmPinning(monkeypatch, accepts=True)
    kv = KVCache(num_groups=1, num_blocks=8, block_size=4)

    def pinning_transfer(*args, slab, **kwargs):
        # what TransferEngine does with a HostSlab when the KV caches are on CUDA
        slab.pin_for_cuda()
        return TransferEngine(*args, slab=slab, **kwargs)

    worker = WorkerSide(
        num_slots=4,
        blocks_per_chunk=1,
        layer_groups=kv.layer_groups,
        slab_name=prefix + "r0",
        transfer_factory=pinning_transfer,
    )
    worker.register_kv_caches(kv.tensors)
    # reported once: a counter of pinned slabs, summed over workers
    assert worker.take_stats() == {"pinned_slabs": 1}
    assert worker.take_stats() == {}
    worker.shutdown()
    assert segments(prefix) == []


def test_a_worker_whose_kv_caches_need_another_slot_size_is_a_config_error(prefix):
    kv = KVCache(num_groups=1, num_blocks=8, block_size=4)
    slot_bytes = slot_bytes_of(build_group_layouts(kv.tensors, 1, kv.layer_groups))
    with HostSlab(prefix + "r0", 4, slot_bytes + 8, owner=True):
        worker = WorkerSide(
            num_slots=4, blocks_per_chunk=1, layer_groups=kv.layer_groups, slab_name=prefix + "r0"
        )
        with pytest.raises(ConfigError, match="disagree on the slab's shape"):
            worker.register_kv_caches(kv.tensors)
        assert worker.transfer is None and segments(prefix) == [prefix + "r0"]


def test_a_transfer_engine_refuses_a_slab_of_another_shape():
    kv = KVCache(num_groups=1, num_blocks=8, block_size=4)
    slot_bytes = slot_bytes_of(build_group_layouts(kv.tensors, 1, kv.layer_groups))
    with pytest.raises(ConfigError, match=rf"int8 CPU tensor of 4 slots x {slot_bytes} bytes"):
        TransferEngine(
            kv.tensors,
            1,
            4,
            layer_groups=kv.layer_groups,
            slab=torch.zeros((4, slot_bytes + 1), dtype=torch.int8),
        )


def test_the_fake_engine_keeps_its_slab_in_shared_memory_and_unlinks_it_on_close():
    engine = make_engine(num_slots=8)
    # its "scheduler" made it; its worker mapped it by name
    (slab,) = engine.slabs
    engine.add_request("A", list(range(20)))
    engine.run()
    # the worker's stores landed in the segment the scheduler side maps
    assert slab.rows.any()
    # the other way: the worker's mapping sees the scheduler side's writes
    slab.rows[7, :4] = [
        1,
        2,
        3,
        4,
    ]
    assert engine.transfer.slab[7, :4].tolist() == [1, 2, 3, 4]
    # two mappings of one segment
    assert engine.transfer.slab.data_ptr() != slab.tensor.data_ptr()
    engine.close()
    assert not os.path.exists(slab.path)
