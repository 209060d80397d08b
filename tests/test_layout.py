"""The plan of the house (docs/architecture.md, "Layers and data flow" and "Where things go"),
read from the source's imports: no import cycle, no import from a lower layer up, a tiers library
that needs no user configuration and no torch, and modules short enough to read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
# a soft limit, counted on the formatted source (`ruff format --check` runs first in make test):
# a longer module opens its docstring with "Longer than 500 lines: <reason>."
MAX_LINES = 500
EXEMPTION = re.compile(rf"Longer than {MAX_LINES} lines: [^.]+\.")
# lower layers first; a module may import its own layer and those before it, never one after
LAYERS = [
    ("kvtier.errors",),
    ("kvtier.keys", "kvtier.jobs", "kvtier.hints"),
    ("kvtier.policies", "kvtier.costmodel"),
    ("kvtier.base", "kvtier.settings"),
    ("kvtier.tiers", "kvtier.slab", "kvtier.shm"),
    ("kvtier.scheduler", "kvtier.worker"),
    ("kvtier.config",),
    ("kvtier.build",),
    ("kvtier.sim",),
    ("kvtier.integrations",),
    ("kvtier.cli",),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _layer(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module, path in _modules().items():
        rank = _layer(module)
        if rank is None:
            # the package's __init__: it re-exports the public names
            continue
        for name in _imports(path, top_level_only=False):
            other = _layer(name)
            if other is not None and other > rank:
                upward.append(f"{module} imports {name}")
    assert not upward


def test_the_tiers_import_no_user_configuration_and_no_torch():
    offending = [
        f"{module} imports {name}"
        for module, path in _modules().items()
        if module.startswith("kvtier.tiers")
        for name in _imports(path, top_level_only=False)
        if name.split(".")[0] == "torch" or name in ("kvtier.config", "kvtier.build")
    ]
    assert not offending


def test_no_import_cycle_between_modules():
    """Imports inside functions count too: a lazy import still ties two modules together."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {
        m: {r for n in _imports(p, top_level_only=False) if (r := resolve(n)) not in (None, m)}
        for m, p in modules.items()
    }
    cycles: list[str] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :]
            # a package's __init__ importing its own submodules is how packages re-export: not a cycle
            if not any(
                b.startswith(a + ".") for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True)
            ):
                cycles.append(" -> ".join(cycle + [module]))
            return
        if module in done:
            return
        for dep in graph[module]:
            visit(dep, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles


def test_every_module_is_short_or_says_why_not():
    long = []
    for module, path in _modules().items():
        lines = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and not EXEMPTION.match(doc):
            long.append(f"{module}: {lines} lines")
    assert not long


def test_the_exemption_is_a_docstrings_opening_sentence_only():
    """A module that merely mentions being longer, anywhere but its first words, is not exempt."""
    assert EXEMPTION.match(f"Longer than {MAX_LINES} lines: one state machine, read top to bottom.")
    assert not EXEMPTION.match(f"Store names. Longer than {MAX_LINES} lines: a reason.")
    assert not EXEMPTION.match("This module is longer than it should be.")
    assert not EXEMPTION.match(f"Longer than {MAX_LINES} lines")
