"""The joint gate+up codebook fit for forced-MIX tensors (``convert --gate-up-books joint``).

tests/data/gateup_joint/vector.npz was written once by make_vector.py beside it, from its own
reading of Lucebox's converter's rule (one book pair per expert over gate rows then up rows,
shared by both); ds4quant's fitter must give the same bf16 books, and the encoder the same bytes.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ds4quant import formats
from ds4quant.plan import Books
from ds4quant.codebooks import fit_reference
from ds4quant.plan import TensorChoice
from ds4quant.sources.naming import Kind, Mapped

VECTOR = Path(__file__).resolve().parents[1] / "data" / "gateup_joint" / "vector.npz"


@pytest.fixture(scope="module")
def vec():
    return dict(np.load(VECTOR))


def _bits(books: np.ndarray) -> np.ndarray:
    return (np.asarray(books, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_fitter_matches_the_lucebox_rule_vector(vec):
    for e in range(2):
        books, _ = fit_reference([vec["gate"][e], vec["up"][e]], 4, [vec["imp_gate"], vec["imp_up"]])
        assert _bits(books).tolist() == vec["books_bf16"][e].tolist(), e
        fl = books.astype(np.float32)
        assert formats.encode("rocmfp2_mix", vec["gate"][e], vec["imp_gate"], fl).tobytes() == \
            vec["encoded_gate"][e].tobytes()
        assert formats.encode("rocmfp2_mix", vec["up"][e], vec["imp_up"], fl).tobytes() == \
            vec["encoded_up"][e].tobytes()
        # a separate fit differs: the joint rule is what the vector pins
        alone, _ = fit_reference([vec["gate"][e]], 4, vec["imp_gate"])
        assert _bits(alone).tolist() != vec["books_bf16"][e].tolist()


def _plan(vec):
    plan, members, data = [], {}, {}
    for proj, w in (("down", "w2"), ("gate", "w1"), ("up", "w3")):
        name = f"blk.0.ffn_{proj}_exps.weight"
        qt = "rocmfp3" if proj == "down" else "rocmfp2_mix"
        plan.append(TensorChoice(name, "routed_expert", (128, 8, 2), "I8", qt, qt, "override", proj, 0))
        ms = []
        for e in range(2):
            off = f"layers.0.ffn.experts.{e}.{w}.weight"
            ms.append(Mapped(off, name, Kind.ROUTED_EXPERT, layer=0, expert=e, which=proj))
            data[off] = vec[proj][e] if proj != "down" else vec["gate"][e]
        members[name] = tuple(ms)
    src = SimpleNamespace(read_dequantized=lambda n: data[n], release=lambda n: None)
    return plan, members, src


@pytest.mark.parametrize("joint", [True, False])
def test_convert_fit_shares_one_pair_per_expert_only_when_joint(vec, joint, monkeypatch):
    from ds4quant.convert import plan as P

    imp = {"blk.0.ffn_gate_exps.weight": vec["imp_gate"], "blk.0.ffn_up_exps.weight": vec["imp_up"]}
    monkeypatch.setattr(P, "importance", lambda imx, name, expert, cols: imp.get(name))
    plan, members, src = _plan(vec)
    books = Books()
    P.fit_fixed_mix_books(plan, members, src, object(), books, joint_gate_up=joint)
    for e in range(2):
        g, gm = books.get("blk.0.ffn_gate_exps.weight", e, "rocmfp2_mix")
        u, um = books.get("blk.0.ffn_up_exps.weight", e, "rocmfp2_mix")
        assert gm == um == 1
        assert np.array_equal(g, u) == joint
        if joint:
            assert _bits(g).tolist() == vec["books_bf16"][e].tolist()
        else:
            assert _bits(u).tolist() == _bits(fit_reference([vec["up"][e]], 4, vec["imp_up"])[0]).tolist()
    assert ("blk.0.ffn_down_exps.weight", 0, "rocmfp3") not in books


def test_convert_joint_writes_one_pair_for_gate_and_up(tmp_path):
    from ds4quant.artifact.view import open_artifact
    from ds4quant.convert import convert
    from ds4quant.errors import BadInputError
    from ds4quant.verify import verify
    from tests.artifact.conftest import IMATRIX, SAMPLE

    out = tmp_path / "joint"
    rep = convert(SAMPLE, out, "rocmfp2-strix", threads=1, imatrix=IMATRIX, gate_up_books="joint",
                  tensor_types=[r"blk\.1\.ffn_(gate|up)_exps=rocmfp2_mix"])
    assert rep.recipe["gate_up_books"] == "joint"
    v = open_artifact(out)
    g, u = v.book_entry("blk.1.ffn_gate_exps.weight"), v.book_entry("blk.1.ffn_up_exps.weight")
    assert g.books.shape[0] == 16 and np.array_equal(g.books, u.books) and np.array_equal(g.modes, u.modes)
    assert "lucebox-mix" in v.runtimes and verify(out).ok
    with pytest.raises(BadInputError, match="gate-up-books"):
        convert(SAMPLE, tmp_path / "x", "rocmfp2-strix", gate_up_books="fused")
