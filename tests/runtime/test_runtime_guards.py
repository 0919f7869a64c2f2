"""Small runtime rules a plausible slip would break without another test noticing:

- the canonical combine starts each token's sum from its first weighted
  product, so an all -0.0 combine stays -0.0 (a sum started from +0 gives +0);
- a placement's content hash covers its owners list (their order says which
  owner is hot and indexes owner_of);
- the exact-copy protocol's answer ends with its newline, and a copy without
  it fails; the three repeats of an identifier use three different templates.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.errors import IntegrityError  # noqa: E402
from ds4quant.runtime import fidelity as fd  # noqa: E402
from ds4quant.runtime.execute import combine  # noqa: E402
from ds4quant.runtime.placement import Placement, placement_from_json, read_placement, write_placement  # noqa: E402


# --------------------------------------------------------------------------
# combine


@pytest.mark.parametrize("held", [None, "some"])
def test_a_negative_zero_combine_stays_negative_zero(held):
    T, K, H = 3, 4, 8
    w = torch.full((T, K), 0.25)
    y = torch.full((T, K, H), -0.0)
    y[2, :, :4] = 0.0  # token 2: mixed signs of zero -> +0 in those columns (IEEE: -0 + +0 = +0)
    keep = None
    if held == "some":
        keep = np.ones((T, K), bool)
        keep[:, 0] = False  # the first slot held elsewhere: the sum starts at the second
    out = combine(w, y, keep).numpy()
    assert np.signbit(out[:2]).all() and (out[:2] == 0).all()
    assert not np.signbit(out[2, :4]).any() and np.signbit(out[2, 4:]).all()
    # a shared expert of -0.0 keeps it, +0.0 turns it
    assert np.signbit(combine(w, y, keep, shared=torch.full((T, H), -0.0)).numpy()[:2]).all()
    assert not np.signbit(combine(w, y, keep, shared=torch.zeros((T, H))).numpy()).any()


# --------------------------------------------------------------------------
# placement hash


def test_the_content_hash_covers_the_owners_list(tmp_path):
    experts = [[[0, 1, 2], [3, 4, 5]] for _ in range(2)]
    a = Placement.build(2, 6, 2, ["cpu:0", "torch-cpu:1"], experts)
    # the same experts per owner name, the owners listed the other way round: another placement
    b = Placement.build(2, 6, 2, ["torch-cpu:1", "cpu:0"], [[e[1], e[0]] for e in experts])
    assert a.experts_of("cpu:0", 0) == b.experts_of("cpu:0", 0)
    assert a.owners != b.owners and a.content_sha256 != b.content_sha256
    # an owner that holds nothing is part of the placement too
    c = Placement.build(2, 6, 2, ["cpu:0", "torch-cpu:1", "cpu:2"], [[*e, []] for e in experts])
    assert c.content_sha256 not in (a.content_sha256, b.content_sha256)
    # a file whose owners were reordered by hand no longer matches its stored hash
    f = write_placement(tmp_path / "a.json", a)
    assert read_placement(f) == a
    import json

    j = json.loads(f.read_text())
    j["owners"] = list(reversed(j["owners"]))
    with pytest.raises(IntegrityError, match="content_sha256"):
        placement_from_json(j, "edited")


# --------------------------------------------------------------------------
# the exact-copy protocol


def test_the_repeats_of_an_identifier_use_three_templates():
    pats = [re.compile("^" + re.escape(t).replace(re.escape("{x}"), "(?P<x>[A-Za-z_][A-Za-z0-9_]*)")
                       .replace(re.escape("{n}"), r"\d+") + "$") for t in fd.TEMPLATES]
    trials = fd.protocol_trials()
    for i in range(0, len(trials), fd.N_REPEATS):
        group = trials[i:i + fd.N_REPEATS]
        used = []
        for t in group:
            hits = [k for k, p in enumerate(pats) if (m := p.match(t.expected)) and m.group("x") == t.identifier]
            assert len(hits) == 1, (t.expected, hits)
            used.append(hits[0])
        assert len(set(used)) == fd.N_REPEATS, (group[0].identifier, used)


class _Oracle(torch.nn.Module):
    """A 'model' that predicts each next token of its (teacher-forced) input, except,
    with ``drop_last``, the last token of each row: there it predicts eos."""

    def __init__(self, vocab: int, pad: int, eos: int, drop_last: bool):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.pad, self.eos, self.drop_last = vocab, pad, eos, drop_last

    def forward(self, ids, use_cache=False):
        B, L = ids.shape
        nxt = torch.cat([ids[:, 1:], torch.full((B, 1), self.pad)], dim=1)
        if self.drop_last:
            for b in range(B):
                last = int((ids[b] != self.pad).nonzero().max())
                nxt[b, last - 1] = self.eos
        logits = torch.zeros((B, L, self.vocab))
        logits.scatter_(2, nxt[:, :, None], 1.0)
        return SimpleNamespace(logits=logits)


def test_a_copy_without_its_closing_newline_fails():
    tok = fd.ByteTokenizer()
    assert fd.trial_ids(tok, fd.protocol_trials()[0])[1][-1] == tok.encode("\n")[0]
    good = fd.exact_copy(_Oracle(512, tok.eos_token_id, tok.eos_token_id, False), tok)
    assert good.passes == good.trials == 60
    bad = fd.exact_copy(_Oracle(512, tok.eos_token_id, tok.eos_token_id, True), tok)
    assert bad.passes == 0 and len(bad.failures) == 60
    f = bad.failures[0]
    assert f.got.rstrip("\n") == f.expected and not f.got.endswith("\n")  # all but the newline was right
