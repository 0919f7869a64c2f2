"""verify blesses only what is finished and consistent.

Before the fix: a folder without SHA256SUMS, with a leftover work folder or
with files the manifest does not list verified "sound"; only expert stacks
were checked against the deepseek4 keys; ``--source`` compared element counts,
so a transposed dense tensor passed; hash messages printed two identical
16-digit prefixes; the sample's native compress_ratios went unnoticed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from ds4quant.artifact import read_gguf_set
from ds4quant.artifact.ds4 import shape_problems
from ds4quant.artifact.runtimes import needs
from ds4quant.verify import verify
from ds4quant.verify._run import show_digests
from tests._verify_util import SAMPLE, gguf_of, rewrite, strix_artifact, write_artifact_sums


@pytest.fixture(scope="module")
def strix(tmp_path_factory):
    return strix_artifact(tmp_path_factory.mktemp("vh") / "strix")


def _copy(strix: Path, tmp_path: Path) -> Path:
    out = tmp_path / "a"
    shutil.copytree(strix, out)
    return out


def _fails(rep, name):
    return [c for c in rep.failed if c.name == name]


def test_a_convert_output_is_complete(strix):
    rep = verify(strix)
    assert rep.ok, [c.one_line() for c in rep.failed]
    assert any(c.name == "complete" and c.ok for c in rep.checks)


def test_unfinished_folders_fail_naming_the_file(strix, tmp_path):
    a = _copy(strix, tmp_path)
    (a / "SHA256SUMS").unlink()
    (bad,) = _fails(verify(a), "complete")
    assert bad.file == "SHA256SUMS" and "unfinished" in bad.detail

    b = _copy(strix, tmp_path / "b")
    (b / ".ds4quant-work" / "pieces").mkdir(parents=True)
    (b / ".ds4quant-work" / "journal.json").write_text("{}")
    assert [c.file for c in _fails(verify(b), "complete")] == [".ds4quant-work"]

    c = _copy(strix, tmp_path / "c")
    tmp = f".{gguf_of(c).name}.x7Qk2a.tmp"
    (c / tmp).write_bytes(b"partial")
    (c / "stray.bin").write_bytes(b"x")
    # even listed in SHA256SUMS (as the old convert did), an unlisted artifact file is not blessed
    from ds4quant.artifact.sums import write_sums

    write_sums(c)
    files = sorted(x.file for x in _fails(verify(c), "complete"))
    assert files == sorted([tmp, "stray.bin"])


def test_every_tensor_shape_is_checked_against_the_deepseek4_keys_listing_every_offender(strix, tmp_path):
    g = read_gguf_set(gguf_of(strix))
    emb = bytes(g.tensor_data("token_embd.weight"))
    qa = bytes(g.tensor_data("blk.0.attn_q_a.weight"))
    ape = bytes(g.tensor_data("blk.2.attn_compressor_ape.weight"))
    shapes = {"token_embd.weight": (256, 500), "blk.0.attn_q_a.weight": (256, 96),
              "blk.2.attn_compressor_ape.weight": (64, 8)}
    payloads = {"token_embd.weight": emb[:256 * 500 * 2], "blk.0.attn_q_a.weight": qa[:256 * 96 * 2],
                "blk.2.attn_compressor_ape.weight": ape[:64 * 8 * 4]}
    art = rewrite(strix, tmp_path / "s", shapes=shapes, payloads=payloads)
    rep = verify(art)
    bad = {c.tensor: c.detail for c in _fails(rep, "shapes")}
    assert set(bad) == set(shapes), bad
    assert "ne[1] = 500, but deepseek4.vocab_size = 512 gives 512" in bad["token_embd.weight"]
    assert "ne[1] = 96, but deepseek4.attention.q_lora_rank = 128 gives 128" in bad["blk.0.attn_q_a.weight"]
    assert "ne[1] = 8, but deepseek4.attention.compress_ratios[2] = 16 gives 16" in bad[
        "blk.2.attn_compressor_ape.weight"]
    # the rest of the artifact is consistent: only the shapes check fails
    assert {c.name for c in rep.failed} == {"shapes"}


def test_compress_ratios_are_checked_against_the_compressor_rows(strix, tmp_path):
    g = read_gguf_set(gguf_of(strix))
    ratios = [int(x) for x in g.kv["deepseek4.attention.compress_ratios"].value]
    assert ratios == [0, 4, 16, 4]
    art = rewrite(strix, tmp_path / "r", kv={"deepseek4.attention.compress_ratios": ([0, 4, 128, 0], VT.ARRAY,
                                                                                    VT.UINT32)})
    bad = _fails(verify(art), "shapes")
    by = {c.tensor: c.detail for c in bad}
    assert "ne[1] = 16, but deepseek4.attention.compress_ratios[2] = 128 gives 128" in by[
        "blk.2.attn_compressor_ape.weight"]
    # ratio 0 on layer 3: its compressor and indexer tensors have no place
    assert {t for t in by if t.startswith("blk.3.")} == {n for n in g.tensors if n.startswith("blk.3.") and
                                                         ("compressor" in n or "indexer" in n)}


def test_the_shape_rule_accepts_the_converted_sample_and_names_unknown_keys_nothing():
    from ds4quant.artifact.gguf_values import make_kv

    g = read_gguf_set(next(SAMPLE.parent.glob("ds4-tiny-calib/*.gguf")))  # an imatrix GGUF: no DS4 keys
    assert shape_problems(g.kv, {"token_embd.weight": (1, 2)}) == []
    kv = {"deepseek4.embedding_length": make_kv(8, VT.UINT32)}
    (p,) = shape_problems(kv, {"output_norm.weight": (9,), "token_embd.weight": (8, 3)})
    assert p == ("output_norm.weight", "GGUF shape [9]: ne[0] = 9, but deepseek4.embedding_length = 8 gives 8")


def test_with_source_a_transposed_dense_tensor_fails_naming_the_dims(strix, tmp_path):
    name = "blk.0.attn_q_a.weight"  # [256, 128] bf16: non-square
    g = read_gguf_set(gguf_of(strix))
    x = np.frombuffer(bytes(g.tensor_data(name)), "<u2").reshape(128, 256)
    art = rewrite(strix, tmp_path / "t", shapes={name: (128, 256)}, payloads={name: x.T.copy().tobytes()})
    rep = verify(art, source=SAMPLE)
    (c,) = [c for c in _fails(rep, "numbers.coverage") if c.tensor == name]
    assert "transposed" in c.detail and "ne[0] is 128 in the GGUF but 256 in the source" in c.detail
    assert "ne[1] is 256 in the GGUF but 128 in the source" in c.detail


def test_hash_mismatch_messages_show_where_the_digests_differ(strix, tmp_path):
    a = "0123456789abcdef0123456789" + "0" * 38
    b = "0123456789abcdef0123456789" + "1" * 38
    sa, sb = show_digests(a, b)
    assert sa != sb and sa.startswith(a[:27]) and sb.startswith(b[:27])
    assert show_digests(a[:20] + "f" * 44, a[:20] + "e" * 44) == (a[:20] + "f" * 8 + "...", a[:20] + "e" * 8 + "...")

    name = "blk.0.attn_norm.weight"

    def edit(obj):
        t = next(t for t in obj["tensors"] if t["name"] == name)
        t["sha256"] = t["sha256"][:40] + ("0" if t["sha256"][40] != "0" else "1") + t["sha256"][41:]

    art = rewrite(strix, tmp_path / "h", manifest_edit=edit)
    write_artifact_sums(art)
    (c,) = [c for c in _fails(verify(art), "manifest.tensors") if c.tensor == name]
    have, want = c.detail.split("payload sha256 ")[1].split(" differs from manifest.json's ")
    assert have != want and len(have.rstrip(".")) >= 41


def test_the_shipped_sample_config_reads_two_ways_and_verify_says_so(strix, tmp_path):
    """samples/ds4-tiny lists compress_ratios [0, 4, 128, 4] with compress_rate_hca 16 and a
    16-row compressor ape: DeepSeek's code reads ratio 128 there. Fails only source_config."""
    rep = verify(strix, source=SAMPLE)
    bad = _fails(rep, "source_config")
    cfg = json.loads((SAMPLE / "config.json").read_text())
    if cfg.get("compress_ratios") == [0, 4, 128, 4] and cfg.get("compress_rate_hca") == 16:
        (c,) = bad
        assert "compress_ratios[2] = 128, but compress_rate_hca = 16" in c.detail and "16 rows" in c.detail
        assert c.file.endswith("config.json")
    else:  # the regenerated sample
        assert bad == []
    assert {c.name for c in rep.failed} <= {"source_config"}
    # a consistent config (the transformers keys only) passes the rule
    fixed = tmp_path / "fixed"
    shutil.copytree(SAMPLE, fixed)
    cfg.pop("compress_ratios", None)
    cfg["layer_types"] = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                          "compressed_sparse_attention"]
    (fixed / "config.json").write_text(json.dumps(cfg))
    from ds4quant.sources.config import compress_ratio_problems
    from ds4quant.sources.official import open_source

    with open_source(fixed) as s:
        assert compress_ratio_problems(s.config, {2: 16}) == []


def test_runtimes_say_which_lucebox_build_an_artifact_needs():
    from ds4quant.artifact import make_kv
    from ds4quant.artifact.runtimes import LuceboxBooks, decide
    from ds4quant.sources import deepseek4_kvs
    from ds4quant.sources.official import open_source

    with open_source(SAMPLE) as s:
        kv = {k.key: make_kv(k.value, k.type, k.sub_type) for k in deepseek4_kvs(s.config)}

    def rts(*qs, books=LuceboxBooks(), compact=False, header=kv):
        return decide(header, {f"t{i}": (q, (128,), compact) for i, q in enumerate(qs)}, books)

    assert rts("rocmfp2", "rocmfp3").runtimes == ("ds4quant", "lucebox")
    # no type 107: builds with and without ROCMFP2_AFFINE both load it
    assert rts("rocmfp3", "f32").runtimes == ("ds4quant", "lucebox", "lucebox-affine")
    assert rts("rocmfp2_affine", "f32").runtimes == ("ds4quant", "lucebox-affine")
    both = rts("rocmfp2_affine", "rocmfp2")
    assert both.runtimes == ("ds4quant",) and "107" in " ".join(both.excluded["lucebox"])
    full = LuceboxBooks(any=True, loose=True)
    embedded = LuceboxBooks(any=True, loose=False)
    assert rts("rocmfp2_mix", "rocmfp2", books=full).runtimes == ("ds4quant", "lucebox-mix")
    assert rts("rocmfp2_mix", "rocmfp3", books=full).runtimes == ("ds4quant", "lucebox-mix", "lucebox-mix-affine")
    assert rts("rocmfp2_mix", "rocmfp2", books=embedded).runtimes == ("ds4quant", "lucebox-mix-embedded")
    assert rts("rocmfp2_affine", "rocmfp2_mix", books=full).runtimes == ("ds4quant", "lucebox-mix-affine")
    assert rts("rocmfp2_mix").runtimes == ("ds4quant",)
    # mxfp4 everywhere, but this header has no tokenizer (and the sample's shape): not llama.cpp
    mx = rts("mxfp4", "f32")
    assert mx.runtimes == ("ds4quant", "lucebox", "lucebox-affine", "gguf-py")
    assert any("tokenizer.ggml.model is missing" in w for w in mx.excluded["llama.cpp"])
    assert rts("rocmfp3", compact=True).runtimes == ("ds4quant",)
    assert rts("nope").runtimes == ()
    # a header without the keys Lucebox's loader requires: no Lucebox claim
    assert "lucebox" in rts("rocmfp3", header={}).excluded
    assert "MIX" in needs("lucebox-mix") and "AFFINE" in needs("lucebox-affine")
    assert "loose" in needs("lucebox-mix") and "embedded" in needs("lucebox-mix-embedded")
