"""The model card and everything a release ships: no absolute path of the maker's machine, a
title that is the model's name, and a "How to load it" snippet that runs as printed on every
artifact kind.

Each test fails on the code before the fix: the card, manifest.json and verify.json carried the
convert command line, the source and the imatrix with their absolute paths; the card's title was
the release folder's name; its snippet raised CodebookError on every adaptive (MIX) release.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
from pathlib import Path

import pytest

from ds4quant.artifact.portable import portable_command, portable_manifest_json, portable_path
from ds4quant.convert import convert
from ds4quant.plan import AdaptiveOptions
from ds4quant.publish import publish
from tests._verify_util import SAMPLE

IMATRIX = SAMPLE.parent / "ds4-tiny-calib" / "imatrix.gguf"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A private copy of the sample, its imatrix, and three artifacts made from them by absolute paths."""
    root = tmp_path_factory.mktemp("card").resolve()
    src, imx = root / "models" / "ds4-tiny", root / "calib" / "imatrix.gguf"
    shutil.copytree(SAMPLE, src)
    imx.parent.mkdir()
    shutil.copyfile(IMATRIX, imx)
    arts = {}
    for kind, recipe, kw in (
        ("uniform", "rocmfp3", {}),
        ("mxfp4", "mxfp4", {}),
        ("adaptive", "adaptive", {"adaptive": AdaptiveOptions(
            target_bpw=2.8, candidates=("rocmfp2", "rocmfp2_mix", "rocmfp3"), granularity="expert",
            fit_iterations=1, fit_restarts=0, fit_max_rows=32, cache_dir=str(root / "cache"))}),
    ):
        out = root / "work" / kind
        cmd = ["ds4quant", "convert", str(src), str(out), "--recipe", recipe, "--imatrix", str(imx)]
        convert(src, out, recipe, imatrix=imx, command=cmd, threads=1, **kw)
        arts[kind] = out
    return root, src, imx, arts


def _shipped_text(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): p.read_text(encoding="utf-8")
            for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix in (".md", ".json", "")}


@pytest.mark.parametrize("kind", ["uniform", "mxfp4", "adaptive"])
def test_a_release_ships_no_absolute_path_and_its_snippet_runs_as_printed(world, kind, monkeypatch):
    root, src, imx, arts = world
    rel = root / "releases" / f"rel-{kind}"
    publish(arts[kind], rel, source=src, imatrix=imx)
    texts = _shipped_text(rel)
    assert {"README.md", "manifest.json", "report/verify.json", "report/report.md"} <= set(texts)
    for name, text in texts.items():
        assert str(root) not in text, f"{name} names a path of this machine"
        assert os.path.expanduser("~") + "/" not in text or os.path.expanduser("~") == "/", name
    card = texts["README.md"]
    # the title is the model's name, not the release folder's
    title = next(ln for ln in card.splitlines() if ln.startswith("# "))
    assert title == f"# ds4-tiny-{'rocmfp3' if kind == 'uniform' else kind}" and f"rel-{kind}" not in title
    # the provenance is still there, as names with their hashes
    assert "`ds4-tiny`" in card and "`imatrix.gguf` sha256" in card
    assert f"ds4quant convert ds4-tiny {kind} --recipe" in card
    # the snippet, exactly as printed, from the folder that holds the release
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    monkeypatch.chdir(rel.parent)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, f"{kind} card snippet", "exec"), {})
    name, qtype, shape = buf.getvalue().split(" ", 2)
    assert name.startswith("blk.") and "exps" in name and shape.strip().startswith("(")
    if kind == "adaptive":
        assert "_mix" in card  # a MIX qtype is in this release: the snippet decoded with codebooks


def test_portable_paths():
    assert portable_path("/home/me/models/ds4") == "ds4"
    assert portable_path("/home/me/models/ds4/") == "ds4"
    assert portable_path("samples/ds4-tiny") == "samples/ds4-tiny"
    assert portable_path("../up/imatrix.gguf") == "imatrix.gguf" and portable_path("~/x.dat") == "x.dat"
    assert portable_path("/a/art/sub/f.bin", "/a/art") == "sub/f.bin" and portable_path(None) is None
    assert portable_command(["ds4quant", "convert", "/h/ckpt", "out", "--imatrix=/h/i.gguf",
                             "--tensor-type", r"blk\.0\..*=rocmfp4"]) == (
        "ds4quant", "convert", "ckpt", "out", "--imatrix=i.gguf", "--tensor-type", r"blk\.0\..*=rocmfp4")
    old = {"command": ["ds4quant", "convert", "/h/src", "/h/out"], "source": {"path": "/h/src", "format": "x"},
           "recipe": {"imatrix": {"path": "/h/c/imatrix.gguf", "sha256": "0" * 64},
                      "allocation": {"options": {"routing": "/h/r.json", "sensitivity": None}}}}
    new = portable_manifest_json(old)
    assert new["command"] == ["ds4quant", "convert", "src", "out"] and new["source"]["path"] == "src"
    assert new["recipe"]["imatrix"]["path"] == "imatrix.gguf"
    assert new["recipe"]["allocation"]["options"] == {"routing": "r.json", "sensitivity": None}
    assert old["source"]["path"] == "/h/src"  # the caller's object is left alone
