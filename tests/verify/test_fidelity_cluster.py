"""verify --fidelity --placement cluster.json: the candidate's routed experts on
gloo ranks (runtime.cluster.group), started once per run; exact mode gives the
single-process hashes; a bad cluster placement or a dead rank is one line and
exit 2 with no process, temporary folder or shared memory left behind.

Short evaluation tokens keep it small (2 CI cores): the greedy response and
the per-layer error still call every layer's experts dozens of times."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("torch.distributed")

ROOT = Path(__file__).resolve().parents[2]
COPY = ROOT / "samples" / "ds4-copy"
TOKENS = "0 102 114 115 124 61 35 110 58 116 53 35\n"  # bos + "copy: k7q2 -" through the byte tokenizer


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    from ds4quant.convert import convert

    out = tmp_path_factory.mktemp("fidc") / "mx"
    convert(COPY, out, "mxfp4", force=True, command=["test"])
    return out


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    p = tmp_path_factory.mktemp("fidc-tok") / "tokens.txt"
    p.write_text(TOKENS)
    return p


def _rank_placement(art: Path, n: int, out: Path, artifact=None, replicate_hot: int = 2) -> Path:
    from ds4quant.artifact.view import open_artifact
    from ds4quant.calib.routing import RoutingProfile
    from ds4quant.runtime.placement import write_placement
    from ds4quant.runtime.planning import plan_ranks

    with open_artifact(art) as v:
        h, fp = v.header, v.fingerprint()
    counts = (np.arange(h.n_layer * h.n_expert, dtype=np.uint64).reshape(h.n_layer, h.n_expert) * 7919) % 1000
    prof = RoutingProfile(h.n_layer, h.n_expert, h.n_expert_used, counts)
    p = plan_ranks(prof, n, "balanced", replicate_hot, owner="cpu", artifact=artifact or fp)
    return write_placement(out, p)


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """The ranks' temporary folder goes under this test's own folder, so what is
    left over is this test's alone (other runs on a shared machine make their own)."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _leftovers(d: Path) -> tuple[list[int], list[str], set[str]]:
    """Live processes started for folder ``d``, cluster folders left in it, /dev/shm's entries."""
    procs = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if str(d).encode() in (p / "cmdline").read_bytes():
                    procs.append(int(p.name))
            except OSError:
                pass
    tmps = sorted(str(p) for p in d.glob("ds4q-cluster-*"))
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    return procs, tmps, shm


def test_two_ranks_give_the_single_process_hashes(mx, tokens, tmp_path, own_tmp):
    from ds4quant.verify import verify

    plc = _rank_placement(mx, 2, tmp_path / "cluster.json")
    before = _leftovers(own_tmp)
    rep = verify(mx, source=COPY, fidelity=True, mode="exact", tokens=tokens, placements=(None, str(plc)))
    f = rep.fidelity
    sp = f.second
    assert len(f.moe_output_sha256) == 64
    assert sp.moe_output_sha256 == f.moe_output_sha256
    assert sp.response_sha256 == f.response_sha256
    assert f.identical
    assert {c.name: c.ok for c in rep.checks}["fidelity.identity"]
    assert f.placements[1] == f"{plc} (2 gloo ranks)"
    (c,) = f.cluster
    # the ranks were started once and served every experts call of the second run: the
    # logits pass and each greedy step call all 4 MoE layers
    assert c["n_ranks"] == 2 and c["calls"] == 4 * (1 + len(f.response_token_ids)) > 40, c["calls"]
    assert c["start_s"] > 0 and c["call_ms_median"] > 0
    from ds4quant.artifact.view import open_artifact
    from ds4quant.runtime.placement import read_placement

    p = read_placement(plc)
    with open_artifact(mx) as v:
        nb = v.expert_nbytes()
    for r, rk in enumerate(c["ranks"]):
        share = sum(int(nb[L, e]) for L in range(4) for e in range(32) if p.ranks.owner[L][e] in (r, -1))
        assert rk["expert_bytes_read"] == rk["share_bytes"] == share < int(nb.sum())
        assert rk["dense_bytes_read"] == 0
    assert json.dumps(rep.to_json()["fidelity"]["cluster"])  # the report carries it
    assert _leftovers(own_tmp) == before


def test_fast_mode_through_two_ranks_answers_like_one_process(mx, tokens, tmp_path, own_tmp):
    """Fast mode is not bitwise (owner-local BLAS), so only the answer is compared:
    the lossless artifact's greedy response through the ranks is the one-process one."""
    from ds4quant.verify import verify

    plc = _rank_placement(mx, 2, tmp_path / "cluster.json")
    before = _leftovers(own_tmp)
    rep = verify(mx, source=COPY, fidelity=True, mode="fast", tokens=tokens, placements=(None, str(plc)))
    f = rep.fidelity
    assert f.logits.kl_mean < 1e-6 and f.logits.top1 == 1.0
    assert f.second.response_sha256 == f.response_sha256
    (c,) = f.cluster
    assert c["n_ranks"] == 2 and c["calls"] > 40
    assert _leftovers(own_tmp) == before


def test_a_bad_cluster_placement_is_refused_with_exit_2(mx, tmp_path, own_tmp):
    from click.testing import CliRunner

    from ds4quant.cli import cli

    before = _leftovers(own_tmp)
    other = _rank_placement(mx, 2, tmp_path / "other.json", artifact="sha256:" + "ab" * 32)
    good = _rank_placement(mx, 2, tmp_path / "good.json")
    broken = tmp_path / "broken.json"
    j = json.loads(good.read_text())
    j["ranks"]["owner"][0][0] = 5  # not a rank of 2; the stored content hash no longer matches either
    broken.write_text(json.dumps(j))
    for bad, says in ((other, "placement was planned for artifact sha256:abab"),
                      (broken, "broken.json")):
        r = CliRunner().invoke(cli, ["verify", str(mx), "--source", str(COPY), "--fidelity", "--mode", "exact",
                                     "--placement", str(bad)])
        assert r.exit_code == 2, r.output
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("ds4quant: error:") and says in lines[0], r.output
    assert _leftovers(own_tmp) == before


def test_a_rank_killed_mid_run_is_one_line_and_exit_2(mx, tokens, tmp_path, own_tmp, monkeypatch):
    from click.testing import CliRunner

    from ds4quant.cli import cli
    from ds4quant.runtime.cluster import FAULT_ENV

    plc = _rank_placement(mx, 2, tmp_path / "cluster.json")
    before = _leftovers(own_tmp)
    monkeypatch.setenv(FAULT_ENV, "1:2:kill")  # rank 1 dies at its first call of layer 2
    r = CliRunner().invoke(cli, ["verify", str(mx), "--source", str(COPY), "--fidelity", "--mode", "exact",
                                 "--tokens", str(tokens), "--placement", str(plc)])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1, r.output
    assert lines[0].startswith("ds4quant: error: cluster of 2 ranks failed")
    assert "rank 1: killed by signal 9" in lines[0] and "layer 2 exchange failed" in lines[0], lines[0]
    assert _leftovers(own_tmp) == before
