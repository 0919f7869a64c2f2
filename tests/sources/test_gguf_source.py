"""GGUF input sources: a DeepSeek-V4 GGUF converts like the official checkpoint it came from.

Sources are built from the shipped sample: the MXFP4 GGUF is `ds4quant
convert samples/ds4-tiny --recipe mxfp4` (experts MXFP4, dense BF16/F32,
tid2eid I32); the BF16 and Q8_0 GGUFs copy its dense tensors and re-encode the
experts from the official source's exact values (FP4 values are bf16-exact).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ds4quant import formats
from ds4quant.artifact import KEY_FORMAT_VERSION, KEY_VARIANTS, TAG_PREFIX, GGUFWriter, read_gguf_set
from ds4quant.cli import cli
from ds4quant.convert import convert
from ds4quant.errors import BadInputError, CorruptDataError, ShapeError, UnsupportedFormatError
from ds4quant.sources import (
    GgufSource,
    Source,
    deepseek4_kvs,
    open_any_source,
    open_gguf_source,
    open_official_source,
    open_source,
)
from ds4quant.sources import gguf_source as gs
from ds4quant.sources.config import CSA, HCA, SLIDING
from ds4quant.sources.naming import Kind, official_name
from tests.sources._util import SAMPLE

_WRITER_OWNED = ("general.alignment", "split.no", "split.count", "split.tensors.count", KEY_FORMAT_VERSION,
                 KEY_VARIANTS)


def rewrite(src: Path, dst: Path, *, drop=(), kv=None, tensors=None, split_max_bytes=None) -> Path:
    """Copy a GGUF (set) to ``dst``: KVs minus ``drop`` plus ``kv`` (key ->
    (value, type, sub_type)); ``tensors`` maps a name to (qtype, shape, bytes)
    replacing it (None drops it). Everything else is copied byte for byte."""
    g = read_gguf_set(src)
    w = GGUFWriter(dst, split_max_bytes=split_max_bytes)
    for k, v in g.kv.items():
        if k in drop or k in _WRITER_OWNED or k.startswith(TAG_PREFIX) or k in (kv or {}):
            continue
        w.add_kv(k, v.value, v.type, v.sub_type)
    for k, (value, vtype, sub) in (kv or {}).items():
        w.add_kv(k, value, vtype, sub)
    for name, info in g.tensors.items():
        if tensors is not None and name in tensors:
            if tensors[name] is not None:
                w.add_tensor(name, *tensors[name])
            continue
        w.add_tensor(name, info.qtype, info.shape, bytes(g.tensor_data(name)))
    return w.write()[0]


def _stacks(src: Source, qtype: str) -> dict:
    """Every expert stack of the official sample, re-encoded as ``qtype``."""
    out = {}
    for gguf, members in src.names.by_gguf().items():
        if members[0].stacked:
            x = np.concatenate([src.read_dequantized(m.name) for m in members])
            out_rows, cols = src.info(members[0].name).shape_logical
            out[gguf] = (qtype, (cols, out_rows, len(members)), formats.encode(qtype, x).tobytes())
    return out


def _convert(source, out: Path, recipe: str, *extra: str) -> Path:
    convert(source, out, recipe, threads=1, tensor_types=extra)
    return next(p for p in sorted(out.iterdir()) if p.suffix == ".gguf")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_src")
    mx = _convert(SAMPLE, root / "official-mx", "mxfp4")
    with open_source(SAMPLE) as src:
        bf16 = rewrite(mx, root / "tiny-bf16.gguf", tensors=_stacks(src, "bf16"))
        q8 = _stacks(src, "q8_0")
        # one dense tensor as F16 too, so that type is read somewhere
        router = src.read_dequantized("layers.2.ffn.gate.weight")
        q8["blk.2.ffn_gate_inp.weight"] = ("f16", router.shape[::-1], formats.encode("f16", router).tobytes())
        q8 = rewrite(mx, root / "tiny-q8.gguf", tensors=q8)
    return {"root": root, "mx": mx, "bf16": bf16, "q8": q8}


@pytest.fixture(scope="module")
def official_strix(built):
    return _convert(SAMPLE, built["root"] / "official-strix", "rocmfp2-strix")


@pytest.fixture(scope="module")
def from_gguf_mx(built):
    return _convert(built["mx"], built["root"] / "from-gguf-mx", "mxfp4")


def _payloads(path: Path) -> dict:
    g = read_gguf_set(path)
    return {n: (t.qtype, t.shape, bytes(g.tensor_data(n))) for n, t in g.tensors.items()}


# ---------------------------------------------------------------------------
# reading


def test_config_round_trips_through_the_deepseek4_keys(built):
    with open_source(SAMPLE) as off, open_gguf_source(built["mx"]) as g:
        def norm(kvs):  # the GGUF holds float32
            return [(k.key, np.float32(k.value) if isinstance(k.value, float) else k.value) for k in kvs]

        assert norm(deepseek4_kvs(g.config)) == norm(deepseek4_kvs(off.config))
        assert g.config.layer_types == (SLIDING, CSA, HCA, CSA)
        assert g.config.compress_ratios == (0, 4, 16, 4)
        assert g.config.num_hash_layers == 2


def test_config_from_kvs_inverts_deepseek4_kvs_field_by_field():
    # distinct values per field, so two swapped keys cannot pass
    from dataclasses import replace
    from types import SimpleNamespace

    from ds4quant.artifact import make_kv
    from ds4quant.sources.config import RopeScaling

    with open_source(SAMPLE) as off:
        base = off.config
    ints = ("vocab_size", "hidden_size", "moe_intermediate_size", "n_routed_experts", "num_attention_heads",
            "num_key_value_heads", "head_dim", "q_lora_rank", "o_lora_rank", "n_shared_experts", "sliding_window",
            "hc_mult", "hc_sinkhorn_iters", "index_n_heads", "index_head_dim", "index_topk")
    want = replace(base, **{f: 1000 + i for i, f in enumerate(ints)}, num_experts_per_tok=5, qk_rope_head_dim=24,
                   o_groups=8, max_position_embeddings=100001, routed_scaling_factor=2.5, swiglu_limit=7.0,
                   hc_eps=2.0 ** -17, rms_norm_eps=2.0 ** -13, rope_theta=12345.0, compress_rope_theta=54321.0,
                   rope_scaling=RopeScaling(4.0, 8192, 16.0, 2.0), compress_ratios=(0, 8, 32, 8),
                   expert_dtype=None, fp8_block=None)
    kvs = {k.key: make_kv(k.value, k.type, k.sub_type) for k in deepseek4_kvs(want)}
    indexed = ["blk.1.indexer.proj.weight", "blk.3.indexer_compressor_kv.weight"]  # CSA layers
    got = gs.config_from_kvs(SimpleNamespace(kv=kvs), indexed, "x.gguf")
    assert got == want
    assert got.layer_types == (SLIDING, CSA, HCA, CSA)
    assert deepseek4_kvs(got) == deepseek4_kvs(want)


def test_names_kinds_and_expert_members(built):
    with open_source(SAMPLE) as off, open_gguf_source(built["mx"]) as g:
        ob, gb = off.names.by_gguf(), g.names.by_gguf()
        assert set(gb) == set(ob)
        for name, members in gb.items():
            assert [m.kind for m in members] == [m.kind for m in ob[name]]
            assert [(m.layer, m.expert, m.which) for m in members] == [(m.layer, m.expert, m.which) for m in ob[name]]
        ms = gb["blk.2.ffn_up_exps.weight"]
        assert [m.name for m in ms][:2] == ["blk.2.ffn_up_exps.weight#0", "blk.2.ffn_up_exps.weight#1"]
        assert all(m.stacked and m.kind is Kind.ROUTED_EXPERT and m.which == "up" for m in ms)
        assert gb["blk.0.attn_q_a.weight"][0].name == "blk.0.attn_q_a.weight"
        i = g.info("blk.2.ffn_down_exps.weight#3")
        assert (i.dtype, i.shape_logical, i.nbytes) == ("MXFP4", (256, 128), 256 * 128 // 32 * 17)
        assert g.info("blk.0.ffn_gate_tid2eid.weight").dtype == "I32"
        assert g.skipped == ()


def test_official_name_is_the_inverse_of_map_name():
    with open_source(SAMPLE) as off:
        for m in off.names.mapped:
            if m.role == "weight":
                assert official_name(m.gguf, m.expert) == m.name
    assert official_name("blk.0.ffn_up_exps.weight") is None  # a stack needs an expert id
    assert official_name("blk.0.attn_q_a.weight", 3) is None
    assert official_name("blk.00.attn_q_a.weight") is None
    assert official_name("rope_freqs.weight") is None


@pytest.mark.parametrize("kind", ["mx", "bf16", "q8"])
def test_expert_members_decode_only_their_own_bytes_exactly(built, kind, monkeypatch):
    seen = []
    real = gs.decode
    monkeypatch.setattr(gs, "decode", lambda q, data, cols: seen.append(np.asarray(data).nbytes) or real(q, data, cols))
    with open_source(SAMPLE) as off, open_gguf_source(built[kind]) as g:
        for layer, which, w, e in ((0, "gate", "w1", 0), (2, "down", "w2", 7), (3, "up", "w3", 15)):
            name = f"blk.{layer}.ffn_{which}_exps.weight#{e}"
            want = off.read_dequantized(f"layers.{layer}.ffn.experts.{e}.{w}.weight")
            if kind == "q8":
                want = formats.decode("q8_0", formats.encode("q8_0", want), want.shape[1])
            got = g.read_dequantized(name)
            assert got.flags.writeable and got.dtype == np.float32
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
            assert seen[-1] == g.info(name).nbytes  # one expert, not the stack
            g.release(name)
        # dense tensors: exact too (FP8 -> bf16 is exact; norms are f32)
        for gguf, official in (("blk.1.attn_q_b.weight", "layers.1.attn.wq_b.weight"),
                               ("output_norm.weight", "norm.weight")):
            assert np.array_equal(g.read_dequantized(gguf), off.read_dequantized(official))
        assert np.array_equal(g.read("blk.0.ffn_gate_tid2eid.weight"), off.read("layers.0.ffn.gate.tid2eid"))
        with pytest.raises(BadInputError, match="integers"):
            g.read_dequantized("blk.0.ffn_gate_tid2eid.weight")


def test_expert_fp4_is_lossless_for_mxfp4_and_refused_otherwise(built):
    with open_source(SAMPLE) as off, open_gguf_source(built["mx"]) as g:
        for which, w in (("gate", "w1"), ("down", "w2"), ("up", "w3")):
            c1, s1 = g.expert_fp4(1, 9, which)
            c2, s2 = off.expert_fp4(1, 9, w)
            assert c1.dtype == np.int8 and np.array_equal(c1, c2.view(np.int8)) and np.array_equal(s1, s2)
    with open_gguf_source(built["bf16"]) as g:
        with pytest.raises(UnsupportedFormatError, match="BF16, not MXFP4"):
            g.expert_fp4(1, 9, "gate")


def test_fingerprint_is_cheap_distinct_and_follows_the_header(built, tmp_path):
    with open_gguf_source(built["mx"]) as a, open_gguf_source(built["mx"]) as b, open_source(SAMPLE) as off:
        assert a.fingerprint() == b.fingerprint()
        assert a.fingerprint().startswith("gguf:") and not off.fingerprint().startswith("gguf:")
    from gguf import GGUFValueType as VT

    other = rewrite(built["mx"], tmp_path / "renamed.gguf", kv={"general.name": ("other", VT.STRING, None)})
    with open_gguf_source(other) as c, open_gguf_source(built["mx"]) as a:
        assert c.fingerprint() != a.fingerprint()


def test_open_any_source_dispatches(built, tmp_path):
    with open_any_source(SAMPLE) as s:
        assert isinstance(s, Source)
    with open_any_source(built["mx"]) as s:
        assert isinstance(s, GgufSource)
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    for p, msg in ((tmp_path / "empty", "no config.json"), (tmp_path / "notes.txt", "neither"),
                   (tmp_path / "missing.gguf", "no such file")):
        with pytest.raises(BadInputError, match=msg):
            open_any_source(p)
    with pytest.raises(BadInputError, match="is a GGUF; calibrate needs the official checkpoint folder"):
        open_official_source(built["mx"], "calibrate")


# ---------------------------------------------------------------------------
# converting


def test_mxfp4_gguf_round_trips_bit_exactly(built, from_gguf_mx):
    out = from_gguf_mx
    assert out.name == "ds4-tiny-mxfp4-mxfp4.gguf"  # the source's stem + the recipe
    # every tensor, experts included, is byte-identical to converting the official sample
    assert _payloads(out) == _payloads(built["mx"])
    man = json.loads((out.parent / "manifest.json").read_text())
    assert man["source"]["format"] == "deepseek-v4-gguf"
    assert man["source"]["fingerprint"].startswith("gguf:")


def test_bf16_gguf_converts_like_the_official_sample(built, official_strix):
    want = _payloads(official_strix)
    got = _payloads(_convert(built["bf16"], built["root"] / "from-gguf-strix", "rocmfp2-strix"))
    stacks = [n for n in want if n.endswith("_exps.weight")]
    assert len(stacks) == 12 and {want[n][0] for n in stacks} == {"rocmfp2", "rocmfp3"}
    assert got == want


def test_keeping_a_block_quantized_source_copies_its_bytes(built, monkeypatch):
    # q8_0 is not idempotent under decode + encode in general: the copy must not re-encode
    import importlib

    conv = importlib.import_module("ds4quant.convert.encode")

    calls = []
    real = conv.encode
    monkeypatch.setattr(conv, "encode", lambda q, *a, **k: calls.append(q) or real(q, *a, **k))
    src = _payloads(built["q8"])
    got = _payloads(_convert(built["q8"], built["root"] / "q8-keep", "rocmfp3", r"_exps\.=source"))
    for n in src:
        if n.endswith("_exps.weight") or n == "blk.2.ffn_gate_inp.weight":
            assert got[n] == src[n], n
    assert "q8_0" not in calls and "f16" not in calls
    assert got["blk.2.ffn_gate_inp.weight"][0] == "f16"  # kept (plan: keep-source F16 -> f16)
    # ... and MXFP4 kept at source precision is a copy as well
    got = _payloads(_convert(built["mx"], built["root"] / "mx-keep", "rocmfp3", r"_exps\.=source"))
    assert all(got[n] == v for n, v in _payloads(built["mx"]).items() if n.endswith("_exps.weight"))


def test_split_gguf_source_converts_the_same(built):
    (built["root"] / "split").mkdir()
    split = rewrite(built["mx"], built["root"] / "split" / "tiny.gguf", split_max_bytes=2 << 20)
    files = sorted(split.parent.glob("*.gguf"))
    assert len(files) > 1
    with open_any_source(files[-1]) as s:  # any file of the set opens it
        assert s.name == "tiny" and s.path == files[0]
    out = _convert(files[1], built["root"] / "from-split", "mxfp4")
    assert out.name == "tiny-mxfp4.gguf"
    assert _payloads(out) == _payloads(built["mx"])


def test_verify_compares_an_artifact_with_its_gguf_source(built, from_gguf_mx):
    from ds4quant.verify import verify

    rep = verify(from_gguf_mx.parent, source=built["mx"])
    assert rep.ok, rep.failed
    assert any(c.name == "source" and "matches" in c.detail for c in rep.checks)


# ---------------------------------------------------------------------------
# refusals: one line, exit 2, no output folder


def _refused(source: Path, tmp_path: Path, *match: str, recipe: str = "mxfp4") -> str:
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["convert", str(source), str(out), "--recipe", recipe])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("ds4quant: error: "), res.output
    for m in match:
        assert m in lines[0], lines[0]
    assert not out.exists()
    return lines[0]


def test_refuses_a_missing_deepseek4_key(built, tmp_path):
    bad = rewrite(built["mx"], tmp_path / "nokey.gguf", drop=("deepseek4.expert_count",))
    _refused(bad, tmp_path, "nokey.gguf", "deepseek4.expert_count")
    with pytest.raises(BadInputError, match="deepseek4.attention.compress_ratios"):
        open_gguf_source(rewrite(built["mx"], tmp_path / "noratios.gguf",
                                 drop=("deepseek4.attention.compress_ratios",)))


def test_refuses_shapes_that_disagree_with_the_keys(built, tmp_path):
    from gguf import GGUFValueType as VT

    bad = rewrite(built["mx"], tmp_path / "ffn.gguf",
                  kv={"deepseek4.expert_feed_forward_length": (64, VT.UINT32, None)})
    line = _refused(bad, tmp_path, "ffn.gguf", "blk.0.ffn_down_exps.weight", "deepseek4.expert_feed_forward_length",
                    "more problem(s)")
    assert "[64, 256, 16]" in line
    g = read_gguf_set(built["mx"])
    norm = np.asarray(g.tensor_data("blk.1.attn_kv_a_norm.weight")).view("<f4")[:32]
    bad = rewrite(built["mx"], tmp_path / "norm.gguf",
                  tensors={"blk.1.attn_kv_a_norm.weight": ("f32", (32,), norm.tobytes())})
    _refused(bad, tmp_path, "blk.1.attn_kv_a_norm.weight", "deepseek4.attention.key_length", "[64]")
    bad = rewrite(built["mx"], tmp_path / "nostack.gguf", tensors={"blk.3.ffn_up_exps.weight": None})
    with pytest.raises(ShapeError, match="blk.3.ffn_up_exps.weight.*missing"):
        open_gguf_source(bad)
    bad = rewrite(built["mx"], tmp_path / "hash.gguf",
                  kv={"deepseek4.hash_layer_count": (1, VT.UINT32, None)})
    with pytest.raises(ShapeError, match="blk.1.ffn_gate_tid2eid.weight.*hash table in layer 1"):
        open_gguf_source(bad)


def test_refuses_a_rocmfpx_artifact_as_source(official_strix, tmp_path):
    _refused(official_strix, tmp_path, "ROCmFPX type 104", "already-quantized", "original checkpoint", recipe="rocmfp3")


def test_refuses_unsupported_tensor_types(built, tmp_path):
    g = read_gguf_set(built["mx"])
    x = np.asarray(g.tensor_data("blk.0.attn_q_a.weight")).view("<u2").astype(np.uint32) << 16
    q4 = formats.encode("q4_0", x.view(np.float32).reshape(128, 256)) if "q4_0" in formats.QTYPES else None
    if q4 is None:  # no codec for it here: a plausible block of zeros is enough for the reader
        q4 = np.zeros(128 * 256 // 32 * 18, np.uint8)
    bad = rewrite(built["mx"], tmp_path / "q4.gguf", tensors={"blk.0.attn_q_a.weight": ("q4_0", (256, 128),
                                                                                           q4.tobytes())})
    _refused(bad, tmp_path, "blk.0.attn_q_a.weight", "Q4_0", "not a supported source type")
    tid = np.asarray(g.tensor_data("blk.0.ffn_gate_tid2eid.weight")).view("<i4").astype(np.float32)
    bad = rewrite(built["mx"], tmp_path / "tidf.gguf", tensors={"blk.0.ffn_gate_tid2eid.weight": ("f32", (4, 512),
                                                                                                  tid.tobytes())})
    with pytest.raises(UnsupportedFormatError, match="must be I32"):
        open_gguf_source(bad)
    # the mxfp4 recipe needs FP4 experts: BF16 stacks are refused at planning, before any output
    _refused(built["bf16"], tmp_path, "mxfp4 recipe repacks FP4 experts", "BF16")


def test_refuses_a_truncated_gguf(built, tmp_path):
    bad = tmp_path / "cut.gguf"
    data = built["mx"].read_bytes()
    bad.write_bytes(data[: len(data) - 4096])
    _refused(bad, tmp_path, "cut.gguf", "runs past the end")
    with pytest.raises(CorruptDataError):
        open_any_source(bad)


def test_refuses_a_foreign_architecture(built, tmp_path):
    from gguf import GGUFValueType as VT

    bad = rewrite(built["mx"], tmp_path / "llama.gguf", kv={"general.architecture": ("llama", VT.STRING, None)})
    _refused(bad, tmp_path, "llama.gguf", "general.architecture", "'llama'")


def test_calibrate_refuses_a_gguf_source(built, tmp_path):
    from ds4quant.calibrate import calibrate

    with pytest.raises(BadInputError, match="is a GGUF; calibrate"):
        calibrate(built["mx"], [[1, 2, 3]], tmp_path / "cal")
    assert not (tmp_path / "cal").exists()


def test_both_sources_implement_the_source_protocol(built):
    import inspect

    from ds4quant.sources import Source

    members = [n for n in dir(Source) if not n.startswith("_")]
    for path in (SAMPLE, built["bf16"]):
        with open_any_source(path) as s:
            assert isinstance(s, Source)
            for n in members:
                want = getattr(Source, n)
                got = getattr(type(s), n, None)
                assert got is not None, (type(s).__name__, n)
                if inspect.isfunction(want):  # same parameters as the protocol states
                    assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), n
            m = s.names.mapped[0]
            assert s.payload_qtype(m.name) in (None, *gs.SOURCE_TYPES)
            assert s.name and s.format in ("deepseek-v4-official", "deepseek-v4-gguf")
