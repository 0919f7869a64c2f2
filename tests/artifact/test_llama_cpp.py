"""llama.cpp's DeepSeek-V4 dialect: the written header against its requirements as data, the
fixed-shape rules, and artifacts written before the dialect still read and verify."""

from __future__ import annotations

import pytest
from gguf import GGUFValueType as VT

from ds4quant import names
from ds4quant.artifact import make_kv
from ds4quant.artifact.llama_cpp import KEY_RULES, KEYS, dim_problems, key_problems, llama_cpp_problems
from ds4quant.artifact.view import open_artifact
from ds4quant.verify import verify
from tests._verify_util import rewrite
from tests.artifact.conftest import ADAPTIVE, LLAMA, UNIFORM, VARIANTS

# every recipe and adaptive granularity (samples/ds4-tiny: bf16 dense), and the llama.cpp-shaped
# source with both dense types (bf16, q8_0)
HEADERS = UNIFORM + tuple(ADAPTIVE) + ("adaptive-tensor",) + VARIANTS + LLAMA


def _tensors(v):
    return {n: (t.qtype, t.shape) for n, t in v.tensors.items()}


@pytest.mark.parametrize("kind", HEADERS)
def test_written_header_meets_llama_cpp_key_requirements(kind, kinds):
    v = open_artifact(kinds(kind))
    problems = key_problems(v.kv)
    if kind in LLAMA:
        assert problems == [] and llama_cpp_problems(v.kv, _tensors(v)) == []
        assert "llama.cpp" in v.runtimes
        assert (kind == "llama-q8_0") == any(t.qtype == "q8_0" for t in v.tensors.values())
    else:
        # samples/ds4-tiny has no tokenizer.json: only the vocabulary keys are missing
        assert problems and all(p.startswith("tokenizer.ggml.") for p in problems), problems
    for r in KEYS:
        if r.key.startswith(names.ARCH + ".") and r.required:
            got = v.kv[r.key]
            assert any(got.type == t and (s is None or got.sub_type == s) for t, s in r.types), r.key
    # the types llama.cpp checks, as the issue found them refused
    assert v.kv[names.KEY_ROPE_SCALING_ORIG_CTX].type == VT.UINT32
    assert v.kv[names.KEY_EXPERT_WEIGHTS_NORM].type == VT.BOOL
    assert (v.kv[names.KEY_EXPERT_GATING_FUNC].type, int(v.kv[names.KEY_EXPERT_GATING_FUNC].value)) == (VT.UINT32, 4)
    assert v.kv[names.KEY_ROPE_SCALING_TYPE].value == "none"  # neither source has YaRN scaling
    ratios = v.kv[names.KEY_COMPRESS_RATIOS]
    assert ratios.sub_type == VT.INT32 and len(ratios.value) == int(v.kv[names.KEY_BLOCK_COUNT].value)
    # the ds4-tiny shape is outside llama.cpp's fixed set, and inspect/verify say why
    if kind not in LLAMA:
        why = " ".join(v.runtimes_excluded["llama.cpp"])
        assert "hyper_connection.count = 2" in why and "[16]" in why and "key_length = 32" in why


def test_merges_are_written_even_when_empty(kinds):
    v = open_artifact(kinds("llama-mxfp4"))
    m = v.kv[names.KEY_TOK_MERGES]
    assert (m.type, m.sub_type, tuple(m.value)) == (VT.ARRAY, VT.STRING, ())  # the copy tokenizer has none
    assert v.kv[names.KEY_TOK_MODEL].value == "gpt2"


def test_the_table_holds_the_loader_facts():
    assert KEY_RULES[names.KEY_ROPE_SCALING_ORIG_CTX].types == ((VT.UINT32, None),)
    assert KEY_RULES[names.KEY_EXPERT_WEIGHTS_NORM].types == ((VT.BOOL, None),)
    assert KEY_RULES[names.KEY_EXPERT_GATING_FUNC].required
    assert KEY_RULES[names.KEY_SWIGLU_CLAMP].per_block
    assert (VT.ARRAY, VT.INT32) in KEY_RULES[names.KEY_COMPRESS_RATIOS].types


def _kv(**over):
    base = {names.KEY_BLOCK_COUNT: (3, VT.UINT32, None), names.KEY_COMPRESS_RATIOS: ([0, 4, 128], VT.ARRAY, VT.INT32),
            "deepseek4.hyper_connection.count": (4, VT.UINT32, None),
            "deepseek4.attention.indexer.key_length": (64, VT.UINT32, None),
            names.KEY_EXPERT_GATING_FUNC: (4, VT.UINT32, None), names.KEY_ROPE_SCALING_TYPE: ("yarn", VT.STRING, None)}
    base.update(over)
    return {k: make_kv(*v) for k, v in base.items()}


def test_dims_outside_the_fixed_set_are_named():
    assert dim_problems(_kv()) == []
    cases = {
        names.KEY_COMPRESS_RATIOS: ([0, 4, 16], VT.ARRAY, VT.INT32),
        "deepseek4.hyper_connection.count": (2, VT.UINT32, None),
        "deepseek4.attention.indexer.key_length": (96, VT.UINT32, None),
        names.KEY_EXPERT_GATING_FUNC: (2, VT.UINT32, None),
        names.KEY_ROPE_SCALING_TYPE: ("dynamic", VT.STRING, None),
    }
    for key, val in cases.items():
        (p,) = dim_problems(_kv(**{key: val}))
        assert (key if key != names.KEY_COMPRESS_RATIOS else "compress ratio") in p
    (p,) = dim_problems(_kv(**{names.KEY_COMPRESS_RATIOS: ([0, 4], VT.ARRAY, VT.INT32)}))
    assert "2 entries for 3 blocks" in p


def test_an_artifact_in_the_old_dialect_still_reads_and_verifies(kinds, tmp_path):
    """An artifact written before llama.cpp's dialect: scalar clamp, UINT64 original context,
    UINT32 ratios, no gating / norm / scaling type keys. It verifies (its key claims no more than
    it can), the runtime's header reads it, and the GGUF-source reader parses it."""
    from ds4quant.sources.gguf_source import config_from_kvs

    strix = kinds("strix")
    v = open_artifact(strix)
    n = int(v.kv[names.KEY_BLOCK_COUNT].value)
    old = rewrite(strix, tmp_path / "old", kv={
        names.KEY_SWIGLU_CLAMP: (10.0, VT.FLOAT32, None),
        names.KEY_ROPE_SCALING_ORIG_CTX: (1024, VT.UINT64, None),
        names.KEY_COMPRESS_RATIOS: (list(v.kv[names.KEY_COMPRESS_RATIOS].value), VT.ARRAY, VT.UINT32),
        names.KEY_EXPERT_GATING_FUNC: None, names.KEY_EXPERT_WEIGHTS_NORM: None, names.KEY_ROPE_SCALING_TYPE: None,
        names.KEY_RUNTIMES: (["ds4quant", "lucebox"], VT.ARRAY, VT.STRING)})
    o = open_artifact(old)
    assert o.header.swiglu_limit == v.header.swiglu_limit == 10.0 and n == o.header.n_layer
    assert o.runtimes == v.runtimes == ("ds4quant", "lucebox") and o.problems() == []
    rep = verify(old)
    assert rep.ok, [c.one_line() for c in rep.failed]
    # the GGUF-source reader (an mxfp4 artifact may be converted again) takes both dialects
    a, b = config_from_kvs(o.gguf, o.tensors, "old"), config_from_kvs(v.gguf, v.tensors, "new")
    assert (a.swiglu_limit, a.scoring_func, a.norm_topk_prob) == (b.swiglu_limit, b.scoring_func, b.norm_topk_prob)
    assert a.compress_ratios == b.compress_ratios and a.rope_scaling.original_context_length == 1024
