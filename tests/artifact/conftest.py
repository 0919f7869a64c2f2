"""Every artifact kind the project writes, built once per test session from the shipped tiny checkpoint.

``kinds`` builds lazily, so a test module pays only for the kinds it asks for:
``kinds("strix")`` converts the sample with the uniform rocmfp2-strix recipe.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "ds4-tiny"
IMATRIX = ROOT / "samples" / "ds4-tiny-calib" / "imatrix.gguf"
ROUTING = ROOT / "samples" / "ds4-tiny-calib" / "routing.csv"

UNIFORM = ("mxfp4", "rocmfp2-strix", "rocmfp3", "rocmfp4", "rocmfp4-fast", "rocmfp8")
# adaptive kinds: (granularity, candidates or None for the default MIX-heavy set, target bpw)
ADAPTIVE = {
    "adaptive-expert-mix": ("expert", None, 2.7),
    # the reproduction: expert granularity, no MIX candidate
    "adaptive-expert-plain": ("expert", ("rocmfp2", "rocmfp3", "rocmfp4"), 3.0),
}
KINDS = ("strix", "split", "adaptive-tensor", "handmade") + UNIFORM + tuple(ADAPTIVE)


def _build(kind: str, root: Path, cache: Path) -> Path:
    from ds4quant.plan import AdaptiveOptions
    from ds4quant.convert import convert
    from tests._verify_util import mix_artifact

    out = root / kind
    light = dict(routing=str(ROUTING), cache_dir=str(cache), fit_iterations=2, fit_restarts=0, fit_max_rows=64)
    if kind == "strix":
        return _build("rocmfp2-strix", root, cache)
    if kind in UNIFORM:
        if not out.exists():
            convert(SAMPLE, out, kind, threads=1)
        return out
    if kind == "split":  # several GGUF files; the stacks spread over them
        convert(SAMPLE, out, "rocmfp2-strix", threads=1, split_max_size="1M")
    elif kind == "adaptive-tensor":  # MIX tensors at tensor granularity, Lucebox books also as loose files
        convert(SAMPLE, out, "adaptive", imatrix=IMATRIX, loose_sidecars=True,
                adaptive=AdaptiveOptions(target_bpw=2.83, **light))
    elif kind == "handmade":  # compact MIX + plain stacks, a mode-0 expert, embedded and loose blobs
        mix_artifact(_build("strix", root, cache), out, loose_gumix=True)
    else:
        gran, cands, bpw = ADAPTIVE[kind]
        extra = {} if cands is None else {"candidates": cands}
        convert(SAMPLE, out, "adaptive", imatrix=IMATRIX,
                adaptive=AdaptiveOptions(target_bpw=bpw, granularity=gran, **extra, **light))
    return out


@pytest.fixture(scope="session")
def kinds(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    cache = tmp_path_factory.mktemp("kinds-cache")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = _build(kind, root, cache)
        return built[kind]

    return get
