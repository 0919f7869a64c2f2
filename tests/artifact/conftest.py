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
# Lucebox build variants: rocmfp2_affine (107 affine) gate/up; MIX gate/up whose books are embedded only
VARIANTS = ("affine", "mix-embedded")
# samples/ds4-tiny is not in llama.cpp's fixed shape (hc 2, HCA ratio 16, indexer dim 32): a tiny random
# DS4 that is (hc 4, HCA 128, indexer dim 64, a BPE tokenizer), converted with both dense types
LLAMA = ("llama-mxfp4", "llama-q8_0")
LLAMA_SHAPE = dict(layers=3, experts=8, hidden=256, moe_inter=128, vocab=264, topk=2, hash_layers=1, hc_mult=4,
                   index_head_dim=64, compress_rate_hca=128)
KINDS = ("strix", "split", "adaptive-tensor", "handmade") + UNIFORM + tuple(ADAPTIVE) + VARIANTS + LLAMA


def llama_shape_source(out: Path) -> Path:
    """A random-weight DS4 checkpoint in llama.cpp's shape (samples/make_synthetic.py) with
    samples/ds4-copy's tokenizer (its 264 ids)."""
    import shutil
    import sys

    if not out.exists():
        sys.path.insert(0, str(ROOT / "samples"))
        import make_synthetic as ms

        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        ms.make_synthetic(tmp, ms.preset("tiny", **LLAMA_SHAPE), workers=1)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ROOT / "samples" / "ds4-copy" / f, tmp / f)
        tmp.rename(out)
    return out


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
    if kind in LLAMA:
        if not out.exists():
            convert(llama_shape_source(root / "llama-src"), out, "mxfp4", threads=1,
                    dense_qtype="q8_0" if kind == "llama-q8_0" else None)
        return out
    if kind == "affine":
        convert(SAMPLE, out, "rocmfp3", threads=1, tensor_types=["ffn_(gate|up)_exps=rocmfp2_affine"])
    elif kind == "mix-embedded":
        convert(SAMPLE, out, "rocmfp2-strix", threads=1, tensor_types=["ffn_(gate|up)_exps=rocmfp2_mix"],
                loose_sidecars=False)
    elif kind == "split":  # several GGUF files; the stacks spread over them
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
