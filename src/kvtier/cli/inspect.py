"""`kvtier inspect DIR`: what a disk tier directory holds, and whether every file checks out.

DIR is a disk tier's root (`disk_path`, one subdirectory per namespace) or one namespace
directory. Per namespace: what `namespace.json` says (model, dtype, layout, ...), the chunk
files `<hh>/<key-hex>.kv` (listed by the disk tier's own naming code, `kvtier.tiers.disk.names`),
their bytes, leftover temporary files and spares, and — unless `--no-verify` — a verification
pass that reads every chunk file through the disk tier's own reader
(`kvtier.tiers.disk.format.ChunkFormat`: size, header, namespace, key, length and checksum),
naming each file that fails and why. The pass only reads: nothing is deleted or
rewritten (an engine deletes a bad file itself when it reads it). Exit status 1 when a file
fails the check.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from kvtier.cli.output import Console, human_bytes, progress
from kvtier.tiers.disk.format import ChunkFormat
from kvtier.tiers.disk.names import SPARE_DIR, chunk_key, is_hh_dir, is_namespace_dir, is_tmp
from kvtier.tiers.namespace import Namespace

__all__ = ["NamespaceReport", "inspect_main", "inspect_namespace", "namespace_dirs"]


@dataclass
class NamespaceReport:
    """One namespace directory: its description, files and bytes, and the verification's findings."""

    id: str
    path: str
    description: dict = field(default_factory=dict)
    num_chunks: int = 0
    chunk_bytes: int = 0
    num_tmp_files: int = 0
    num_spares: int = 0
    verified: bool = False
    num_bad: int = 0
    # path -> why it fails
    bad_files: dict[str, str] = field(default_factory=dict)
    # why the namespace itself cannot be verified
    problem: str | None = None


def namespace_dirs(root: Path) -> list[Path]:
    """The namespace directories under `root`, or `root` itself when it is one.

    Raises:
        NotADirectoryError: `root` is not a directory.
    """
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    if is_namespace_dir(root.name):
        return [root]
    return sorted(p for p in root.iterdir() if p.is_dir() and is_namespace_dir(p.name))


def inspect_namespace(
    directory: Path, verify: bool, console: Console | None = None
) -> NamespaceReport:
    """Count (and with `verify`, check) the files of one namespace directory."""
    report = NamespaceReport(directory.name, str(directory))
    namespace = _read_namespace(directory, report)
    chunks = _chunk_files(directory, report)
    report.num_chunks = len(chunks)
    report.chunk_bytes = sum(_size(path) for path, _ in chunks)
    report.num_spares = sum(1 for p in (directory / SPARE_DIR).glob("*") if p.is_file())
    if verify and namespace is not None:
        chunk_format = ChunkFormat(namespace.id, namespace.payload_bytes)
        buffer = memoryview(bytearray(namespace.payload_bytes))
        bar = progress(
            chunks,
            console or Console.standard(),
            total=len(chunks),
            desc=f"verifying {report.id[:8]}",
            unit="file",
        )
        for path, key in bar:
            why = _check(chunk_format, path, key, buffer)
            if why is not None:
                report.bad_files[str(path)] = why
        report.num_bad = len(report.bad_files)
        report.verified = True
    return report


def inspect_main(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console.standard()
    reports = [inspect_namespace(d, args.verify, console) for d in namespace_dirs(args.dir)]
    if args.json:
        print(
            json.dumps(
                {"dir": str(args.dir), "namespaces": [asdict(r) for r in reports]}, indent=2
            ),
            file=console.out,
        )
    else:
        print(_render(args.dir, reports), file=console.out)
    return 1 if any(r.num_bad for r in reports) else 0


def _read_namespace(directory: Path, report: NamespaceReport) -> Namespace | None:
    """The `Namespace` that `namespace.json` describes, when it names this directory."""
    try:
        report.description = json.loads((directory / "namespace.json").read_text())
        names = {f.name for f in fields(Namespace)}
        namespace = Namespace(**{k: v for k, v in report.description.items() if k in names})
    except (OSError, ValueError, TypeError) as exc:
        report.problem = f"namespace.json unreadable ({exc}): chunk files not verified"
        return None
    if namespace.id_hex != directory.name:
        report.problem = f"namespace.json describes namespace {namespace.id_hex}, not this directory: not verified"
        return None
    return namespace


def _chunk_files(directory: Path, report: NamespaceReport) -> list[tuple[Path, bytes]]:
    """(path, key) of every chunk file, named as the disk tier names them (`kvtier.tiers.disk.names`);
    counts temporary files on the way."""
    chunks = []
    for sub in sorted(directory.iterdir()):
        if not is_hh_dir(sub.name) or not sub.is_dir():
            continue
        for entry in sorted(sub.iterdir()):
            key = chunk_key(entry.name, sub.name)
            if key is not None:
                chunks.append((entry, key))
            elif is_tmp(entry.name):
                report.num_tmp_files += 1
    return chunks


def _check(chunk_format: ChunkFormat, path: Path, key: bytes, buffer: memoryview) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        # an engine evicted it since the listing: not a fault
        return None
    except OSError as exc:
        return f"cannot open: {exc.strerror}"
    try:
        return chunk_format.read(fd, key, [buffer])
    except OSError as exc:
        return f"cannot read: {exc.strerror}"
    finally:
        os.close(fd)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _render(root: Path, reports: list[NamespaceReport]) -> str:
    if not reports:
        return f"{root}: no kvtier namespace directory here"
    lines = []
    for r in reports:
        d = r.description
        what = "no description"
        if d:
            what = (
                f"{d.get('model')} {d.get('dtype')}, block {d.get('block_size')} x "
                f"{d.get('blocks_per_chunk')}, {d.get('hash_algo')}, world size {d.get('world_size')}"
            )
        lines += [
            f"namespace {r.id}  ({what})",
            f"  {r.num_chunks:,} chunks, {human_bytes(r.chunk_bytes)}"
            f"   ({r.num_tmp_files} temporary, {r.num_spares} spare files)",
        ]
        if r.problem:
            lines.append(f"  {r.problem}")
        elif r.verified:
            lines.append(f"  verified: {r.num_chunks - r.num_bad:,} ok, {r.num_bad:,} bad")
            lines += [f"    BAD {path}: {why}" for path, why in sorted(r.bad_files.items())]
    return "\n".join(lines)
