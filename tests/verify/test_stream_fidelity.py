"""verify --fidelity --stream: the layer-streamed passes give the whole model's figures and hashes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
COPY = ROOT / "samples" / "ds4-copy"
SPLIT = {L: {"cpu:0": tuple(range(0, 32, 2)), "cpu:1": tuple(range(1, 32, 2))} for L in range(4)}


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    from ds4quant.convert import convert

    out = tmp_path_factory.mktemp("sf") / "mx"
    convert(COPY, out, "mxfp4", force=True, command=["test"])
    return out


def test_streamed_equals_whole_model_on_two_placements(mx, tmp_path):
    from ds4quant.verify import verify
    from ds4quant.verify.reference_side import make_reference_base

    kw = dict(source=COPY, fidelity=True, mode="exact", protocol="exact-copy", copy_sets=2, placements=(None, SPLIT))
    whole = verify(mx, **kw).fidelity
    streamed = verify(mx, stream=True, **kw).fidelity
    assert streamed.kl == whole.kl and streamed.logits == whole.logits
    assert streamed.moe_output_sha256 == whole.moe_output_sha256 and streamed.identical and whole.identical
    assert streamed.exact_copy.sets == whole.exact_copy.sets
    assert streamed.exact_copy.reference_sets == whole.exact_copy.reference_sets
    assert streamed.exact_copy.failed == whole.exact_copy.failed
    # the per-layer MoE errors stream too: the same figures (norms summed per batch, not over one
    # concatenation: equal to a few ulps), every MoE layer, local and propagated
    assert [e.layer for e in streamed.layers] == [e.layer for e in whole.layers] and len(whole.layers) == 4
    for s_, w_ in zip(streamed.layers, whole.layers):
        assert s_.local == pytest.approx(w_.local, rel=1e-9, abs=1e-15)
        assert s_.propagated == pytest.approx(w_.propagated, rel=1e-9, abs=1e-15)
        assert 0 < s_.local < 1 and 0 < s_.propagated < 1
    assert streamed.response_sha256 == "" and not streamed.response_matches_reference
    base = tmp_path / "s.base"
    make_reference_base(COPY, base, protocol="exact-copy", copy_sets=2, stream=True)
    both = verify(mx, stream=True, reference=base, **kw).fidelity
    assert both.kl.same_top1 == whole.kl.same_top1 and abs(both.kl.kld_mean - whole.kl.kld_mean) < 1e-4
    assert both.moe_output_sha256 == whole.moe_output_sha256
    assert both.exact_copy.reference_sets == whole.exact_copy.reference_sets
    assert both.layers == ()  # a base keeps no MoE block inputs


def test_streamed_candidate_on_cluster_ranks_gives_the_single_process_bits(mx, tmp_path, monkeypatch):
    import tempfile

    import numpy as np

    from ds4quant.artifact.view import open_artifact
    from ds4quant.calib.routing import RoutingProfile
    from ds4quant.runtime.placement import write_placement
    from ds4quant.runtime.planning import plan_ranks
    from ds4quant.verify import verify

    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))  # the ranks' files under this test's folder
    with open_artifact(mx) as v:
        h, fp = v.header, v.fingerprint()
    counts = (np.arange(h.n_layer * h.n_expert, dtype=np.uint64).reshape(h.n_layer, h.n_expert) * 7919) % 1000
    plc = write_placement(tmp_path / "cluster.json",
                          plan_ranks(RoutingProfile(h.n_layer, h.n_expert, h.n_expert_used, counts), 2, "balanced", 2,
                                     owner="cpu", artifact=fp))
    f = verify(mx, source=COPY, fidelity=True, mode="exact", stream=True, placements=(None, plc)).fidelity
    assert f.identical and "gloo ranks" in f.placements[1]


def test_a_budget_and_an_explicit_device_change_no_figure(mx, tmp_path):
    """--max-memory and --device cpu only decide where the streamed passes keep things:
    the same figures and hashes as the unplaced run; a budget below one layer is refused
    up front, naming the layer, and so are --device/--max-memory without --stream."""
    from ds4quant.errors import BadInputError, BudgetError
    from ds4quant.verify import verify
    from ds4quant.verify.reference_side import make_reference_base

    kw = dict(source=COPY, fidelity=True, mode="exact", stream=True)
    plain = verify(mx, **kw).fidelity
    placed = verify(mx, device="cpu", max_memory="2G", **kw).fidelity
    assert placed.kl == plain.kl and placed.logits == plain.logits
    assert placed.moe_output_sha256 == plain.moe_output_sha256
    with pytest.raises(BudgetError, match="layer 0 needs"):
        verify(mx, max_memory="100M", **kw)
    with pytest.raises(BadInputError, match="add --stream"):
        verify(mx, source=COPY, fidelity=True, device="cuda")
    with pytest.raises(BadInputError, match="device must be cpu, cuda or cuda:N"):
        verify(mx, device="tpu", **kw)
    with pytest.raises(BadInputError, match="add --stream"):
        make_reference_base(COPY, tmp_path / "r.base", max_memory="2G")
    a, b = tmp_path / "a.base", tmp_path / "b.base"
    make_reference_base(COPY, a, stream=True)
    make_reference_base(COPY, b, stream=True, device="cpu", max_memory="2G")
    assert a.read_bytes() == b.read_bytes()


def test_reference_cli_refuses_a_device_without_stream(tmp_path):
    from click.testing import CliRunner

    from ds4quant.cli import cli

    res = CliRunner().invoke(cli, ["reference", str(COPY), "--device", "cuda", "--out", str(tmp_path / "x.base")])
    assert res.exit_code == 2 and "add --stream" in res.output
    assert not (tmp_path / "x.base").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_streamed_passes_on_the_gpu(mx):
    """Both sides' layers on the GPU (the candidate's experts on its CPU owner): the figures
    are the GPU's own numbers, close to the CPU run's, and the artifact still matches."""
    from ds4quant.verify import verify

    kw = dict(source=COPY, fidelity=True, mode="exact", stream=True)
    cpu = verify(mx, **kw).fidelity
    gpu = verify(mx, device="cuda", **kw).fidelity
    assert abs(gpu.kl.kld_mean - cpu.kl.kld_mean) < 0.01 and abs(gpu.kl.same_top1 - cpu.kl.same_top1) < 0.05


def test_a_large_evaluation_goes_in_bounded_batches(mx, monkeypatch):
    """Past ``BATCH_TOKENS`` padded tokens the evaluation runs in consecutive batches of
    at most that many, fixed by the sequences alone (so a base and its candidates get the
    same batches anywhere); the figures stay the one-batch run's up to float rounding."""
    import ds4quant.runtime.stream.model as model
    import ds4quant.runtime.stream_fidelity as sf
    from ds4quant.verify import verify

    assert sf.eval_batch([[1] * 10] * 4) == 4  # 40 tokens: one batch
    kw = dict(source=COPY, fidelity=True, mode="exact", stream=True)
    one = verify(mx, **kw).fidelity
    monkeypatch.setattr(sf, "BATCH_TOKENS", 25)
    assert sf.eval_batch([[1] * 10] * 4) == 2 and sf.eval_batch([[1] * 30] * 3) == 1
    shapes: list = []
    real = model.stream_forward

    def spy(sm, batches, **k):
        shapes.append([tuple(b.shape) for b in batches])
        return real(sm, batches, **k)

    monkeypatch.setattr(model, "stream_forward", spy)
    split = verify(mx, **kw).fidelity
    assert shapes and all(len(s) > 1 and all(r * w <= 25 or r == 1 for r, w in s) for s in shapes)
    assert split.kl.same_top1 == one.kl.same_top1 and abs(split.kl.kld_mean - one.kl.kld_mean) < 1e-6


def test_positions_in_any_order_come_back_in_that_order():
    """streamed_logits returns the logits in the order of ``positions``, also when they
    are not in row order across batches."""
    import torch

    from ds4quant.runtime.stream import SourceWeights, StreamedModel
    from ds4quant.runtime.stream_fidelity import streamed_logits

    seqs = [[0, 5, 9, 11], [0, 7, 3], [0, 4, 4, 8, 2]]
    pos = [(0, 1), (0, 2), (1, 1), (2, 0), (2, 3)]
    shuffled = [pos[i] for i in (3, 0, 4, 2, 1)]
    with SourceWeights(COPY) as w:
        sm = StreamedModel(w, threads=1)
        a = streamed_logits(sm, seqs, pos, 0, batch_size=2).logits
        b = streamed_logits(sm, seqs, shuffled, 0, batch_size=2).logits
    assert torch.equal(b, a[[3, 0, 4, 2, 1]])
