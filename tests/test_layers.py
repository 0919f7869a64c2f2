"""The dependency direction (DESIGN.md "Layers"), and private means private.

Layers, bottom up, one row per folder:

    leaf       ds4quant/*.py: errors, names, metrics, records, progress, sizes (import nothing of ours above)
    formats    formats/        (ds4quant.formats; formats/search is its measure-stage engine)
    codebooks  codebooks/      (ds4quant.codebooks)
    artifact   ds4quant/artifact/, ds4quant/sources/, ds4quant/calib/ (the routing, imatrix and
               sensitivity file formats the runtime and the pipeline read)
    runtime    runtime/        (ds4quant.runtime)
    pipeline   ds4quant/verify/, convert/, calibrate/, plan/, publish/, inspect/, deploy/
    cli        ds4quant/cli/, and ds4quant/__main__.py (``python -m ds4quant``)

Every module of the packages is parsed (ast, never imported) and every
import is checked, at any depth (inside functions too), plus
``importlib.import_module("...")`` with a literal name. A module can import
its own layer and those below. A module that ``PLACEMENT`` does not place fails
the test: a new folder gets a row. A separate test fails an import of a
ds4quant module that does not exist (unless it is guarded by
``except ImportError``): the direction of such an import cannot be checked.

Private means private: no module imports a ``_private`` module, or a
``_private`` name, of another package. A package is the folder a module sits
in (``formats/search/`` is not ``formats/``); inside one folder, privates are
shared freely. A package that others need gives them a public name.

metrics.py is a leaf: pure numpy error sums that verify, adaptive and the
runtime's fidelity stage all consume, so it must sit below the runtime.
records.py (the records verify returns and report/publish read) is a leaf too:
it imports only names and metrics, so the runtime's fidelity stage can fill them.
"""

from __future__ import annotations

import ast
import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

LAYERS = ("leaf", "formats", "codebooks", "artifact", "runtime", "pipeline", "cli")

# Installed name -> folder in the repository (pyproject's package-dir).
PACKAGE_DIRS = {
    "ds4quant.formats": "formats",
    "ds4quant.codebooks": "codebooks",
    "ds4quant.runtime": "runtime",
    "ds4quant": "ds4quant",
}

# (repository path glob, layer); the first matching row wins. "**" matches any depth.
PLACEMENT = (
    ("ds4quant/__main__.py", "cli"),  # `python -m ds4quant` is the command line
    ("ds4quant/*.py", "leaf"),
    ("formats/**", "formats"),
    ("codebooks/**", "codebooks"),
    ("ds4quant/artifact/**", "artifact"),
    ("ds4quant/sources/**", "artifact"),
    ("ds4quant/calib/**", "artifact"),
    ("runtime/**", "runtime"),
    ("ds4quant/verify/**", "pipeline"),
    ("ds4quant/convert/**", "pipeline"),
    ("ds4quant/calibrate/**", "pipeline"),
    ("ds4quant/plan/**", "pipeline"),
    ("ds4quant/publish/**", "pipeline"),
    ("ds4quant/inspect/**", "pipeline"),
    ("ds4quant/deploy/**", "pipeline"),
    ("ds4quant/cli/**", "cli"),
)


def layer_of(path: str) -> Optional[str]:
    """The layer of a repository-relative module path, or None if unplaced."""
    for pattern, layer in PLACEMENT:
        if pattern.endswith("/**"):
            if path.startswith(pattern[:-2]):
                return layer
        elif fnmatch.fnmatchcase(path, pattern) and "/" not in path[len(pattern.split("*")[0]):]:
            return layer
    return None


def module_name(path: str) -> str:
    """Installed dotted name of a repository path: formats/q8_0.py -> ds4quant.formats.q8_0."""
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    for name, folder in PACKAGE_DIRS.items():
        if parts[0] == folder:
            return ".".join([name] + parts[1:])
    raise ValueError(f"{path} is outside the packages {sorted(PACKAGE_DIRS.values())}")


def repo_modules(root: Path = ROOT) -> dict[str, str]:
    """Installed dotted name -> repository path, for every .py file of the packages."""
    out = {}
    for folder in PACKAGE_DIRS.values():
        for p in sorted((root / folder).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            out[module_name(rel)] = rel
    return out


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # dotted module name, as resolved against the repository's modules
    optional: bool = False  # inside ``try:`` with an ``except ImportError`` (may be absent)
    name: Optional[str] = None  # ``from target import name`` where name is no module (a function, a constant)


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    t = handler.type
    names = t.elts if isinstance(t, ast.Tuple) else [t]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def _guarded_nodes(tree: ast.AST) -> set:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            for stmt in node.body:
                out.update(id(n) for n in ast.walk(stmt))
    return out


def imports_of(source: str, path: str, modules: dict[str, str]) -> list[Import]:
    """Every import of a ds4quant module in ``source`` (the file at ``path``),
    at any depth, resolved to a module of ``modules``. ``from P import n``
    targets P.n when that is a module, else P with ``name`` n; a name that
    resolves to no module of the repository is returned as is (the caller
    reports it)."""
    own = module_name(path)
    package = own if path.endswith("/__init__.py") else own.rpartition(".")[0]
    found: list[Import] = []
    tree = ast.parse(source, filename=path)
    guarded = _guarded_nodes(tree)

    def add(node: ast.AST, name: str, imported: Optional[str] = None) -> None:
        if name == "ds4quant" or name.startswith("ds4quant."):
            found.append(Import(node.lineno, name, id(node) in guarded, imported))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if sub in modules:
                    add(node, sub)
                else:
                    add(node, mod, alias.name)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if fname in ("import_module", "__import__"):
                add(node, node.args[0].value)
    return found


def _by_line(imports: list[Import]) -> list[Import]:
    """One import per (line, target module), in line order."""
    return sorted({(i.line, i.target): i for i in imports}.values(), key=lambda i: (i.line, i.target))


def problems(sources: dict[str, str], modules: dict[str, str]) -> list[str]:
    """Every unplaced module and upward import, as lines."""
    out = []
    for path, source in sorted(sources.items()):
        layer = layer_of(path)
        if layer is None:
            out.append(f"{path}: not placed in a layer; add a row to PLACEMENT in tests/test_layers.py")
            continue
        for imp in _by_line(imports_of(source, path, modules)):
            target_path = modules.get(imp.target)
            if target_path is None:
                continue  # unresolved_imports reports it
            target_layer = layer_of(target_path)
            if target_layer is None:
                continue  # reported as unplaced on its own line
            if LAYERS.index(target_layer) > LAYERS.index(layer):
                out.append(f"{path}:{imp.line} ({layer}) imports {imp.target} ({target_layer}): an upward import")
    return out


def unresolved_imports(sources: dict[str, str], modules: dict[str, str]) -> list[str]:
    """Imports of a ds4quant name that is no module of the repository (a typo, or a
    module another branch adds), except those guarded by ``except ImportError``."""
    out = []
    for path, source in sorted(sources.items()):
        for imp in _by_line(imports_of(source, path, modules)):
            if imp.target not in modules and not imp.optional:
                out.append(f"{path}:{imp.line}: imports {imp.target}, which is no module of the repository")
    return out


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def package_of(path: str) -> str:
    """The package a module sits in: the dotted name of its folder."""
    own = module_name(path)
    return own if path.endswith("/__init__.py") else own.rpartition(".")[0]


def private_imports(sources: dict[str, str], modules: dict[str, str]) -> list[str]:
    """Every import of a ``_private`` module or ``_private`` name of another package, as lines.

    A private module belongs to the package it sits in (``ds4quant.formats._x`` to
    ``ds4quant.formats``), a private name to the package of the module that
    defines it; the importer must sit in that same package (folder)."""
    out = []
    for path, source in sorted(sources.items()):
        here = package_of(path)
        seen = set()
        for imp in sorted(imports_of(source, path, modules), key=lambda i: (i.line, i.target, i.name or "")):
            parts = imp.target.split(".")
            hidden = next((k for k, part in enumerate(parts) if _private(part)), None)
            if hidden is not None:
                owner, what = ".".join(parts[:hidden]), imp.target
            elif imp.name is not None and _private(imp.name) and imp.target in modules:
                owner, what = package_of(modules[imp.target]), f"{imp.target}.{imp.name}"
            else:
                continue
            if owner != here and (imp.line, what) not in seen:
                seen.add((imp.line, what))
                out.append(f"{path}:{imp.line} imports {what}, private to {owner}")
    return out


def _repo_sources() -> dict[str, str]:
    return {rel: (ROOT / rel).read_text(encoding="utf-8") for rel in repo_modules().values()}


# --------------------------------------------------------------------------


def test_no_upward_imports_and_every_module_placed():
    found = problems(_repo_sources(), repo_modules())
    assert not found, "layer violations:\n" + "\n".join(found)


def test_no_private_import_across_a_package_line():
    found = private_imports(_repo_sources(), repo_modules())
    assert not found, "imports of another package's privates (give them a public name):\n" + "\n".join(found)


def test_every_ds4quant_import_names_a_module():
    found = unresolved_imports(_repo_sources(), repo_modules())
    assert not found, "imports of missing modules:\n" + "\n".join(found)


def test_the_checker_sees_the_repository():
    mods = repo_modules()
    assert mods["ds4quant.formats.qtype"] == "formats/qtype.py"
    assert mods["ds4quant.runtime"] == "runtime/__init__.py"
    assert mods["ds4quant"] == "ds4quant/__init__.py"
    layers = {layer_of(p) for p in mods.values()}
    assert {"leaf", "formats", "codebooks", "artifact", "runtime", "pipeline", "cli"} <= layers
    # calibrate reaches the reference model through the runtime, not transformers plumbing of its own
    calib = imports_of((ROOT / "ds4quant/calibrate/model.py").read_text(), "ds4quant/calibrate/model.py", mods)
    assert {"ds4quant.runtime.reference"} & {i.target for i in calib}


def test_placement_rows():
    assert layer_of("runtime/owners/cpu.py") == "runtime"
    assert layer_of("runtime/fidelity.py") == "runtime"
    assert layer_of("ds4quant/verify/numbers.py") == "pipeline"
    assert layer_of("ds4quant/artifact/view.py") == "artifact"
    assert layer_of("ds4quant/sources/protocol.py") == "artifact"
    assert layer_of("ds4quant/calib/routing.py") == "artifact"
    assert layer_of("ds4quant/calibrate/sensitivity.py") == "pipeline"
    assert layer_of("ds4quant/convert/encode.py") == "pipeline"
    assert layer_of("ds4quant/publish/card.py") == "pipeline"
    assert layer_of("ds4quant/plan/deep/x.py") == "pipeline"  # "**" matches any depth
    assert layer_of("ds4quant/names.py") == "leaf"
    assert layer_of("ds4quant/something_new.py") == "leaf"  # a top-level file is a leaf, or the test says why not
    assert layer_of("ds4quant/__main__.py") == "cli"
    assert layer_of("ds4quant/cli/convert.py") == "cli"
    assert layer_of("ds4quant/newfolder/x.py") is None  # a new folder needs its row
    assert layer_of("ds4quant/calibration/x.py") is None  # a folder row does not match a prefix of a folder name
    assert layer_of("ds4quant/x/names.py") is None  # the top-level file row does not cross folders
    assert package_of("formats/search/tiers.py") == "ds4quant.formats.search"
    assert package_of("formats/__init__.py") == "ds4quant.formats"
    assert package_of("ds4quant/names.py") == "ds4quant"


SYNTHETIC = {
    # a function-level import of the runtime from a codec module
    "formats/evil.py": "import numpy as np\n\ndef f():\n    from ds4quant.runtime import reference\n    return reference\n",
    # a relative import upward: from ds4quant.codebooks, '..' is ds4quant, so this is ds4quant.cli
    "codebooks/evil.py": "from .. import cli\n",
    # a dynamic import of the pipeline from the runtime
    "runtime/evil.py": "import importlib\nm = importlib.import_module('ds4quant.verify')\n",
    # a leaf that imports above the leaves
    "ds4quant/leafy.py": "from ds4quant.formats import QTYPES\n",
    # downward imports only, but in a folder no row places
    "ds4quant/newfolder/probe.py": "from ds4quant.formats import QTYPES\nimport ds4quant.runtime.reference\n",
    # an import of something that does not exist, and one guarded by except ImportError
    "ds4quant/artifact/evil.py": ("from ds4quant.artifact.nothing_here import x\n"
                                  "try:\n    from ds4quant.artifact.maybe import y\nexcept ImportError:\n    y = None\n"),
    # a guarded import is still checked for its direction when the module exists
    "formats/guarded.py": "try:\n    import ds4quant.cli\nexcept (ModuleNotFoundError, OSError):\n    pass\n",
}


def test_the_checker_catches_synthetic_violations():
    mods = dict(repo_modules())
    for path in SYNTHETIC:
        mods[module_name(path)] = path
    got = problems(SYNTHETIC, mods)
    assert got == [
        "codebooks/evil.py:1 (codebooks) imports ds4quant.cli (cli): an upward import",
        "ds4quant/leafy.py:1 (leaf) imports ds4quant.formats (formats): an upward import",
        "ds4quant/newfolder/probe.py: not placed in a layer; add a row to PLACEMENT in tests/test_layers.py",
        "formats/evil.py:4 (formats) imports ds4quant.runtime.reference (runtime): an upward import",
        "formats/guarded.py:2 (formats) imports ds4quant.cli (cli): an upward import",
        "runtime/evil.py:2 (runtime) imports ds4quant.verify (pipeline): an upward import",
    ]
    assert unresolved_imports(SYNTHETIC, mods) == [
        "ds4quant/artifact/evil.py:1: imports ds4quant.artifact.nothing_here, which is no module of the repository",
    ]
    # the same downward imports from a placed module are fine
    assert problems({"ds4quant/cli/probe.py": SYNTHETIC["ds4quant/newfolder/probe.py"]}, mods) == []


PRIVATE = {
    # a private module of formats from the planner
    "ds4quant/plan/evil.py": "from ds4quant.formats._hidden import search\n",
    # a private name of the artifact package from convert, among public ones
    "ds4quant/convert/evil.py": "from ds4quant.artifact.view import open_artifact, _rule\n",
    # a subfolder is another package: formats/search/ may not reach formats/'s privates
    "formats/search/evil.py": "from ds4quant.formats import _hidden\n",
    # relative, function-level: from runtime/owners/, '..exact' is ds4quant.runtime.exact
    "runtime/owners/evil.py": "def f():\n    from ..exact import _kernel\n    return _kernel\n",
    # dynamic
    "codebooks/evil.py": "import importlib\nm = importlib.import_module('ds4quant.formats._hidden')\n",
    # no findings: privates inside their own folder, dunder names, public names
    "formats/ok_probe.py": "from ds4quant.formats._hidden import search\nfrom ._hidden import _helper\nimport ds4quant.formats._hidden\n",
    "ds4quant/cli/ok_probe.py": "from ds4quant import __version__\nfrom ds4quant.artifact.view import open_artifact\n",
}


def test_the_checker_catches_private_imports():
    mods = dict(repo_modules())
    mods["ds4quant.formats._hidden"] = "formats/_hidden.py"
    for path in PRIVATE:
        mods[module_name(path)] = path
    assert private_imports(PRIVATE, mods) == [
        "codebooks/evil.py:2 imports ds4quant.formats._hidden, private to ds4quant.formats",
        "ds4quant/convert/evil.py:1 imports ds4quant.artifact.view._rule, private to ds4quant.artifact",
        "ds4quant/plan/evil.py:1 imports ds4quant.formats._hidden, private to ds4quant.formats",
        "formats/search/evil.py:1 imports ds4quant.formats._hidden, private to ds4quant.formats",
        "runtime/owners/evil.py:2 imports ds4quant.runtime.exact._kernel, private to ds4quant.runtime",
    ]
