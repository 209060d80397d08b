"""The disk tier's directories: who may use them, and that nothing planted in them leads outside.

- **The root** (`disk_path`) is created if missing. It is refused, with a `ConfigError` naming
  the path and the reason, when another user owns it or when every user may write it and its
  sticky bit is off: whoever else can write there can plant a forged chunk file, or a symlink
  that turns kvtier's writes and deletes into someone else's files. The root itself may be a
  symlink (the operator's choice); the directory it leads to is what is checked.
- **Below the root no name is trusted.** The namespace directory, its `hh` directories and
  `spare/` are opened with `O_NOFOLLOW` relative to their parent's descriptor (`open_dir`), and
  `kvtier.tiers.disk.files` opens, renames and deletes files relative to those descriptors with
  `O_NOFOLLOW` too, so a symlink planted anywhere below the root fails that one operation
  (`ELOOP`, counted) instead of reaching a path outside it. The namespace directory must be
  this user's, like the root.
- **Modes**: chunk files get `file_mode` (0600 unless configured), directories kvtier makes the
  same bits plus search (0700); both are set with `fchmod`, so the umask neither widens nor
  narrows them. A namespace directory an older kvtier made (0755) is narrowed at start, which
  closes every file inside it to other users whatever its own mode.

Thread-safety: every function may run on any thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tiers.namespace import Namespace

__all__ = [
    "DIR_FLAGS",
    "FILE_MODES",
    "dir_mode_for",
    "make_directory",
    "open_dir",
    "write_namespace_json",
]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# this user only; the group may read too (e.g. `kvtier inspect` as another user)
FILE_MODES = (0o600, 0o640)


def dir_mode_for(file_mode: int) -> int:
    """A directory's mode for files of `file_mode`: the same bits, plus search wherever read is."""
    return file_mode | ((file_mode & 0o444) >> 2)


def open_dir(parent_fd: int, name: str, *, mode: int, create: bool = False) -> int:
    """A descriptor of the directory `name` inside `parent_fd`, never through a symlink.

    Args:
        mode: the mode a directory created here gets.
        create: make it if it is missing.
    Raises:
        OSError: it is missing (unless `create`), a symlink (ELOOP) or not a directory (ENOTDIR).
    """
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise
    # another thread or engine made it meanwhile
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, mode, dir_fd=parent_fd)
    fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
        os.fchmod(fd, mode)
    return fd


def make_directory(root: Path, namespace: Namespace, file_mode: int = 0o600) -> tuple[str, int]:
    """Create (or check) `<root>/<namespace id hex>` with its `namespace.json`.

    Returns:
        (its path, a descriptor of it, opened without following a symlink: the caller closes it).
    Raises:
        ConfigError: `file_mode` is not one of FILE_MODES; `root` cannot be created or written;
            another user owns it or the namespace directory; every user may write it (without
            the sticky bit); or the namespace directory is a symlink or not a directory.
    """
    if file_mode not in FILE_MODES:
        raise ConfigError(
            f"file_mode must be one of {[oct(m) for m in FILE_MODES]}, got {file_mode:#o}"
        )
    mode = dir_mode_for(file_mode)
    directory = root / namespace.id_hex
    root_fd = _open_root(root, mode)
    try:
        try:
            fd = open_dir(root_fd, namespace.id_hex, mode=mode, create=True)
        except OSError as exc:
            raise _refused(
                directory, f"it cannot be made or is not a plain directory ({exc.strerror})"
            ) from None
        try:
            _check_owner(fd, directory)
            if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
                # made by an older kvtier, or under another disk_file_mode
                os.fchmod(fd, mode)
            write_namespace_json(fd, namespace.describe(), file_mode)
        except OSError as exc:
            os.close(fd)
            raise _refused(directory, f"it is not writable ({exc.strerror})") from None
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(root_fd)
    return str(directory), fd


def write_namespace_json(dir_fd: int, description: dict[str, Any], file_mode: int = 0o600) -> None:
    """`namespace.json` for people reading the directory (written whole, then renamed)."""
    tmp = f"namespace.json.tmp.{os.getpid()}"
    # a crashed start of a process with our pid
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        file_mode,
        dir_fd=dir_fd,
    )
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, file_mode)
        f.write(json.dumps(description, indent=2, sort_keys=True) + "\n")
    os.rename(tmp, "namespace.json", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _open_root(root: Path, mode: int) -> int:
    try:
        root.mkdir(mode=mode, parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _refused(
            root, f"it cannot be created or opened as a directory ({exc.strerror})"
        ) from None
    try:
        _check_owner(fd, root)
        if stat.S_IMODE(os.fstat(fd).st_mode) & (stat.S_IWOTH | stat.S_ISVTX) == stat.S_IWOTH:
            raise _refused(
                root,
                f"every user may write it (mode {stat.S_IMODE(os.fstat(fd).st_mode):o}) and could "
                "plant files or symlinks there; chmod o-w it",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_owner(fd: int, path: Path) -> None:
    uid = os.fstat(fd).st_uid
    euid = os.geteuid()
    if uid != euid:
        raise _refused(
            path,
            f"it is owned by uid {uid}, not by this process's user (uid {euid}), who could plant "
            f"files or symlinks there; chown it to uid {euid}",
        )


def _refused(path: Path, reason: str) -> ConfigError:
    return ConfigError(
        f"disk tier directory {str(path)!r} refused: {reason}, or set disk_path to a directory of "
        "this user's"
    )
