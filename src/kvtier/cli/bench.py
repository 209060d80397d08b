"""`kvtier bench`: run the benchmarks in `benchmarks/` and collect their RESULT lines.

Every benchmark prints, as its last line, `RESULT key=value ...`: its figures as ratios
against a baseline measured in the same run (see `benchmarks/README.md`). This runs each
`bench_*.py` (with `--quick` unless `--full`) in its own process, one at a time, and shows
the RESULT figures in a table, or as `{"bench_disk": {"disk_store_ratio": 1.9, ...}}` with
`--json`. A benchmark that fails or prints no RESULT is reported with its last lines of
output, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.cli.output import Console, Waiting

__all__ = ["BenchRun", "bench_main", "find_benchmarks", "parse_result"]


@dataclass
class BenchRun:
    """One benchmark's outcome: its RESULT figures, or why there are none."""

    name: str
    figures: dict[str, float | str] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None


def find_benchmarks(directory: Path | None, only: list[str] | None) -> list[Path]:
    """The `bench_*.py` files of `directory` (default: the source checkout's `benchmarks/`).

    Raises:
        FileNotFoundError: no such directory, or no benchmark matches `only`.
    """
    directory = directory or Path(__file__).resolve().parents[2] / "benchmarks"
    if not directory.is_dir():
        raise FileNotFoundError(
            f"no benchmarks directory {directory} (run from a source checkout, or pass --dir)"
        )
    scripts = sorted(directory.glob("bench_*.py"))
    if only:
        wanted = {name.removeprefix("bench_").removesuffix(".py") for name in only}
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in wanted]
        missing = wanted - {s.stem.removeprefix("bench_") for s in scripts}
        if missing:
            raise FileNotFoundError(f"no benchmark named {sorted(missing)} in {directory}")
    return scripts


def parse_result(output: str) -> dict[str, float | str]:
    """The figures of the last `RESULT k=v ...` line of `output` (numbers as floats), or {}."""
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {}
    figures: dict[str, float | str] = {}
    for pair in lines[-1].split()[1:]:
        key, _, value = pair.partition("=")
        try:
            figures[key] = float(value)
        except ValueError:
            figures[key] = value
    return figures


def run_benchmark(
    script: Path, full: bool, timeout: float, console: Console, verbose: bool
) -> BenchRun:
    """Run one benchmark script to its end (or `timeout`), in its directory's parent (the checkout)."""
    run = BenchRun(script.stem)
    command = [sys.executable, str(script), *([] if full else ["--quick"])]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(script.parent), os.environ.get("PYTHONPATH")])
        ),
    }
    start = time.perf_counter()
    try:
        with Waiting(console, f"{script.stem}{'' if full else ' --quick'}"):
            done = subprocess.run(
                command,
                cwd=script.parent.parent,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
    except subprocess.TimeoutExpired:
        run.error = f"still running after {timeout:.0f} s: stopped"
        return run
    run.seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    if verbose:
        console.note(output.rstrip())
    run.figures = parse_result(done.stdout)
    if done.returncode != 0 or not run.figures:
        tail = "\n    ".join(output.strip().splitlines()[-5:])
        run.error = (
            f"exit status {done.returncode}{'' if run.figures else ', no RESULT line'}:\n    {tail}"
        )
    return run


def bench_main(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console.standard()
    runs = [
        run_benchmark(script, args.full, args.timeout, console, args.verbose)
        for script in find_benchmarks(args.dir, args.only)
    ]
    if args.json:
        print(
            json.dumps(
                {
                    r.name: {"figures": r.figures, "seconds": round(r.seconds, 1), "error": r.error}
                    for r in runs
                },
                indent=2,
            ),
            file=console.out,
        )
    else:
        print(_table(runs), file=console.out)
    return 1 if any(r.error for r in runs) else 0


def _table(runs: list[BenchRun]) -> str:
    width = max((len(r.name) for r in runs), default=0)
    lines = []
    for r in runs:
        shown = "  ".join(f"{k}={_number(v)}" for k, v in r.figures.items())
        if r.error:
            lines.append(f"{r.name:<{width}}  FAILED {r.error}")
        else:
            lines.append(f"{r.name:<{width}}  {shown}")
    return "\n".join(lines)


def _number(value: float | str) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return value
