"""runtime.load trusts no byte it has not checked: one flipped byte in each kind
of resident tensor (expert stacks, router, router bias, hash table, shared
expert) and in each codebook table (own table, embedded and loose Lucebox
blobs, both copies at once) is refused in one line naming it; the opt-out
loads unchecked; a placement for another artifact is refused by the same
check ``place --check`` uses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4quant import runtime
from ds4quant.artifact.view import open_artifact
from ds4quant.cli import cli
from ds4quant.convert import convert
from ds4quant.errors import BadInputError, Ds4quantError, IntegrityError
from ds4quant.runtime.integrity import check_payloads
from ds4quant.runtime.placement import Placement, write_placement

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "ds4-tiny"
E = 16
OWNER = {L: {"torch-cpu:0": tuple(range(E))} for L in range(4)}


@pytest.fixture(scope="module")
def mix_art(tmp_path_factory):
    """Every expert stack MIX, so the artifact carries every kind of codebook table."""
    out = tmp_path_factory.mktemp("integrity") / "mix"
    convert(SAMPLE, out, "rocmfp2-strix", threads=1,
            tensor_types=[r"ffn_(gate|up)_exps=rocmfp2_mix", r"ffn_down_exps=rocmfp3_mix"])
    return out


def _copy(art: Path, tmp: Path) -> Path:
    dst = tmp / "art"
    shutil.copytree(art, dst)
    return dst


def _gguf(art: Path) -> Path:
    return next(art.glob("*.gguf"))


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _tensor_offset(art: Path, name: str) -> int:
    with open_artifact(art) as v:
        info = v.tensor(name)
        return info.offset + info.nbytes // 2


def _blob_offset(art: Path, key: str) -> int:
    with open_artifact(art) as v:
        blob = v.gguf.blob(key)
    raw = _gguf(art).read_bytes()
    at = raw.find(blob)
    assert at > 0 and raw.find(blob, at + 1) < 0
    return at + len(blob) // 2


RESIDENT = ["blk.2.ffn_gate_exps.weight", "blk.2.ffn_up_exps.weight", "blk.2.ffn_down_exps.weight",
            "blk.2.ffn_gate_inp.weight", "blk.2.exp_probs_b.bias", "blk.0.ffn_gate_tid2eid.weight",
            "blk.3.ffn_gate_shexp.weight", "blk.3.ffn_up_shexp.weight", "blk.3.ffn_down_shexp.weight"]


def test_intact_artifact_loads_and_runs(mix_art):
    with runtime.load(mix_art, placement=OWNER) as rt:
        assert rt.resident_bytes()["torch-cpu:0"] > 0


@pytest.mark.parametrize("tensor", RESIDENT)
def test_a_flipped_byte_in_a_resident_tensor_is_refused_naming_it(mix_art, tmp_path, tensor):
    art = _copy(mix_art, tmp_path)
    _flip(_gguf(art), _tensor_offset(art, tensor))
    with pytest.raises(IntegrityError) as ei:
        runtime.load(art, placement=OWNER)
    msg = ei.value.one_line()
    assert tensor in msg and "\n" not in msg
    # the opt-out loads it (the user says they checked the folder)
    with runtime.load(art, placement=OWNER, verify_payloads=False):
        pass


@pytest.mark.parametrize("keys", [("ds4quant.codebooks",), ("deepseek4.p4mix.sidecar",),
                                  ("deepseek4.gumix.sidecar",),
                                  ("ds4quant.codebooks", "deepseek4.p4mix.sidecar"),
                                  ("ds4quant.codebooks", "deepseek4.gumix.sidecar")])
def test_a_flipped_byte_in_an_embedded_codebook_table_is_refused_naming_it(mix_art, tmp_path, keys):
    art = _copy(mix_art, tmp_path)
    for key in keys:
        _flip(_gguf(art), _blob_offset(art, key))
    with pytest.raises(Ds4quantError) as ei:
        runtime.load(art, placement=OWNER)
    msg = ei.value.one_line()
    assert all(k in msg for k in keys), msg


@pytest.mark.parametrize("kind", ["p4mix", "gumix"])
def test_a_flipped_byte_in_a_loose_codebook_file_is_refused_naming_it(mix_art, tmp_path, kind):
    art = _copy(mix_art, tmp_path)
    side = next(art.glob(f"*.gguf.{kind}.bin"))
    _flip(side, side.stat().st_size // 2)
    with pytest.raises(IntegrityError, match=side.name.replace(".", r"\.")):
        runtime.load(art, placement=OWNER)


def test_hashing_threads_agree_and_a_bare_gguf_needs_the_opt_out(mix_art, tmp_path):
    with open_artifact(mix_art) as v:
        check_payloads(v, threads=1)
        check_payloads(v, threads=4)
    lone = tmp_path / "lone.gguf"
    shutil.copy(_gguf(mix_art), lone)
    with pytest.raises(IntegrityError, match="verify_payloads=False"):
        runtime.load(lone, placement=OWNER)
    with runtime.load(lone, placement=OWNER, verify_payloads=False):
        pass
    # a .gguf named inside its folder is still vouched for by the folder's manifest
    art = _copy(mix_art, tmp_path)
    _flip(_gguf(art), _tensor_offset(art, RESIDENT[0]))
    with pytest.raises(IntegrityError, match=RESIDENT[0].replace(".", r"\.")):
        runtime.load(_gguf(art), placement=OWNER)


# --------------------------------------------------------------------------
# one placement check for place --check and runtime.load


def _foreign(tmp: Path, n_layer: int = 4, artifact: str = "sha256:" + "f" * 64) -> Path:
    p = Placement.build(n_layer, E, 4, ["torch-cpu:0"], [[list(range(E))] for _ in range(n_layer)],
                        artifact=artifact)
    return write_placement(tmp / f"p{n_layer}.json", p)


@pytest.mark.parametrize("case", ["other artifact", "more layers"])
def test_a_foreign_placement_is_refused_by_load_and_by_place_check(mix_art, tmp_path, case):
    f = _foreign(tmp_path) if case == "other artifact" else _foreign(tmp_path, n_layer=6, artifact=None)
    with pytest.raises((IntegrityError, BadInputError)) as by_load:
        runtime.load(mix_art, placement=f, verify_payloads=False)
    res = CliRunner().invoke(cli, ["place", str(mix_art), "--routing",
                                   str(ROOT / "samples" / "ds4-tiny-calib" / "routing.csv"), "--check", str(f)])
    assert res.exit_code == 2 and by_load.value.one_line() in res.output, res.output


def _damaged_run(mix_art: Path, tmp_path: Path) -> list[str]:
    """``ds4quant run`` arguments for a copy of ``mix_art`` with a flipped router byte."""
    from ds4quant.calib.routing import read_routing
    from ds4quant.runtime.planning import plan_ranks

    art = _copy(mix_art, tmp_path)
    with open_artifact(art) as v:
        fp = v.fingerprint()
    plc = write_placement(tmp_path / "c2.json", plan_ranks(
        read_routing(ROOT / "samples" / "ds4-tiny-calib" / "routing.csv"), 2, "uniform", 0, owner="torch-cpu:0",
        artifact=fp))
    _flip(_gguf(art), _tensor_offset(art, RESIDENT[3]))
    return ["run", str(art), "--ranks", "2", "--placement", str(plc)]


def test_ds4quant_run_refuses_a_damaged_artifact_in_one_line_before_any_rank_starts(mix_art, tmp_path):
    res = CliRunner().invoke(cli, _damaged_run(mix_art, tmp_path))
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    last = res.output.strip().splitlines()
    assert len(last) == 1 and RESIDENT[3] in last[0], res.output


def test_the_payload_check_reports_each_file_it_hashes(mix_art):
    from ds4quant.progress import EventKind

    events = []
    with runtime.load(mix_art, progress=events.append) as rt:
        assert rt is not None
    steps = [e for e in events if e.kind is EventKind.STEP]
    with open_artifact(mix_art) as v:
        n_files = len(v.gguf.splits) + len(list(Path(mix_art).glob("*.bin")))
    assert {e.stage for e in events} == {"payload check"}
    assert len(steps) == steps[-1].total >= len(v.gguf.splits) and n_files >= len(v.gguf.splits)
    assert sum(e.detail["bytes"] for e in steps) > 0
    assert events[-1].kind is EventKind.DONE


def test_ds4quant_run_shows_the_payload_check_on_a_terminal_and_nothing_under_json(mix_art, tmp_path, monkeypatch):
    from ds4quant.cli import output

    args = _damaged_run(mix_art, tmp_path)  # refused after the check, before any rank starts
    with open_artifact(Path(args[1])) as v:
        n = len(v.gguf.splits) + len(list(Path(args[1]).glob("*.bin")))
    monkeypatch.setattr(output, "stderr_is_tty", lambda: True)
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    err = res.stderr.splitlines()
    steps = [ln for ln in err if ln.startswith("[payload check ")]
    assert len(steps) == n and steps[-1].startswith(f"[payload check {n}/{n} file]"), err
    assert all("ETA" in ln for ln in steps), err
    assert "[payload check] done" in res.stderr and RESIDENT[3] in err[-1]
    res = CliRunner().invoke(cli, [*args, "--json"])
    assert res.exit_code == 2 and "payload check" not in res.output, res.output
