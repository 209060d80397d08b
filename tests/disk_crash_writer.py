"""A process that stores chunks into a DiskTier until it is killed (test_disk_tier's crash test).

    python tests/disk_crash_writer.py ROOT SLOT_BYTES WORLD_SIZE

Chunk i's key is `crash_key(i)` and its bytes are `chunk_content(key, rank, slot_bytes)`, so
the test can tell any served chunk from a torn one. Prints `stored <key hex>` once a store of a
key has finished (flushed at once): the test kills the process after some of these lines.
"""

from __future__ import annotations

import hashlib
import mmap
import sys
import time

import numpy as np

from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.secondary import TierJob

# stores in flight at any time, so a kill lands mid-write
IN_FLIGHT = 8


def crash_namespace(slot_bytes: int, world_size: int) -> Namespace:
    return Namespace(
        "crash-model", "float16", "blocks", 16, 4, "sha256_cbor", world_size, slot_bytes
    )


def crash_key(i: int) -> bytes:
    return hashlib.sha256(f"crash-{i}".encode()).digest() + (0).to_bytes(4, "big")


def chunk_content(key: bytes, rank: int, num_bytes: int) -> np.ndarray:
    """Bytes that differ everywhere between keys and ranks (a torn chunk cannot match)."""
    seed = int.from_bytes(hashlib.sha256(key + bytes([rank])).digest()[:8], "big")
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def main() -> None:
    root, slot_bytes, world_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    namespace = crash_namespace(slot_bytes, world_size)
    tier = DiskTier(root, namespace, capacity_bytes=1 << 40)
    rows = np.frombuffer(mmap.mmap(-1, IN_FLIGHT * world_size * slot_bytes), np.uint8)
    # page-aligned rows: O_DIRECT where allowed
    rows = rows.reshape(IN_FLIGHT, world_size, slot_bytes)
    free_rows, keys_by_job = list(range(IN_FLIGHT)), {}
    for i in range(sys.maxsize):
        while not free_rows:
            for result in tier.get_finished():
                key, row = keys_by_job.pop(result.job_id)
                if key not in result.failed_keys:
                    print(f"stored {key.hex()}", flush=True)
                free_rows.append(row)
            # the writes need the CPUs more than this loop does
            time.sleep(0.0005)
        key, row = crash_key(i), free_rows.pop()
        for rank in range(world_size):
            rows[row, rank] = chunk_content(key, rank, slot_bytes)
        keys_by_job[i] = (key, row)
        tier.submit_store(
            TierJob(
                job_id=i,
                is_store=True,
                keys=(key,),
                buffers=(tuple(memoryview(rows[row, r]) for r in range(world_size)),),
            )
        )


if __name__ == "__main__":
    main()
