"""runtime.load refuses in one line (a Ds4quantError, exit 2 from the CLI) what
used to end in a traceback: expert stacks and model keys that disagree
(IndexError / KeyError before), a cuda:N / hip:N owner on a torch that cannot
run it (AssertionError from torch's lazy init before)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant import names, runtime  # noqa: E402
from ds4quant.artifact import GGUFWriter, read_gguf_set  # noqa: E402
from ds4quant.artifact.view import open_artifact  # noqa: E402
from ds4quant.convert import convert  # noqa: E402
from ds4quant.errors import BadInputError, Ds4quantError  # noqa: E402
from ds4quant.runtime.owners.kinds import check_device, make_owner  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "ds4-tiny"


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    out = tmp_path_factory.mktemp("refusals") / "strix"
    convert(SAMPLE, out, "rocmfp2-strix", threads=1)
    return out


def _rekeyed(art: Path, out: Path, key: str, value: int) -> Path:
    """The artifact's GGUF with one model key changed (tensors untouched)."""
    src = read_gguf_set(next(art.glob("*.gguf")))
    out.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(out / "x.gguf")
    for k, kv in src.kv.items():
        if k in ("general.alignment", "ds4quant.format_version", "ds4quant.qtype_variants") \
                or k.startswith(("split.", "ds4quant.qtype.")):
            continue
        w.add_kv(k, value if k == key else kv.value, kv.type, kv.sub_type)
    for n, t in src.tensors.items():
        w.add_tensor(n, t.qtype, t.shape, np.asarray(src.tensor_data(n)).tobytes())
    w.write()
    return out


@pytest.mark.parametrize("key,value,says", [
    (names.KEY_EXPERT_COUNT, 8, "expert_count = 8"),      # stacks hold experts the keys do not have
    (names.KEY_EXPERT_COUNT, 32, "in no stack"),          # keys name experts no stack holds
    (names.KEY_BLOCK_COUNT, 2, "block_count = 2"),        # stacks of layers the keys do not have
    (names.KEY_BLOCK_COUNT, 6, "no stack holds"),         # layers without stacks
])
def test_stacks_and_model_keys_that_disagree_are_one_line(art, tmp_path, key, value, says):
    bad = _rekeyed(art, tmp_path / "bad", key, value)
    with open_artifact(bad) as v:
        h = v.header
    # a placement sized from the keys, as a user planning for that header would write it
    plc = {L: {"torch-cpu:0": tuple(range(h.n_expert))} for L in range(h.n_layer)}
    for p in (plc, None):
        with pytest.raises(BadInputError) as ei:
            runtime.load(bad, placement=p, verify_payloads=False)
        msg = ei.value.one_line()
        assert says in msg and "\n" not in msg and "blk." in msg, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a torch without a GPU")
@pytest.mark.parametrize("owner", ["cuda:0", "hip:0", "cuda:3"])
def test_a_gpu_owner_on_a_cpu_only_torch_is_one_line(art, owner):
    with pytest.raises(BadInputError, match=f"owner {owner}"):
        check_device(owner)
    with pytest.raises(BadInputError, match=f"owner {owner}"):
        make_owner(owner, swiglu_limit=10.0)
    E = 16
    with pytest.raises(Ds4quantError) as ei:
        runtime.load(art, placement={L: {owner: tuple(range(E))} for L in range(4)})
    assert f"owner {owner}" in ei.value.one_line()


def test_verify_fidelity_says_the_same_in_one_line_exit_2(art, tmp_path):
    from click.testing import CliRunner

    from ds4quant.cli import cli
    from ds4quant.runtime.placement import Placement, write_placement

    bad = _rekeyed(art, tmp_path / "bad", names.KEY_EXPERT_COUNT, 8)
    res = CliRunner().invoke(cli, ["verify", str(bad / "x.gguf"), "--source", str(SAMPLE), "--fidelity"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "expert_count = 8" in res.output.strip().splitlines()[-1]
    if torch.cuda.is_available():
        return
    with open_artifact(art) as v:
        fp = v.fingerprint()
    plc = write_placement(tmp_path / "cuda.json", Placement.build(4, 16, 4, ["cuda:0"], [[list(range(16))]] * 4,
                                                                  artifact=fp))
    res = CliRunner().invoke(cli, ["verify", str(art), "--source", str(SAMPLE), "--fidelity", "--placement", str(plc)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "owner cuda:0" in res.output.strip().splitlines()[-1]
