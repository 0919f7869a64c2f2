"""Every package folder ships: a non-editable install (a wheel, `pip install .`)
installs only the packages pyproject lists, so a folder missing there imports
in a checkout and fails for every user of the wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    missing = []
    for name, folder in dirs.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            dotted = ".".join((name, *rel.parts)) if rel.parts else name
            if dotted.startswith("ds4quant.") and dotted.split(".")[1] in {"formats", "codebooks", "runtime"} \
                    and name == "ds4quant":
                continue  # those names map to their own folders above
            if dotted not in listed:
                missing.append(f"{dotted} ({init.parent.relative_to(ROOT)})")
    assert not missing, f"packages not in pyproject.toml: {missing}"
