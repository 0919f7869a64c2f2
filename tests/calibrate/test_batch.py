"""calibrate --batch-size: sequences run through each layer together (same
length only; the sensitivity sequences, and their branches, among themselves). The statistics are the batch-1 run's
up to float rounding, every token counts once, the batch is recorded, and a
resumed run keeps it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from ds4quant.calib.imatrix import read_imatrix  # noqa: E402
from ds4quant.calib.sensitivity import read_sensitivity  # noqa: E402
from ds4quant.calibrate import calibrate  # noqa: E402
from ds4quant.calibrate.model import pick_batch  # noqa: E402
from ds4quant.calibrate.walk import batch_groups  # noqa: E402
from ds4quant.cli import cli  # noqa: E402
from ds4quant.errors import BudgetError, ResumeMismatchError  # noqa: E402
from tests.calibrate.interrupt import Stop, stop_after  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "ds4-tiny"
WORK = ".ds4quant-work"
LENGTHS = (40, 40, 40, 23, 40, 40, 40)


def test_groups_keep_the_sensitivity_sequences_apart_and_never_pad():
    assert batch_groups([5, 5, 5, 5, 5], 2, 8) == [(0, 1), (2, 3, 4)]
    assert batch_groups([5] * 7, 0, 3) == [(0, 1, 2), (3, 4, 5), (6,)]
    assert batch_groups([5] * 7, 4, 3) == [(0, 1, 2), (3,), (4, 5, 6)]
    # a length change ends a batch: no row is padding
    assert batch_groups([5, 5, 4, 4, 4, 5], 0, 8) == [(0, 1), (2, 3, 4), (5,)]
    assert batch_groups([5, 5, 5], 1, 1) == [(0,), (1,), (2,)]
    assert batch_groups([5, 5], 4, 8) == [(0, 1)]
    for lens, split, b in (([3, 3, 2, 3, 3, 3], 1, 2), ([1] * 9, 2, 4), ([2] * 10, 5, 3)):
        g = batch_groups(lens, split, b)
        assert [i for grp in g for i in grp] == list(range(len(lens)))
        assert all(len(grp) <= b and len({lens[i] for i in grp}) == 1 for grp in g)
        assert all(len({i < split for i in grp}) == 1 for grp in g)


class _Plan:
    def __init__(self, devices, cache):
        self.layer_devices, self.gpu_expert_cache = devices, cache


def test_the_gpu_batch_is_the_largest_that_moves_nothing():
    def plan_for(fits, cpu_from=None, evict_from=None):
        def f(b):
            if b > fits:
                raise BudgetError("too big")
            devices = ("cuda:0", "cpu" if cpu_from and b >= cpu_from else "cuda:0")
            return _Plan(devices, 5 if evict_from and b >= evict_from else None)
        return f

    assert pick_batch(plan_for(8))[0] == 8
    assert pick_batch(plan_for(5))[0] == 4  # 8 is over the budget
    assert pick_batch(plan_for(8, cpu_from=4))[0] == 2  # 4 and 8 push a layer to the CPU
    assert pick_batch(plan_for(8, evict_from=2))[0] == 1  # any batch evicts decoded experts
    assert pick_batch(plan_for(1))[0] == 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    vocab = json.loads((SAMPLE / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(5)
    toks = d / "tokens.txt"
    toks.write_text("\n".join(" ".join(map(str, [0] + rng.integers(3, vocab, n - 1).tolist())) for n in LENGTHS)
                    + "\n")
    one = calibrate(SAMPLE, toks, d / "b1", sensitivity_seqs=3)
    three = calibrate(SAMPLE, toks, d / "b3", sensitivity_seqs=3, batch_size=3)
    return d, toks, one, three


def test_batched_statistics_are_batch_ones_up_to_rounding(runs):
    d, _toks, one, three = runs
    assert one.batch == 1 and three.batch == 3
    rep = json.loads((d / "b3" / "report.json").read_text())
    assert rep["model"]["batch"] == 3 and rep["tokens"]["tokens"] == sum(LENGTHS)
    # routing: the same slots per expert (every token counted once, none twice)
    assert (d / "b1" / "routing.csv").read_bytes() == (d / "b3" / "routing.csv").read_bytes()
    a, b = read_imatrix(d / "b1" / "imatrix.gguf"), read_imatrix(d / "b3" / "imatrix.gguf")
    assert set(a.entries) == set(b.entries)
    for name, ea in a.entries.items():
        eb = b.entries[name]
        assert np.array_equal(np.asarray(ea.counts), np.asarray(eb.counts)), name
        va, vb = np.asarray(ea.values, np.float64), np.asarray(eb.values, np.float64)
        assert np.abs(va - vb).max() <= 1e-5 * np.abs(va).max(), name
    sa, sb = read_sensitivity(d / "b1" / "sensitivity.json"), read_sensitivity(d / "b3" / "sensitivity.json")
    assert set(sa.gains) == set(sb.gains)
    for k, g in sa.gains.items():
        assert abs(sb.gains[k] - g) <= 1e-4 * abs(g), k


def test_a_batched_run_is_deterministic(runs, tmp_path):
    d, toks, _one, _three = runs
    calibrate(SAMPLE, toks, tmp_path / "again", sensitivity_seqs=3, batch_size=3)
    for f in ("imatrix.gguf", "imatrix.lucebox.dat", "routing.csv", "routing.json", "sensitivity.json"):
        assert (tmp_path / "again" / f).read_bytes() == (d / "b3" / f).read_bytes(), f


def test_a_resumed_batched_run_keeps_its_batch_and_bytes(runs, tmp_path):
    d, toks, _one, _three = runs
    out = tmp_path / "r"
    with pytest.raises(Stop):
        calibrate(SAMPLE, toks, out, sensitivity_seqs=3, batch_size=3, progress=stop_after(1))
    assert json.loads((out / WORK / "journal.json").read_text())["options"]["batch"] == 3
    # another batch would give other bits: refused, naming it
    res = CliRunner().invoke(cli, ["calibrate", str(SAMPLE), "--tokens", str(toks), "--out", str(out),
                                   "--sensitivity-seqs", "3", "--batch-size", "2", "--resume"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "--batch-size: journal 3, this run 2" in lines[0], res.output
    with pytest.raises(ResumeMismatchError, match="--batch-size"):
        calibrate(SAMPLE, toks, out, sensitivity_seqs=3, batch_size=1, resume=True)
    # without --batch-size the journal's batch is kept
    rep = calibrate(SAMPLE, toks, out, sensitivity_seqs=3, resume=True)
    assert rep.batch == 3 and rep.resumed_at == 2
    for f in ("imatrix.gguf", "imatrix.lucebox.dat", "routing.csv", "routing.json", "sensitivity.json"):
        assert (out / f).read_bytes() == (d / "b3" / f).read_bytes(), f


def test_a_bad_batch_size_is_refused(runs, tmp_path):
    _d, toks, _one, _three = runs
    res = CliRunner().invoke(cli, ["calibrate", str(SAMPLE), "--tokens", str(toks), "--out", str(tmp_path / "x"),
                                   "--batch-size", "0"])
    assert res.exit_code == 2 and "--batch-size" in res.output
    from ds4quant.errors import BadInputError

    with pytest.raises(BadInputError, match="batch size must be an int >= 1"):
        calibrate(SAMPLE, toks, tmp_path / "y", batch_size=True)
    assert not (tmp_path / "y").exists()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_the_default_batch_is_taken_and_agrees_with_batch_one(runs, tmp_path):
    """On a GPU calibrate batches by default (as many as fit, up to 8; here the
    sensitivity group of 3 and the runs of one length after it): every token
    counted once, and the statistics those of batch 1 on the same GPU up to
    float rounding."""
    d, toks, _one, _three = runs
    auto = calibrate(SAMPLE, toks, tmp_path / "auto", sensitivity_seqs=3, device="cuda")
    one = calibrate(SAMPLE, toks, tmp_path / "one", sensitivity_seqs=3, device="cuda", batch_size=1)
    from ds4quant.calib.routing import read_routing_json

    assert auto.batch == 8 and one.batch == 1
    # every token fills its k slots in every layer; a routing near-tie may flip in the last bits
    ra, rb = (read_routing_json(tmp_path / r / "routing.json").counts.astype(np.int64) for r in ("one", "auto"))
    assert np.array_equal(ra.sum(axis=1), rb.sum(axis=1)) and np.abs(ra - rb).sum() <= 0.01 * ra.sum()
    a, b = read_imatrix(tmp_path / "one" / "imatrix.gguf"), read_imatrix(tmp_path / "auto" / "imatrix.gguf")
    for name, ea in a.entries.items():
        if not np.array_equal(np.asarray(ea.counts), np.asarray(b.entries[name].counts)):
            continue  # a flipped near-tie moved a row: not comparable
        va, vb = np.asarray(ea.values, np.float64), np.asarray(b.entries[name].values, np.float64)
        assert np.abs(va - vb).max() <= 1e-2 * np.abs(va).max(), name
    sa = read_sensitivity(tmp_path / "one" / "sensitivity.json")
    sb = read_sensitivity(tmp_path / "auto" / "sensitivity.json")
    for k, g in sa.gains.items():
        assert abs(sb.gains[k] - g) <= 1e-2 * abs(g), k
