"""How the disk tier names its files, and who wrote a temporary one.

A chunk of namespace N is the file `<root>/<N.id_hex>/<hh>/<key-hex>.kv` (`hh`: the first
two hex characters of the key, so no directory holds more than 1/256 of the files). A file is
written under a temporary name `<key-hex>.kv.tmp.<writer>.<pid>.<n>` in the same directory
and renamed once complete (see `kvtier.tiers.disk.files`); evicted files wait in `spare/`.

Temporary and spare names are unique per writer (one per `ChunkFiles` instance), not per pid:
engines in different containers share a directory with pids that may be equal (each is pid 1
in its own namespace), and a spare renamed over another engine's temporary file in flight
would publish the wrong file (issue 20, S4). `<writer>` is 8 hex characters naming the host
and pid namespace, then 8 random ones. A temporary file is abandoned (removed by a scan) when
its writer is known dead — same host and pid namespace, and its pid is gone, or is ours but
the file is older than this process — or when it is older than `TMP_MAX_AGE_S`; a writer in
another pid namespace cannot be seen, so only age tells.

Only a name these functions accept is a chunk file: `kvtier inspect` lists a directory with
them too. Thread-safety: every function and method may run on any number of threads at once.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
import socket
import time
from pathlib import Path

from kvtier.keys import OffloadKey

__all__ = [
    "SPARE_DIR",
    "TMP_MAX_AGE_S",
    "TmpNames",
    "chunk_key",
    "chunk_name",
    "hh_of",
    "is_hh_dir",
    "is_namespace_dir",
    "is_tmp",
]

SPARE_DIR = "spare"
# a temp file this old is abandoned even if a process with its pid lives
TMP_MAX_AGE_S = 600.0
# ValueHeader holds keys of at most 64 bytes
_MAX_KEY_HEX = 128
# `Namespace.id_hex`: 16 bytes
_NAMESPACE_HEX = 32


def is_namespace_dir(name: str) -> bool:
    """Whether `name` can be a namespace directory (`Namespace.id_hex`)."""
    return len(name) == _NAMESPACE_HEX and _is_hex(name)


def is_hh_dir(name: str) -> bool:
    return len(name) == 2 and _is_hex(name)


def hh_of(key: OffloadKey) -> str:
    """The name of the directory that holds `key`'s file."""
    return key.hex()[:2]


def chunk_name(key: OffloadKey) -> str:
    """The final name of `key`'s file in its hh directory."""
    return f"{key.hex()}.kv"


def chunk_key(name: str, hh: str) -> OffloadKey | None:
    """The key whose final file name is `name` in hh directory `hh`, or None for any other name."""
    stem, _, ext = name.partition(".")
    return _key_of(stem) if ext == "kv" and stem.startswith(hh) else None


def is_tmp(name: str) -> bool:
    """Whether `name` is a temporary file's (of this or an older kvtier)."""
    return name.partition(".")[2].startswith("kv.tmp.")


class TmpNames:
    """One writer's temporary and spare names, and whether another temporary file's writer is gone."""

    def __init__(self) -> None:
        self.writer = _PID_NAMESPACE + secrets.token_hex(4)
        # next() is atomic under the GIL
        self._ids = itertools.count()

    def unique_suffix(self) -> str:
        """`<writer>.<pid>.<n>`: a name no other engine sharing the directory makes."""
        return f"{self.writer}.{os.getpid()}.{next(self._ids)}"

    def tmp_name(self, key: OffloadKey) -> str:
        return f"{chunk_name(key)}.tmp.{self.unique_suffix()}"

    def is_abandoned(self, entry: os.DirEntry) -> bool:
        """Whether the temporary file `entry` (`is_tmp`) has no live writer."""
        # kv, tmp, writer, pid, n
        parts = entry.name.partition(".")[2].split(".")
        writer, pid_text = (parts[2], parts[3]) if len(parts) == 5 else ("", "")
        if len(writer) != 16 or not _is_hex(writer) or not pid_text.isdigit():
            # not a name this version writes (an older kvtier's, or junk)
            return True
        too_old = (
            time.time_ns() - entry.stat(follow_symlinks=False).st_mtime_ns > TMP_MAX_AGE_S * 1e9
        )
        if writer == self.writer or writer[:8] != _PID_NAMESPACE:
            # ours (in flight), or another container's: its pid means nothing here
            return too_old
        pid = int(pid_text)
        # another tier of this process, or a dead process that had our pid
        if pid == os.getpid():
            return entry.stat(follow_symlinks=False).st_mtime_ns < _PROCESS_STARTED_NS or too_old
        return not _is_alive(pid) or too_old


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _key_of(stem: str) -> OffloadKey | None:
    """The key a file stem names, or None (bytes.fromhex alone would also take upper case and
    spaces, naming a key whose canonical path is another file)."""
    if not 0 < len(stem) <= _MAX_KEY_HEX:
        return None
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    return key if key.hex() == stem else None


def _pid_namespace() -> str:
    """8 hex characters naming this host's boot and pid namespace (equal for every process that
    can see the others' pids, different across containers and hosts as far as can be told)."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        # unknown: then no other process counts as ours
        parts.append(secrets.token_hex(8))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


_PID_NAMESPACE = _pid_namespace()
# (about) when this process started: its tiers write after it
_PROCESS_STARTED_NS = time.time_ns()


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # exists, owned by someone else
    except PermissionError:
        return True
    return True
