"""The calibrate stage's sensitivity pass: gains for every routed tensor, deterministic,
the model restored, and convert finding the file beside the imatrix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ds4quant.calib.sensitivity import read_sensitivity

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "ds4-tiny"
TOKENS = ROOT / "samples" / "tokens.txt"


@pytest.fixture(scope="module")
def tiny_calib(tmp_path_factory):
    pytest.importorskip("transformers")
    from ds4quant.calibrate import calibrate

    out = tmp_path_factory.mktemp("calib")
    rep = calibrate(SAMPLE, TOKENS, out, sensitivity_seqs=2)
    return rep, out


def test_calibrate_writes_gains_for_every_routed_tensor(tiny_calib):
    from ds4quant.sources import open_official_source

    rep, out = tiny_calib
    assert rep.files["sensitivity"] == "sensitivity.json"
    with open_official_source(SAMPLE, "test") as src:
        fp, n_layer = src.fingerprint(), src.config.num_hidden_layers
    s = read_sensitivity(out / "sensitivity.json", fingerprint=fp)
    assert set(s.gains) == {f"blk.{i}.ffn_{p}_exps.weight" for i in range(n_layer) for p in ("gate", "up", "down")}
    assert all(np.isfinite(g) and g > 0 for g in s.gains.values())
    assert s.sequences == 2 and rep.sha256["sensitivity.json"]


def test_sensitivity_is_deterministic(tiny_calib, tmp_path):
    from ds4quant.calibrate import calibrate

    _, out = tiny_calib
    calibrate(SAMPLE, TOKENS, tmp_path / "again", sensitivity_seqs=2)
    assert (tmp_path / "again" / "sensitivity.json").read_bytes() == (out / "sensitivity.json").read_bytes()
    # the imatrix does not depend on whether the sensitivity pass ran
    calibrate(SAMPLE, TOKENS, tmp_path / "none", sensitivity_seqs=0)
    assert not (tmp_path / "none" / "sensitivity.json").exists()
    assert (tmp_path / "none" / "imatrix.gguf").read_bytes() == (out / "imatrix.gguf").read_bytes()


def test_convert_uses_the_calibrate_runs_own_sensitivity_beside_the_imatrix(tiny_calib, tmp_path):
    """`calibrate --out C` then `convert --imatrix C/imatrix.gguf`: the adaptive recipe allocates
    by C/sensitivity.json unless told `--sensitivity none`; the same bytes as naming it."""
    from click.testing import CliRunner

    from ds4quant.cli import cli

    _, calib = tiny_calib
    base = ["--recipe", "adaptive", "--target-bpw", "2.8", "--imatrix", str(calib / "imatrix.gguf"),
            "--candidates", "rocmfp2,rocmfp3,rocmfp4", "--fit-effort", "1,0,64", "--threads", "1",
            "--cache-dir", str(tmp_path / "cache"), "--json"]
    runs = {}
    for name, extra in (("auto", []), ("named", ["--sensitivity", str(calib / "sensitivity.json")]),
                        ("none", ["--sensitivity", "none"])):
        r = CliRunner().invoke(cli, ["convert", str(SAMPLE), str(tmp_path / name), *base, *extra])
        assert r.exit_code == 0, r.output
        j = json.loads(r.output)
        runs[name] = (j["adaptive"], next((tmp_path / name).glob("*.gguf")).read_bytes())
    assert runs["auto"][0]["objective"].startswith("predicted KL")
    # recorded as a name, not the absolute path (artifact.portable: releases leak no paths)
    assert runs["auto"][0]["options"]["sensitivity"] == "sensitivity.json"
    assert runs["none"][0]["objective"] == "weighted error" and runs["none"][0]["options"]["sensitivity"] is None
    assert runs["auto"][1] == runs["named"][1]


class _Experts:
    """A layer's routed experts as the stream hands them out: one expert's float32 weights at a time."""

    def __init__(self, n: int, inter: int, hidden: int, device: str = "cpu"):
        import torch

        g = torch.Generator().manual_seed(7)
        self.num_experts = n
        # made on the host, then moved: CUDA divides by a scalar through its reciprocal, which
        # would give the device other weights than the host's
        self._w = [((torch.randn(2 * inter, hidden, generator=g) * (e + 1)).to(device),
                    (torch.randn(hidden, inter, generator=g) / (e + 1)).to(device)) for e in range(n)]

    def expert_weights(self, e: int):
        return self._w[e]


def _deltas(experts, layer: int = 3):
    from ds4quant.calibrate.experts import ExpertNoise
    from ds4quant.calibrate.sensitivity import REL_STD, scaled_noise

    return [(e, d) for e, _gu, _down, d, _terms in scaled_noise(ExpertNoise(), layer, experts, REL_STD)]


def test_scaled_noise_is_each_experts_own_seeded_draw_in_expert_order():
    """The draws made ahead on threads, scaled and weighed on a thread per
    surface, are, expert for expert, the serial draw of that (tensor, expert)
    times REL_STD x the matrix's RMS (numpy's), and its weighted error."""
    from ds4quant.calibrate.experts import ExpertNoise, rms, surface_rows
    from ds4quant.calibrate.sensitivity import REL_STD, scaled_noise, weighted_error
    from ds4quant.names import stack_name

    ex = _Experts(9, 32, 64)
    imp = {s: np.random.default_rng(2).random(32 if s == "down" else 64) for s in ("gate", "up", "down")}
    got = list(scaled_noise(ExpertNoise(), 3, ex, REL_STD, lambda s, e, d: weighted_error(e + 1.0, imp[s], d)))
    assert [g[0] for g in got] == list(range(9))
    for e, _gu, _down, d, terms in got:
        gu, down = ex.expert_weights(e)
        for s in ("gate", "up", "down"):
            w = down if s == "down" else gu[surface_rows(s, 32)]
            want = ExpertNoise().draw(stack_name(3, s), e, tuple(w.shape)).double().numpy() * (REL_STD * rms(w))
            assert isinstance(d[s], np.ndarray) and np.array_equal(d[s], want), (e, s)
            assert terms[s] == (e + 1.0) * float(np.sum((want * want) @ imp[s])), (e, s)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
def test_scaled_noise_on_a_gpu_is_the_cpus_up_to_the_rms_last_bits():
    """With the experts on a GPU the same draws are scaled there: each delta and
    each weighted-error term equals the CPU's to float64 rounding."""
    import torch

    from ds4quant.calibrate.sensitivity import weighted_error

    cpu, gpu = _Experts(5, 32, 64), _Experts(5, 32, 64, "cuda")
    rng = np.random.default_rng(1)
    imp = {s: rng.random(32 if s == "down" else 64) for s in ("gate", "up", "down")}
    for (e, dc), (e2, dg) in zip(_deltas(cpu), _deltas(gpu)):
        assert e == e2
        for s in ("gate", "up", "down"):
            assert isinstance(dg[s], torch.Tensor) and dg[s].device.type == "cuda" and dg[s].dtype == torch.float64
            np.testing.assert_allclose(dg[s].cpu().numpy(), dc[s], rtol=1e-13, atol=0)
            tc, tg = weighted_error(0.5 + e, imp[s], dc[s]), weighted_error(0.5 + e, imp[s], dg[s])
            assert abs(tg - tc) <= 1e-12 * tc, (e, s, tc, tg)
