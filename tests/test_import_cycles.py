"""No two modules of ours import each other, directly or around a loop,
counting imports inside functions and a package's ``__init__`` (a submodule
that imports its own package's ``__init__`` while the package imports it).

A cycle makes the import order decide what exists when, and it is how
siblings start reaching into each other's internals; DESIGN.md's layers are
a DAG of folders, this keeps the modules inside them one too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"ds4quant": "ds4quant", "ds4quant.formats": "formats", "ds4quant.codebooks": "codebooks",
                "ds4quant.runtime": "runtime"}


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for p in (root / folder).rglob("*.py"):
            parts = list(p.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = p
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom):
                if n.level:
                    base = m.split(".") if is_pkg else m.split(".")[:-1]
                    base = base[:len(base) - (n.level - 1)]
                    mod = ".".join(base + ([n.module] if n.module else []))
                else:
                    mod = n.module or ""
                names = [mod] + [f"{mod}.{a.name}" for a in n.names]
            elif isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            else:
                continue
            edges[m].update(x for x in names if x in mods and x != m)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph(modules())) == []


def test_a_planted_cycle_is_found(tmp_path):
    for folder in PACKAGE_DIRS.values():
        (tmp_path / folder).mkdir()
    (tmp_path / "ds4quant" / "a.py").write_text("def f():\n    from ds4quant import b\n")
    (tmp_path / "ds4quant" / "b.py").write_text("import ds4quant.a\n")
    (tmp_path / "ds4quant" / "c.py").write_text("from ds4quant.a import f\n")
    assert cycles(import_graph(modules(tmp_path))) == [["ds4quant.a", "ds4quant.b"]]
