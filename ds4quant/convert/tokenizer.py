"""The source's tokenizer as ``tokenizer.ggml.*`` GGUF keys, and the check against it.

A source folder with ``tokenizer.json`` (Hugging Face tokenizers format)
gets the keys llama.cpp's converters write, so a runtime can tokenize without
the source: ``model`` (BPE -> "gpt2", Unigram -> "t5", WordPiece -> "bert"),
``pre`` ("default"), ``tokens`` (one string per id, 0..vocab_size-1),
``token_type`` (1 normal, 2 unknown, 3 control = special added token,
4 user-defined = other added token, 5 unused = padding up to the model's
vocab_size, named ``[PAD<id>]`` as llama.cpp does), ``merges`` ("a b"; always
written for BPE, empty when the tokenizer has none: llama.cpp requires the key),
``scores`` (Unigram), and the bos/eos/pad/unk ids from config.json, else
tokenizer_config.json's special tokens. A folder without tokenizer.json gets
no keys (its artifact bytes do not change).

    kvs = tokenizer_kvs("samples/ds4-copy", vocab_size=264)
    problems, detail = compare_tokenizer(view.kv, "samples/ds4-copy")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple, Optional

from ds4quant import names
from ds4quant.errors import BadInputError, UnsupportedFormatError

TOKENIZER_JSON = "tokenizer.json"
_MODELS = {"BPE": "gpt2", "Unigram": "t5", "WordPiece": "bert"}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 1, 2, 3, 4, 5


class TokKv(NamedTuple):
    """(key, value, gguf.GGUFValueType, sub_type) as the writer's ``add_kv`` takes them."""

    key: str
    value: Any
    type: Any
    sub_type: Any = None


class Vocab(NamedTuple):
    model: str
    tokens: tuple[str, ...]
    types: tuple[int, ...]
    merges: tuple[str, ...]
    scores: Optional[tuple[float, ...]]
    special: dict  # key -> id


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BadInputError(f"cannot read: {e}", where=str(p)) from None


def read_vocab(source: "str | Path", vocab_size: Optional[int] = None) -> Optional[Vocab]:
    """The source's tokenizer as GGUF vocabulary lists; None without tokenizer.json."""
    folder = Path(source)
    p = folder / TOKENIZER_JSON
    if not folder.is_dir() or not p.is_file():
        return None
    d = _read_json(p)
    model = d.get("model") or {}
    kind = model.get("type")
    if kind not in _MODELS:
        raise UnsupportedFormatError(f"tokenizer model {kind!r} has no GGUF form here (BPE, Unigram, WordPiece)",
                                     where=str(p))
    by_id: dict[int, str] = {}
    scores: dict[int, float] = {}
    if kind == "Unigram":
        for i, (tok, score) in enumerate(model.get("vocab") or []):
            by_id[i] = tok
            scores[i] = float(score)
    else:
        for tok, i in (model.get("vocab") or {}).items():
            by_id[int(i)] = tok
    types = {i: NORMAL for i in by_id}
    if kind == "Unigram" and model.get("unk_id") is not None:
        types[int(model["unk_id"])] = UNKNOWN
    for a in d.get("added_tokens") or []:
        i = int(a["id"])
        if i in by_id and by_id[i] != a["content"]:
            raise BadInputError(f"added token {a['content']!r} reuses id {i} of {by_id[i]!r}", where=str(p))
        by_id[i] = a["content"]
        types[i] = CONTROL if a.get("special") else USER_DEFINED
    n = max(by_id) + 1 if by_id else 0
    if vocab_size is not None:
        if n > vocab_size:
            raise BadInputError(f"the tokenizer has ids up to {n - 1}, the model's vocab_size is {vocab_size}",
                                where=str(p))
        n = vocab_size
    tokens, ttypes, sc = [], [], []
    for i in range(n):
        if i in by_id:
            tokens.append(by_id[i])
            ttypes.append(types[i])
        else:
            tokens.append(f"[PAD{i}]")
            ttypes.append(UNUSED)
        sc.append(scores.get(i, 0.0))
    merges = []
    for m in model.get("merges") or []:
        merges.append(m if isinstance(m, str) else " ".join(m))
    special = _special_ids(folder, {t: i for i, t in by_id.items()})
    if kind == "Unigram" and model.get("unk_id") is not None:
        special.setdefault(names.KEY_TOK_UNK, int(model["unk_id"]))
    return Vocab(_MODELS[kind], tuple(tokens), tuple(ttypes), tuple(merges),
                 tuple(sc) if kind == "Unigram" else None, special)


def _special_ids(folder: Path, ids: dict[str, int]) -> dict:
    """bos/eos/pad ids: config.json's, else tokenizer_config.json's token strings looked up."""
    out: dict[str, int] = {}
    cfg = folder / "config.json"
    c = _read_json(cfg) if cfg.is_file() else {}
    tc_p = folder / "tokenizer_config.json"
    tc = _read_json(tc_p) if tc_p.is_file() else {}
    for key, cfg_key, tok_key in ((names.KEY_TOK_BOS, "bos_token_id", "bos_token"),
                                  (names.KEY_TOK_EOS, "eos_token_id", "eos_token"),
                                  (names.KEY_TOK_PAD, "pad_token_id", "pad_token"),
                                  (names.KEY_TOK_UNK, None, "unk_token")):
        v = c.get(cfg_key) if cfg_key else None
        if isinstance(v, list):
            v = v[0] if v else None
        if v is None:
            t = tc.get(tok_key)
            t = t.get("content") if isinstance(t, dict) else t
            v = ids.get(t) if isinstance(t, str) else None
        if isinstance(v, int) and not isinstance(v, bool):
            out[key] = v
    return out


def tokenizer_kvs(source: "str | Path", vocab_size: Optional[int] = None) -> list:
    """The ``tokenizer.ggml.*`` KVs of ``source`` (empty without tokenizer.json)."""
    v = read_vocab(source, vocab_size)
    if v is None:
        return []
    from gguf import GGUFValueType as VT

    kvs = [TokKv(names.KEY_TOK_MODEL, v.model, VT.STRING), TokKv(names.KEY_TOK_PRE, "default", VT.STRING),
           TokKv(names.KEY_TOK_TOKENS, list(v.tokens), VT.ARRAY, VT.STRING),
           TokKv(names.KEY_TOK_TOKEN_TYPE, list(v.types), VT.ARRAY, VT.INT32)]
    if v.scores is not None:
        kvs.append(TokKv(names.KEY_TOK_SCORES, list(v.scores), VT.ARRAY, VT.FLOAT32))
    if v.merges or v.model == _MODELS["BPE"]:
        # llama.cpp refuses a "gpt2" vocabulary without the key; an empty list is what it reads then
        kvs.append(TokKv(names.KEY_TOK_MERGES, list(v.merges), VT.ARRAY, VT.STRING))
    for key in (names.KEY_TOK_BOS, names.KEY_TOK_EOS, names.KEY_TOK_PAD, names.KEY_TOK_UNK):
        if key in v.special:
            kvs.append(TokKv(key, int(v.special[key]), VT.UINT32))
    # the source's tokenizer.json adds no special tokens itself (no post_processor); the
    # runtime puts bos first, as runtime.fidelity does
    kvs.append(TokKv(names.KEY_TOK_ADD_BOS, True, VT.BOOL))
    kvs.append(TokKv(names.KEY_TOK_ADD_EOS, False, VT.BOOL))
    return kvs


def _plain(kv) -> Any:
    if kv is None:
        return None
    v = kv.value
    if hasattr(v, "tolist"):
        return v.tolist()
    return list(v) if isinstance(v, tuple) else v


def compare_tokenizer(kv, source: "str | Path") -> tuple[list[str], Optional[str]]:
    """The artifact's tokenizer keys against the source's tokenizer.json.

    Returns (problems, detail): each problem names the key; detail is None when
    neither side has a tokenizer (nothing to check)."""
    keys = [k for k in kv if k.startswith(names.KEY_TOK_PREFIX)]
    vocab_kv = kv.get(names.KEY_VOCAB_SIZE)
    vocab_size = int(_plain(vocab_kv)) if vocab_kv is not None else None
    want = read_vocab(source, vocab_size) if Path(source).is_dir() else None
    if want is None:
        if keys:
            return [f"the artifact has {len(keys)} tokenizer key(s), the source has no {TOKENIZER_JSON}"], ""
        return [], None
    if not keys:
        return [f"the source has {TOKENIZER_JSON} but the artifact has no {names.KEY_TOK_PREFIX}* keys "
                "(converted by an older ds4quant?)"], ""
    problems = []
    expect = {k.key: (list(k.value) if isinstance(k.value, list) else k.value)
              for k in tokenizer_kvs(source, vocab_size)}
    for key, val in expect.items():
        if key == names.KEY_TOK_MERGES and val == [] and key not in kv:
            continue  # artifacts from before the empty list was written: the same (no) merges
        got = _plain(kv.get(key))
        if isinstance(val, list) and isinstance(got, list) and key == names.KEY_TOK_SCORES:
            same = len(got) == len(val) and all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(got, val))
        else:
            same = got == val
        if not same:
            if isinstance(val, list) and isinstance(got, list):
                diff = next((i for i, (a, b) in enumerate(zip(got, val)) if a != b), min(len(got), len(val)))
                problems.append(f"{key}: {len(got)} entries, the source's {len(val)}; first difference at {diff}")
            else:
                problems.append(f"{key} = {got!r}, the source's {TOKENIZER_JSON} gives {val!r}")
    for key in sorted(set(keys) - set(expect)):
        problems.append(f"{key} is in the artifact but not derived from the source's {TOKENIZER_JSON}")
    n = len(expect[names.KEY_TOK_TOKENS])
    return problems, f"{n} tokens ({expect[names.KEY_TOK_MODEL]}) match the source's {TOKENIZER_JSON}"
