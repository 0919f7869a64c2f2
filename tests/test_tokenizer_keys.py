"""tokenizer.ggml.* keys: written from the source's tokenizer.json, checked by verify, round-tripped."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from ds4quant import names

ROOT = Path(__file__).resolve().parents[1]
COPY = ROOT / "samples" / "ds4-copy"
TINY = ROOT / "samples" / "ds4-tiny"


@pytest.fixture(scope="module")
def copy_art(tmp_path_factory):
    from ds4quant.convert import convert

    out = tmp_path_factory.mktemp("tok") / "copy"
    convert(COPY, out, "mxfp4", force=True, command=["test"])
    return out


def test_tokens_round_trip_to_the_source_tokenizer(copy_art):
    transformers = pytest.importorskip("transformers")
    from ds4quant.artifact.view import open_artifact

    tok = transformers.AutoTokenizer.from_pretrained(str(COPY))
    cfg = json.loads((COPY / "config.json").read_text())
    with open_artifact(copy_art) as v:
        tokens = list(v.kv[names.KEY_TOK_TOKENS].value)
        types = [int(t) for t in v.kv[names.KEY_TOK_TOKEN_TYPE].value]
        assert v.kv[names.KEY_TOK_MODEL].value == "gpt2"
        assert int(v.kv[names.KEY_TOK_BOS].value) == cfg["bos_token_id"] == tok.bos_token_id
        assert int(v.kv[names.KEY_TOK_EOS].value) == cfg["eos_token_id"] == tok.eos_token_id
        assert int(v.kv[names.KEY_TOK_PAD].value) == cfg["pad_token_id"] == tok.pad_token_id
    assert len(tokens) == cfg["vocab_size"]
    vocab = tok.get_vocab()
    assert {t: i for i, t in enumerate(tokens) if t in vocab} == vocab  # every token at its id
    assert all(types[i] == 3 for i in tok.all_special_ids)
    # text through the GGUF tokens: byte-level tokens decode to the same ids
    text = ">>> def zo_ka(a, b):\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert [tokens.index(tok.convert_ids_to_tokens(i)) for i in ids] == ids


def test_verify_checks_the_keys_against_the_source(copy_art, tmp_path):
    from ds4quant.verify import verify

    rep = verify(copy_art, source=COPY)
    (c,) = [c for c in rep.checks if c.name == "tokenizer"]
    assert c.ok and "264 tokens" in c.detail
    # a source whose tokenizer differs: one swapped token is a failed check naming the key
    other = tmp_path / "src"
    shutil.copytree(COPY, other)
    d = json.loads((other / "tokenizer.json").read_text())
    d["added_tokens"][2]["content"] = "<padx>"
    d["model"]["vocab"]["<padx>"] = d["model"]["vocab"].pop("<pad>")
    (other / "tokenizer.json").write_text(json.dumps(d))
    from ds4quant.convert.tokenizer import compare_tokenizer
    from ds4quant.artifact.view import open_artifact

    with open_artifact(copy_art) as v:
        problems, _ = compare_tokenizer(v.kv, other)
    assert any(names.KEY_TOK_TOKENS in p and "first difference at 2" in p for p in problems)


def test_sources_without_tokenizer_write_no_keys_and_same_bytes(tmp_path, monkeypatch):
    import ds4quant.convert as convert_mod
    from ds4quant.convert import convert
    from ds4quant.convert.tokenizer import tokenizer_kvs
    from ds4quant.artifact.view import open_artifact

    assert tokenizer_kvs(TINY) == []
    out = tmp_path / "tiny"
    convert(TINY, out, "rocmfp2-strix", force=True, command=["x"])
    with open_artifact(out) as v:
        assert not [k for k in v.kv if k.startswith(names.KEY_TOK_PREFIX)]
    got = hashlib.sha256(next(out.glob("*.gguf")).read_bytes()).hexdigest()
    # the bytes convert writes with the tokenizer step taken out entirely
    monkeypatch.setattr(convert_mod, "tokenizer_kvs", lambda *a, **k: [])
    convert(TINY, tmp_path / "without", "rocmfp2-strix", force=True, command=["x"])
    assert got == hashlib.sha256(next((tmp_path / "without").glob("*.gguf")).read_bytes()).hexdigest()
