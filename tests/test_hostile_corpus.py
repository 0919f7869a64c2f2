"""Every reader refuses every file of tests/data/hostile with its expected one-line
error, in bounded time and memory; the CLI turns each into exit 2. Plus
property-based fuzzing of every reader entry point."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4quant.artifact import FileEntry, GGUFWriter, Manifest, read_gguf_set, read_manifest, tensor_entries
from ds4quant.artifact import write_manifest
from ds4quant.artifact.sums import read_sums
from ds4quant.cli import cli
from ds4quant.codebooks import CodebookEntry, CodebookTable, write_table
from ds4quant.codebooks.dmix import DmixEntry, read_dmix, write_dmix
from ds4quant.codebooks.gumix import read_gumix, write_gumix
from ds4quant.codebooks.p4mix import read_p4mix, write_p4mix
from ds4quant.codebooks.routed import MixEntry
from ds4quant.codebooks.table import read_table
from ds4quant.errors import Ds4quantError
from ds4quant.calib.imatrix import make_imatrix, read_imatrix, write_imatrix_dat, write_imatrix_gguf
from ds4quant.inspect import inspect_artifact
from ds4quant.sources.official import open_source
from ds4quant.sources.safetensors_file import SafetensorsFile
from ds4quant.verify import verify
from tests.artifact.hostile import base

CORPUS = Path(__file__).resolve().parent / "data" / "hostile"
EXPECTED: dict = json.loads((CORPUS / "expected.json").read_text())
SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "ds4-tiny"
MAX_SECONDS = 2.0
MAX_PEAK_BYTES = 32 << 20


def _source(p: Path) -> None:
    open_source(p).close()


READERS = {
    "gguf": lambda p: read_gguf_set(p),
    "safetensors": lambda p: SafetensorsFile(p),
    "gumix": lambda p: read_gumix(p.read_bytes(), what=str(p)),
    "p4mix": lambda p: read_p4mix(p.read_bytes(), what=str(p)),
    "dmix": lambda p: read_dmix(p.read_bytes(), what=str(p)),
    "table": lambda p: read_table(p.read_bytes(), what=str(p)),
    "manifest": read_manifest,
    "sums": read_sums,
    "imatrix": read_imatrix,
    "source": _source,
}


def _bounded(fn, *args):
    """(exception or None, seconds, peak traced bytes) of fn(*args)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn(*args)
        err = None
    except Ds4quantError as e:
        err = e
    finally:
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return err, dt, peak


def test_corpus_is_large_varied_and_regenerates_byte_for_byte():
    kinds = {v["reader"] for v in EXPECTED.values()}
    assert len(EXPECTED) >= 100
    assert {"gguf", "safetensors", "gumix", "p4mix", "dmix", "table", "manifest", "source"} <= kinds
    for rel in EXPECTED:
        assert (CORPUS / rel).exists(), rel
    res = subprocess.run([sys.executable, str(CORPUS / "make_corpus.py"), "--check"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("rel", sorted(EXPECTED))
def test_reader_refuses_with_the_expected_one_line_error(rel):
    exp = EXPECTED[rel]
    err, dt, peak = _bounded(READERS[exp["reader"]], CORPUS / rel)
    assert err is not None, f"{rel} was accepted"
    assert type(err).__name__ == exp["error"], (rel, err.one_line())
    line = err.one_line()
    assert exp["message"] in line, (rel, line)
    assert "\n" not in line and str(err) == line
    assert dt < MAX_SECONDS, (rel, dt)
    assert peak < MAX_PEAK_BYTES, (rel, peak)


# ----------------------------------------------------------------------------
# the same files through the commands


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    """A small, readable artifact folder (one f32 tensor) to pair with hostile parts."""
    root = tmp_path_factory.mktemp("tiny")
    w = GGUFWriter(root / "m.gguf")
    w.add_string("general.architecture", "deepseek4")
    w.add_tensor("t", "f32", (8,), np.arange(8, dtype="<f4"))
    files = w.write()
    man = Manifest("0.1.0", ("ds4quant", "test"), {}, {}, (FileEntry.of(files[0]),),
                   tensor_entries(read_gguf_set(files[0])))
    write_manifest(root / "manifest.json", man)
    return root


def _one_line_exit_2(res):
    assert res.exit_code == 2, res.output
    out = res.output.strip()
    assert "\n" not in out and out.startswith("ds4quant: error:") and "Traceback" not in out, out


def _entries(*readers):
    return sorted(k for k, v in EXPECTED.items() if v["reader"] in readers)


@pytest.mark.parametrize("rel", _entries("gguf"))
def test_inspect_and_verify_exit_2_on_every_hostile_gguf(rel):
    runner = CliRunner()
    for cmd in ("inspect", "verify"):
        res = runner.invoke(cli, [cmd, str(CORPUS / rel)])
        _one_line_exit_2(res)
        assert EXPECTED[rel]["message"] in res.output


def test_verify_and_inspect_exit_2_on_hostile_manifests_and_sums(tiny_artifact, tmp_path):
    import shutil

    runner = CliRunner()
    assert runner.invoke(cli, ["verify", str(tiny_artifact)]).exit_code == 1  # readable; DS4 keys missing
    for rel in _entries("manifest", "sums"):
        d = tmp_path / rel.replace("/", "_")
        shutil.copytree(tiny_artifact, d)
        kind = EXPECTED[rel]["reader"]
        (d / ("manifest.json" if kind == "manifest" else "SHA256SUMS")).write_bytes((CORPUS / rel).read_bytes())
        res = runner.invoke(cli, ["verify", str(d)])
        _one_line_exit_2(res)
        assert EXPECTED[rel]["message"] in res.output, rel
        if kind == "manifest":
            _one_line_exit_2(runner.invoke(cli, ["inspect", str(d)]))


def test_a_hostile_loose_sidecar_is_a_failed_check_of_a_readable_artifact(tiny_artifact, tmp_path):
    import shutil

    runner = CliRunner()
    for rel in _entries("gumix", "p4mix", "dmix"):
        d = tmp_path / rel.replace("/", "_")
        shutil.copytree(tiny_artifact, d)
        kind = EXPECTED[rel]["reader"]
        (d / f"m.gguf.{kind}.bin").write_bytes((CORPUS / rel).read_bytes())
        res = runner.invoke(cli, ["verify", str(d), "--json"])
        assert res.exit_code == 1, res.output
        bad = [c for c in json.loads(res.output)["checks"] if c["name"] == "codebooks" and not c["ok"]]
        assert any(c["file"] == f"m.gguf.{kind}.bin" and EXPECTED[rel]["message"] in c["detail"] for c in bad), rel


@pytest.mark.parametrize("rel", _entries("source"))
def test_convert_and_verify_exit_2_on_every_hostile_source(rel, tiny_artifact, tmp_path):
    runner = CliRunner()
    out = tmp_path / "out"
    res = runner.invoke(cli, ["convert", str(CORPUS / rel), str(out)])
    _one_line_exit_2(res)
    assert EXPECTED[rel]["message"] in res.output
    assert not out.exists()
    _one_line_exit_2(runner.invoke(cli, ["verify", str(tiny_artifact), "--source", str(CORPUS / rel)]))


def test_verify_exit_2_on_hostile_imatrix(tiny_artifact):
    runner = CliRunner()
    for rel in _entries("imatrix"):
        res = runner.invoke(cli, ["verify", str(tiny_artifact), "--source", str(SAMPLE), "--imatrix",
                                  str(CORPUS / rel)])
        _one_line_exit_2(res)
        assert EXPECTED[rel]["message"] in res.output, rel


# ----------------------------------------------------------------------------
# property-based fuzzing of every reader entry point


def _seeds() -> dict:
    books4 = np.array([[-1, -0.25, 0.25, 1], [-0.5, -0.125, 0.125, 0.5]], np.float32)
    books8 = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8).repeat(2, 0)
    books8 = np.round(books8 * 8) / 8
    gum = write_gumix([MixEntry(0, 0, 4, 128, np.ones(2, np.uint8), np.stack([books4, books4])),
                       MixEntry(0, 1, 4, 128, np.ones(1, np.uint8), books4[None])])
    p4 = write_p4mix([MixEntry(1, 2, 4, 32, np.array([1, 0], np.uint8), np.stack([books8, books8]))])
    dm = write_dmix([DmixEntry(0, 1, 106, 2, 1, books4)])
    tb = write_table(CodebookTable((
        CodebookEntry("blk.0.ffn_gate_exps.rocmfp2_mix.weight", "rocmfp2_mix", [1, 1], np.stack([books4, books4]),
                      (1, 5), 8),
        CodebookEntry("blk.1.ffn_down_exps.weight", "rocmfp3_mix", [1], books8[None]))))
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "I8", "shape": [2, 2], "data_offsets": [8, 12]}, "__metadata__": {"k": "v"}}
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    safet = struct.pack("<Q", len(hb)) + hb + bytes(12)
    man = json.dumps({"schema_version": 1, "tool": "ds4quant", "tool_version": "0.1.0", "command": ["x"],
                      "source": {}, "recipe": {}, "files": [{"name": "m.gguf", "bytes": 1, "sha256": "a" * 64}],
                      "tensors": [{"name": "t", "qtype": "f32", "variant": "f32", "ggml_type": 0, "shape": [8],
                                   "bytes": 32, "sha256": "b" * 64, "errors": {"sse": 0.5}}]}, indent=2).encode()
    with tempfile.TemporaryDirectory() as tmp:
        im = make_imatrix({"blk.0.ffn_down_exps.weight": (np.ones((2, 32), np.float32), np.array([3.0, 4.0])),
                           "blk.0.attn_kv.weight": (np.full(32, 2.0, np.float32), 5.0)})
        write_imatrix_gguf(Path(tmp) / "i.gguf", im)
        im_gguf = (Path(tmp) / "i.gguf").read_bytes()
        write_imatrix_dat(Path(tmp) / "i.dat", make_imatrix({"t": (np.full(32, 2.0, np.float32), 5.0)}))
        im_dat = (Path(tmp) / "i.dat").read_bytes()
    sums = ("a" * 64 + "  m.gguf\n" + "b" * 64 + "  report/x.png\n").encode()
    return {"gguf": base().build(), "safetensors": safet, "gumix": gum, "p4mix": p4, "dmix": dm, "table": tb,
            "manifest": man, "imatrix_gguf": im_gguf, "imatrix_dat": im_dat, "sums": sums}


SEEDS = _seeds()
FILE_READERS = {"gguf": READERS["gguf"], "safetensors": READERS["safetensors"], "manifest": read_manifest,
                "imatrix_gguf": read_imatrix, "imatrix_dat": read_imatrix, "sums": read_sums}
BYTE_READERS = {"gumix": read_gumix, "p4mix": read_p4mix, "dmix": read_dmix, "table": read_table}


@st.composite
def mutations(draw, seed: bytes):
    """A valid file with a few edits: bit flips, byte stores, u32/u64 stores of
    edge values, cuts, insertions, duplicated slices."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "byte", "word", "cut", "insert", "dup")))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "word":
            width = draw(st.sampled_from((4, 8)))
            v = draw(st.sampled_from((0, 1, 2, 0x7F, 0x80, 0xFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**63,
                                      2**64 - 1)))
            data[pos:pos + width] = (v % (1 << (8 * width))).to_bytes(width, "little")
        elif op == "cut":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "dup":
            n = draw(st.integers(1, 64))
            data[pos:pos] = data[pos:pos + n]
    return bytes(data)


def _check(reader, arg) -> None:
    try:
        reader(arg)
    except Ds4quantError as e:
        assert "\n" not in e.one_line()


_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@pytest.mark.parametrize("kind", sorted(FILE_READERS))
def test_fuzz_file_readers(kind, tmp_path):
    path = tmp_path / ("f.gguf" if kind in ("gguf", "imatrix_gguf") else "f.bin")

    @_FUZZ
    @given(data=st.one_of(mutations(SEEDS[kind]), st.binary(max_size=256)))
    def run(data):
        path.write_bytes(data)
        _check(FILE_READERS[kind], path)

    run()


@pytest.mark.parametrize("kind", sorted(BYTE_READERS))
def test_fuzz_codebook_readers(kind):
    @_FUZZ
    @given(data=st.one_of(mutations(SEEDS[kind]), st.binary(max_size=256)))
    def run(data):
        _check(BYTE_READERS[kind], data)

    run()


def test_fuzz_seeds_are_valid(tmp_path):
    # the mutations start from files every reader accepts
    for kind, reader in FILE_READERS.items():
        p = tmp_path / (kind + (".gguf" if "gguf" in kind else ".bin"))
        p.write_bytes(SEEDS[kind])
        reader(p)
    for kind, reader in BYTE_READERS.items():
        reader(SEEDS[kind])


def test_fuzz_inspect_and_verify_on_mutated_artifacts(tiny_artifact, tmp_path):
    import shutil

    d = tmp_path / "a"
    shutil.copytree(tiny_artifact, d)
    seed = (d / "m.gguf").read_bytes()

    @_FUZZ
    @given(data=mutations(seed))
    def run(data):
        (d / "m.gguf").write_bytes(data)
        for fn in (inspect_artifact, verify):
            _check(fn, d)

    run()
