"""What the CLI shows, and where an engine's own output goes instead.

- `Console`: a command's own output — results on `out`, progress on `err`.
- `EngineLogs`: sends this process's stdout and stderr to a file at the file-descriptor level,
  so every process it spawns (vLLM's EngineCore and Worker inherit fds 1 and 2) and every
  library writing to them (logging, warnings, tqdm, C code) lands there too, while the
  command keeps the terminal through its `Console`. `echo=True` also copies the log to the
  terminal (`--verbose`).
- `Waiting`: a line with a spinner and the seconds elapsed, for steps with no count
  (starting an engine); `progress`: tqdm over a count when tqdm is installed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Console", "EngineLogs", "Waiting", "human_bytes", "progress"]


@dataclass
class Console:
    """Where a command's own output goes: results on `out`, progress and notes on `err`."""

    out: TextIO
    err: TextIO

    @classmethod
    def standard(cls) -> Console:
        return cls(sys.stdout, sys.stderr)

    @property
    def is_interactive(self) -> bool:
        return hasattr(self.err, "isatty") and self.err.isatty()

    def note(self, text: str) -> None:
        print(text, file=self.err, flush=True)


class EngineLogs:
    """Everything written to fds 1 and 2 (this process's and its children's) goes to `path`.

    Use as a context manager; it yields the `Console` that still reaches the terminal. On
    leaving, fds 1 and 2 are restored (an exception's traceback then shows on the terminal).

    Args:
        path: the log file (appended to, mode 0600; its directory is created).
        echo: also copy the log to the terminal's stderr, through `tee`.
    """

    def __init__(self, path: Path, echo: bool = False):
        self.path = Path(path)
        self.echo = echo
        self._saved: tuple[int, int] | None = None
        self._tee: subprocess.Popen | None = None

    def __enter__(self) -> Console:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        console = Console(_reopen(self._saved[0]), _reopen(self._saved[1]))
        target = _open_private(self.path)
        # tee appends to the file made private above
        if self.echo:
            os.close(target)
            self._tee = subprocess.Popen(
                ["tee", "-a", str(self.path)],
                stdin=subprocess.PIPE,
                stdout=self._saved[1],
                stderr=subprocess.DEVNULL,
            )
            target = self._tee.stdin.fileno()  # type: ignore[union-attr]
        os.dup2(target, 1)
        os.dup2(target, 2)
        if self._tee is None:
            os.close(target)
        else:
            # fds 1 and 2 hold the pipe now
            self._tee.stdin.close()  # type: ignore[union-attr]
        return console

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if self._saved is not None:
            os.dup2(self._saved[0], 1)
            os.dup2(self._saved[1], 2)
            os.close(self._saved[0])
            os.close(self._saved[1])
            self._saved = None
        # it ends when the last process holding the pipe (maybe a child) does
        if self._tee is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._tee.wait(timeout=5)

    def tail(self, num_lines: int = 20) -> str:
        """The last lines of the log (to show when a step failed)."""
        try:
            return "\n".join(self.path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""


class Waiting:
    """`⠋ label  12s` on the console while a step runs, `✓ label  21s` (or `✗`) when it ends.

    On a console that is not a terminal: the label when the step starts, the time when it ends.
    """

    _FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"

    def __init__(self, console: Console, label: str):
        self.console = console
        self.label = label
        self.seconds = 0.0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Waiting:
        self._start = time.perf_counter()
        if self.console.is_interactive:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        else:
            self.console.note(f"{self.label} ...")
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        self.seconds = time.perf_counter() - self._start
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        mark = "✗" if exc_type is not None else "✓"
        end = "\r\033[K" if self.console.is_interactive else ""
        print(f"{end}{mark} {self.label}  {self.seconds:.0f}s", file=self.console.err, flush=True)

    def _spin(self) -> None:
        for frame in itertools.cycle(self._FRAMES):
            elapsed = time.perf_counter() - self._start
            print(
                f"\r\033[K{frame} {self.label}  {elapsed:.0f}s",
                end="",
                file=self.console.err,
                flush=True,
            )
            if self._done.wait(0.2):
                return


def progress(
    items: Iterable[Any] | None,
    console: Console,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
) -> Iterator[Any] | Any:
    """tqdm over `items` (or a bar to `update` by hand when `items` is None) on the console's progress
    stream; a plain iterable when tqdm is not installed or the console is not a terminal."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(items)
    return tqdm(
        items,
        total=total,
        desc=desc,
        unit=unit,
        file=console.err,
        disable=not console.is_interactive,
    )


class _NoBar:
    def __init__(self, items: Iterable[Any] | None):
        self._items = items if items is not None else ()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def human_bytes(num_bytes: float) -> str:
    """`12.3 MiB`-style sizes (binary units, as the configuration's sizes)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:,.1f} {unit}"
    return f"{int(num_bytes)} B"


def _open_private(path: Path) -> int:
    """`path` for appending, readable by this user only (0600, also when it existed): an engine's
    log may hold prompts, request ids and server addresses."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def _reopen(fd: int) -> TextIO:
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace")
