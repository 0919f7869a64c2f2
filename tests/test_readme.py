"""The README's Python snippets name modules and functions that exist.

A newcomer copies them first; a module move that leaves them stale breaks
the manual silently. Only the import statements run (the rest needs data).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_python_imports_resolve():
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert blocks, "the README has a Python API section"
    checked = 0
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom):
                mod = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(mod, alias.name) or importlib.util.find_spec(
                        f"{node.module}.{alias.name}") is not None, f"{node.module}.{alias.name}"
                    checked += 1
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
                    checked += 1
    assert checked >= 3
