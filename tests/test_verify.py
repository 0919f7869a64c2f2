"""`ds4quant verify`: structure checks, flipped-byte detection, numbers vs source, reports."""

from __future__ import annotations

import json
import math
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFValueType as VT

from ds4quant import formats
from ds4quant.artifact import read_gguf_set, read_manifest
from ds4quant.cli import cli
from ds4quant.codebooks import read_table, write_table
from ds4quant.errors import BadInputError, CorruptDataError, Ds4quantError
from ds4quant.publish.report import PLOT_BITS, PLOT_ERROR, PLOT_HIST, RUNTIME_BEGIN, RUNTIME_END, check_report_dir, write_report
from ds4quant.sources.official import open_source
from ds4quant.verify import QUALITY_FLOORS_DB, verify
from tests._verify_util import MIX_IDS, SAMPLE, flip, gguf_of, mix_artifact, rewrite, strix_artifact


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    strix = strix_artifact(root / "strix")
    mix = mix_artifact(strix, root / "mix", loose_gumix=True)
    return strix, mix


@pytest.fixture(scope="module")
def mix_numbers(arts):
    return verify(arts[1], source=SAMPLE)


def _failed(rep, name=None):
    return [c for c in rep.failed if name is None or c.name == name]


def test_uniform_artifact_is_sound_and_figures_match_convert(arts):
    strix, _ = arts
    rep = verify(strix, source=SAMPLE)
    assert rep.ok, [c.one_line() for c in rep.failed]
    names = {c.name for c in rep.checks}
    assert {"types", "shapes", "ds4_keys", "experts", "manifest.files", "manifest.tensors", "manifest.consistency",
            "source", "numbers.coverage", "numbers.finite", "numbers.floor", "numbers.manifest"} <= names
    assert rep.numbers_from == "source"
    # figures from decode agree with convert's own (manifest) figures
    man = {t.name: t for t in read_manifest(strix / "manifest.json").tensors}
    for t in rep.tensors:
        e = man[t.name].errors
        if e.get("ssx"):
            assert t.errors.ssx == pytest.approx(e["ssx"], rel=1e-9)
            assert t.errors.sse == pytest.approx(e["sse"], rel=1e-9, abs=1e-12)
    # every lossy tensor clears its floor by a margin: the floors catch breakage, not noise
    for t in rep.tensors:
        if t.errors.sse > 0:
            assert t.errors.sqnr_db > QUALITY_FLOORS_DB[t.qtype] + 3, t.name
            assert 0.9 < t.errors.cosine < 1 and t.errors.max_abs > 0
        else:
            assert t.errors.exact and t.errors.cosine == pytest.approx(1.0)
    s = rep.summary
    assert s["bpw_experts"] == pytest.approx((2 * 2.5 + 3.5) / 3)
    assert 9 < s["expert_sqnr_db"] < 11
    # per (layer, surface) groups: 4 layers x 3 expert surfaces, each one qtype
    exp = [g for g in rep.groups if g.surface.endswith("_exps")]
    assert len(exp) == 12 and all(len(g.qtypes) == 1 for g in exp)
    # an expert stack lists one SQNR per expert
    t = next(t for t in rep.tensors if t.name == "blk.2.ffn_down_exps.weight")
    assert len(t.errors.expert_sqnr_db) == 16


def test_expert_figures_are_the_decode_error_computed_by_hand(arts):
    strix, _ = arts
    rep = verify(strix, source=SAMPLE)
    t = next(t for t in rep.tensors if t.name == "blk.1.ffn_up_exps.weight")
    g = read_gguf_set(gguf_of(strix))
    raw = np.asarray(g.tensor_data(t.name))
    per = raw.size // 16
    with open_source(SAMPLE) as src:
        x = src.read_dequantized("layers.1.ffn.experts.5.w3.weight").astype(np.float64)
        y = formats.decode("rocmfp2", raw[5 * per:6 * per], 256).astype(np.float64)
    want = 10 * math.log10(np.sum(x * x) / np.sum((x - y) ** 2))
    assert t.errors.expert_sqnr_db[5] == pytest.approx(want, rel=1e-12)


def test_adaptive_artifact_with_compact_stacks_and_lucebox_blobs_is_sound(arts, mix_numbers):
    _, mix = arts
    rep = mix_numbers
    assert rep.ok, [c.one_line() for c in rep.failed]
    assert set(rep.codebook_tables) >= {"ds4quant.codebooks", "KV deepseek4.p4mix.sidecar",
                                        "KV deepseek4.gumix.sidecar"}
    by = {t.name: t for t in rep.tensors}
    mixc = by["blk.3.ffn_gate_exps.rocmfp2_mix.weight"]
    assert mixc.expert_ids == MIX_IDS and mixc.surface == "gate_exps" and mixc.layer == 3
    # the compact MIX stack decodes with its per-expert books, local row i = global expert MIX_IDS[i]
    g = read_gguf_set(gguf_of(mix))
    entry = read_table(g.blob("ds4quant.codebooks"))["blk.3.ffn_gate_exps.rocmfp2_mix.weight"]
    raw = np.asarray(g.tensor_data(mixc.name))
    per = raw.size // len(MIX_IDS)
    with open_source(SAMPLE) as src:
        x = src.read_dequantized(f"layers.3.ffn.experts.{MIX_IDS[2]}.w1.weight").astype(np.float64)
    y = formats.decode("rocmfp2_mix", raw[2 * per:3 * per], 256, entry.books[2], int(entry.modes[2]))
    want = 10 * math.log10(np.sum(x * x) / np.sum((x - y) ** 2))
    assert mixc.errors.expert_sqnr_db[2] == pytest.approx(want, rel=1e-12)
    # a mode-0 expert decodes with the fixed levels: exactly the rocmfp2 expert of the uniform artifact
    strix_rep = verify(arts[0], source=SAMPLE)
    uni = next(t for t in strix_rep.tensors if t.name == "blk.1.ffn_gate_exps.weight")
    assert by["blk.1.ffn_gate_exps.weight"].errors.expert_sqnr_db[3] == uni.errors.expert_sqnr_db[3]
    assert by["blk.1.ffn_gate_exps.weight"].errors.expert_sqnr_db[4] != uni.errors.expert_sqnr_db[4]
    assert by["blk.2.ffn_down_exps.weight"].qtype == "rocmfp3_mix"
    assert by["blk.2.ffn_down_exps.weight"].errors.sqnr_db > by["blk.1.ffn_down_exps.weight"].errors.sqnr_db
    # the group of layer 3 gate holds both qtypes, by weights
    grp = next(x for x in rep.groups if (x.layer, x.surface) == (3, "gate_exps"))
    assert dict(grp.qtypes) == {"rocmfp2_mix": 5 * 256 * 128, "rocmfp2": 11 * 256 * 128}


def test_json_output_is_one_object_and_exit_codes(arts, tmp_path):
    strix, _ = arts
    res = CliRunner().invoke(cli, ["verify", str(strix), "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output)
    assert set(obj) == {"ok", "checks", "tensors", "summary"} and obj["ok"] is True
    for c in obj["checks"]:
        assert set(c) == {"name", "ok", "detail", "file", "tensor"}
    assert obj["summary"]["numbers_from"] == "manifest"
    assert len(obj["tensors"]) == 126
    bad = rewrite(strix, tmp_path / "bad", manifest_edit=lambda o: o["tensors"][3].update(sha256="0" * 64))
    res = CliRunner().invoke(cli, ["verify", str(bad)])
    assert res.exit_code == 1
    assert "FAIL manifest.tensors" in res.output and "NOT SOUND" in res.output
    res = CliRunner().invoke(cli, ["verify", str(tmp_path / "nope")])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "Traceback" not in res.output


def test_bare_gguf_gets_structure_checks_only(arts):
    _, mix = arts
    rep = verify(gguf_of(mix))
    assert rep.ok and rep.kind == "gguf" and rep.manifest is None and rep.numbers_from is None
    assert not any(c.name.startswith("manifest") for c in rep.checks)
    assert any(c.name == "codebooks" and c.ok for c in rep.checks)


def _header_spans(path: Path):
    g = read_gguf_set(path)
    s = g.splits[0]
    return s, sorted((i.offset, i.offset + i.nbytes, n) for n, i in s.tensors.items())


def test_a_flipped_byte_anywhere_in_an_artifact_is_caught_and_named(arts, tmp_path):
    _, mix = arts
    art = tmp_path / "art"
    shutil.copytree(mix, art)
    gg = gguf_of(art)
    s, spans = _header_spans(gg)
    size = gg.stat().st_size
    g = read_gguf_set(gg)
    blob_at = bytes(np.fromfile(gg, np.uint8, count=s.data_offset)).find(b"DS4QCBT\x00")
    positions = [("header", p) for p in range(0, s.data_offset, max(1, s.data_offset // 60))]
    positions += [("codebooks", blob_at + d) for d in (0, 9, 40, 200)]
    rng = np.random.default_rng(5)
    for start, end, name in [spans[i] for i in rng.choice(len(spans), 30, replace=False)]:
        positions.append((name, int(rng.integers(start, end))))
    pads = [(end, start2) for (_, end, _), (start2, _, _) in zip(spans, spans[1:]) if start2 > end]
    positions += [("padding", a) for a, _ in pads[:4]]
    positions += [("padding", size - 1)] if spans[-1][1] < size else [(spans[-1][2], size - 1)]
    side = art / (gg.name + ".gumix.bin")
    positions += [("sidecar", p) for p in (0, 20, 100, side.stat().st_size - 1)]
    for what, pos in positions:
        target = side if what == "sidecar" else gg
        for mask in (0x01, 0x80):
            flip(target, pos, mask)
            try:
                try:
                    rep = verify(art)
                except Ds4quantError as e:  # the header no longer parses: unusable, and the file is named
                    assert what in ("header", "codebooks", "padding") and gg.name in e.one_line(), (what, pos)
                    continue
                assert not rep.ok, (what, pos, mask)
                files = {c.file for c in rep.failed}
                assert target.name in files, (what, pos, [c.one_line() for c in rep.failed])
                if what in g.tensors:  # tensor data: the tensor is named, and only it
                    named = {c.tensor for c in rep.failed if c.name == "manifest.tensors"}
                    assert named == {what}, (what, pos)
                if what == "padding":
                    assert not any(c.tensor for c in rep.failed)
            finally:
                flip(target, pos, mask)
    assert verify(art).ok


def test_manifest_flips_caught_in_the_fields_the_gguf_repeats(arts, tmp_path):
    _, mix = arts
    art = tmp_path / "art"
    shutil.copytree(mix, art)
    man = art / "manifest.json"
    text = man.read_bytes()
    targets = []
    for key in (b'"sha256": "', b'"bytes": ', b'"ggml_type": ', b'"qtype": "', b'"fingerprint": "',
                b'"tool_version": "', b'"rel_mse": '):
        at = text.find(key)
        targets.append(at + len(key) + 1)
    targets += [0, 1, len(text) - 1, len(text) // 2]  # structure bytes
    for pos in targets:
        flip(man, pos)
        try:
            try:
                rep = verify(art)
            except Ds4quantError as e:
                assert "manifest.json" in e.one_line()
                continue
            # a changed hash in manifest.json reads as a damaged data file: either way it is named
            assert not rep.ok and all(c.file or c.tensor for c in rep.failed), pos
        finally:
            flip(man, pos)
    # without SHA256SUMS (convert writes it last) the folder is unfinished: a failed check naming it
    (art / "SHA256SUMS").unlink()
    bad = [c for c in verify(art).failed if c.name == "complete"]
    assert [c.file for c in bad] == ["SHA256SUMS"] and "unfinished" in bad[0].detail


def test_every_offender_is_listed_not_just_the_first(arts, tmp_path):
    strix, _ = arts
    g = read_gguf_set(gguf_of(strix))
    a, b = "blk.0.ffn_gate_exps.weight", "blk.3.attn_q_a.weight"
    bad = {n: bytes(np.asarray(g.tensor_data(n)) ^ np.uint8(1)) for n in (a, b)}
    art = rewrite(strix, tmp_path / "two", payloads=bad,
                  manifest_edit=lambda o: [t.update(sha256=next(x for x in read_manifest(strix / "manifest.json")
                                                                .tensors if x.name == t["name"]).sha256)
                                           for t in o["tensors"] if t["name"] in bad])
    rep = verify(art)
    assert {c.tensor for c in _failed(rep, "manifest.tensors")} == {a, b}


def test_truncated_or_malformed_inputs_are_unusable(arts, tmp_path):
    strix, _ = arts
    art = tmp_path / "t"
    shutil.copytree(strix, art)
    gg = gguf_of(art)
    data = gg.read_bytes()
    gg.write_bytes(data[:-100])
    with pytest.raises(CorruptDataError, match="runs past the end.*sha256 also differs from manifest.json"):
        verify(art)
    gg.write_bytes(data)
    (art / "manifest.json").write_bytes(b"{not json")
    with pytest.raises(CorruptDataError, match="not valid JSON"):
        verify(art)
    (art / "manifest.json").unlink()
    with pytest.raises(BadInputError, match="no manifest.json"):
        verify(art)
    with pytest.raises(BadInputError, match="--imatrix"):
        verify(strix, imatrix=tmp_path / "x.gguf")
    res = CliRunner().invoke(cli, ["verify", str(art)])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1


def _retable(obj_table, **changes):
    from ds4quant.codebooks import CodebookTable

    out = []
    for e in obj_table.entries:
        if e.name in changes:
            if changes[e.name] is None:
                continue
            e = changes[e.name](e)
        out.append(e)
    return write_table(CodebookTable(tuple(out)))


def test_codebook_tables_must_cover_every_mix_tensor_exactly_once_and_agree(arts, tmp_path):
    from ds4quant.codebooks import CodebookEntry

    _, mix = arts
    g = read_gguf_set(gguf_of(mix))
    table = read_table(g.blob("ds4quant.codebooks"))
    name = "blk.1.ffn_up_exps.weight"

    # an entry missing from the own table
    dropped = _retable(table, **{name: None})
    art = rewrite(mix, tmp_path / "a", kv={"ds4quant.codebooks": (dropped, VT.ARRAY, VT.UINT8)})
    rep = verify(art)
    bad = _failed(rep, "codebooks")
    assert bad and any(name in c.detail and "has no entry" in c.detail for c in bad)
    assert any(c.tensor == name and "not in ds4quant.codebooks" in c.detail for c in bad)

    # the own table's books differ from the Lucebox blob's
    def nudge(e):
        books = e.books.copy()
        books[3, 0, 0] = np.float32(-8.0)
        return CodebookEntry(e.name, e.qtype, e.modes, books, e.expert_ids, e.n_global)

    nudged = _retable(table, **{name: nudge})
    art = rewrite(mix, tmp_path / "b", kv={"ds4quant.codebooks": (nudged, VT.ARRAY, VT.UINT8)})
    bad = _failed(verify(art), "codebooks")
    assert [c.tensor for c in bad] == [name] and "differ" in bad[0].detail

    # a corrupted own table (CRC) is a failed check naming the KV, not a crash
    blob = bytearray(g.blob("ds4quant.codebooks"))
    blob[-10] ^= 1  # inside the last books: only the CRC can tell
    art = rewrite(mix, tmp_path / "c", kv={"ds4quant.codebooks": (bytes(blob), VT.ARRAY, VT.UINT8)})
    bad = _failed(verify(art), "codebooks")
    assert any("crc32" in c.detail for c in bad)

    # a loose sidecar that differs from the embedded copy
    gum = bytearray(g.blob("deepseek4.gumix.sidecar"))
    gum[-1] ^= 0x01
    art = rewrite(mix, tmp_path / "d", loose={".gumix.bin": bytes(gum)})
    bad = _failed(verify(art), "codebooks")
    assert any(c.file and c.file.endswith(".gumix.bin") for c in bad)

    # MIX tensors without any own table
    art = rewrite(mix, tmp_path / "e", kv={"ds4quant.codebooks": None})
    bad = _failed(verify(art), "codebooks")
    assert any("no ds4quant.codebooks table" in c.detail for c in bad)


def test_compact_stacks_need_ids_covering_every_expert_once(arts, tmp_path):
    _, mix = arts
    key = "ds4quant.expert_ids.blk.3.ffn_gate_exps.rocmfp2.weight"
    g = read_gguf_set(gguf_of(mix))
    ids = g.kv[key].value.copy()
    ids[0] = MIX_IDS[1]  # expert 2 twice, expert 1 in no stack
    ids.sort()
    art = rewrite(mix, tmp_path / "a", kv={key: (ids, VT.ARRAY, VT.UINT32)})
    bad = _failed(verify(art), "experts")
    assert len(bad) == 1 and bad[0].tensor == "blk.3.ffn_gate_exps"
    assert "expert(s) in no stack (1)" in bad[0].detail and "in several stacks (2)" in bad[0].detail
    art = rewrite(mix, tmp_path / "b", kv={key: None})
    assert any(c.tensor == "blk.3.ffn_gate_exps.rocmfp2.weight" for c in _failed(verify(art), "experts"))


def test_ds4_keys_are_checked(arts, tmp_path):
    strix, _ = arts
    art = rewrite(strix, tmp_path / "a", kv={"deepseek4.expert_count": None,
                                             "deepseek4.block_count": (4, VT.UINT64, None)})
    bad = _failed(verify(art), "ds4_keys")
    assert {c.detail for c in bad} == {"deepseek4.expert_count is missing",
                                       "deepseek4.block_count must be UINT32, got UINT64"}


def test_a_wrong_variant_passes_structure_but_fails_the_numbers(arts, tmp_path):
    strix, _ = arts
    names = ["blk.0.ffn_gate_exps.weight", "blk.2.ffn_up_exps.weight"]
    art = rewrite(strix, tmp_path / "v", qtypes={n: "rocmfp2_affine" for n in names})
    assert verify(art).ok  # self-consistent: hashes and tags agree
    rep = verify(art, source=SAMPLE)
    bad = _failed(rep, "numbers.floor")
    assert sorted(c.tensor for c in bad) == sorted(names)
    assert all(t.flagged == (t.name in names) for t in rep.tensors)
    res = CliRunner().invoke(cli, ["verify", str(art), "--source", str(SAMPLE), "--json"])
    assert res.exit_code == 1 and sorted(json.loads(res.output)["summary"]["flagged"]) == sorted(names)


def test_threshold_overrides_the_floor_table(arts):
    strix, _ = arts
    rep = verify(strix, source=SAMPLE, threshold_db=12.0)
    flagged = {t.name for t in rep.tensors if t.flagged}
    assert flagged == {t.name for t in rep.tensors if t.qtype == "rocmfp2"}  # ~8.6 dB < 12 <= rocmfp3's ~14.7
    assert all(t.floor_db == 12.0 for t in rep.tensors if t.qtype.startswith("rocmfp"))


def test_importance_weighted_error_with_an_imatrix(arts, tmp_path):
    from ds4quant.calib.imatrix import make_imatrix, write_imatrix_gguf

    strix, _ = arts
    rng = np.random.default_rng(0)
    sums = {}
    for layer in range(4):
        for proj, cols in (("gate", 256), ("up", 256), ("down", 128)):
            sums[f"blk.{layer}.ffn_{proj}_exps.weight"] = (rng.uniform(0.1, 4, (16, cols)).astype(np.float32),
                                                          np.full(16, 10.0, np.float32))
    path = tmp_path / "imatrix.gguf"
    write_imatrix_gguf(path, make_imatrix(sums))
    rep = verify(strix, source=SAMPLE, imatrix=path)
    t = next(t for t in rep.tensors if t.name == "blk.2.ffn_down_exps.weight")
    g = read_gguf_set(gguf_of(strix))
    raw = np.asarray(g.tensor_data(t.name))
    per = raw.size // 16
    wsse = wssx = 0.0
    with open_source(SAMPLE) as src:
        for e in range(16):
            x = src.read_dequantized(f"layers.2.ffn.experts.{e}.w2.weight").astype(np.float64)
            y = formats.decode("rocmfp3", raw[e * per:(e + 1) * per], 128).astype(np.float64)
            w = (sums[t.name][0][e] / 10.0).astype(np.float32).astype(np.float64)[None, :]
            wsse += float(np.sum(w * (x - y) ** 2))
            wssx += float(np.sum(w * x * x))
    assert t.errors.weighted_rel_error == pytest.approx(wsse / wssx, rel=1e-9)
    assert rep.summary["expert_weighted_rel_error"] is not None
    # the shipped calibration imatrix (from the reference model) works the same way
    calib = SAMPLE.parent / "ds4-tiny-calib" / "imatrix.gguf"
    res = CliRunner().invoke(cli, ["verify", str(strix), "--source", str(SAMPLE), "--imatrix", str(calib)])
    assert res.exit_code == 0 and "weighted rel error" in res.output, res.output


def test_a_different_source_is_named(arts, tmp_path):
    strix, _ = arts
    other = tmp_path / "src"
    shutil.copytree(SAMPLE, other)
    (other / "config.json").write_bytes((SAMPLE / "config.json").read_bytes() + b"\n")
    rep = verify(strix, source=other)
    bad = _failed(rep)
    assert [c.name for c in bad] == ["source"] and bad[0].file == str(other)


def test_report_is_deterministic_with_plots_and_a_runtime_placeholder(arts, mix_numbers, tmp_path):
    rep = mix_numbers
    a = write_report(rep, tmp_path / "a")
    b = write_report(rep, tmp_path / "b")
    names = sorted(p.name for p in a.parent.iterdir())
    assert names == sorted(["report.md", "verify.json", PLOT_BITS, PLOT_ERROR, PLOT_HIST])
    for n in names:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes(), n
    md = a.read_text()
    assert "## Fidelity through the runtime" in md
    assert md.index(RUNTIME_BEGIN) < md.index("_Not measured yet._") < md.index(RUNTIME_END)
    for plot in (PLOT_BITS, PLOT_ERROR, PLOT_HIST):
        assert f"]({plot})" in md
        png = (tmp_path / "a" / plot).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        chunks = _png_chunks(png)
        assert b"tIME" not in chunks and not any(b"matplotlib" in c for c in chunks.values())
    assert "blk.3.ffn_gate_exps" not in md or "rocmfp2_mix" in md
    filled = write_report(rep, tmp_path / "c", runtime_section="KL 0.001").read_text()
    assert f"{RUNTIME_BEGIN}\nKL 0.001\n{RUNTIME_END}" in filled


def _png_chunks(png: bytes) -> dict:
    out, pos = {}, 8
    while pos < len(png):
        n = int.from_bytes(png[pos:pos + 4], "big")
        kind = png[pos + 4:pos + 8]
        out[kind] = out.get(kind, b"") + png[pos + 8:pos + 8 + n]
        assert zlib.crc32(png[pos + 4:pos + 8 + n]) == int.from_bytes(png[pos + 8 + n:pos + 12 + n], "big")
        pos += 12 + n
    return out


def test_cli_report_option_without_source_uses_manifest_figures(arts, tmp_path):
    strix, _ = arts
    res = CliRunner().invoke(cli, ["verify", str(strix), "--report", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert "convert-time" in res.output and (tmp_path / "r" / "report.md").is_file()
    md = (tmp_path / "r" / "report.md").read_text()
    assert "convert-time figures recorded in manifest.json" in md


def test_a_report_that_cannot_be_written_is_one_line_and_leaves_no_folder(arts, tmp_path, monkeypatch):
    """The disk fills while the report is written: one line naming the file, exit 2,
    and the report folder the run created is gone."""
    import errno

    import ds4quant.publish.report as report_mod

    strix, _ = arts

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(report_mod, "atomic_write_bytes", full)
    res = CliRunner().invoke(cli, ["verify", str(strix), "--report", str(tmp_path / "r")])
    assert res.exit_code == 2, (res.output, res.exception)
    (line,) = [x for x in res.output.splitlines() if x.strip()]
    assert "No space left on device" in line and str(tmp_path / "r") in line and "nothing was written" in line
    assert not (tmp_path / "r").exists()


def test_split_sets_are_verified_file_by_file(tmp_path):
    from ds4quant.convert import convert

    out = tmp_path / "split"
    convert(SAMPLE, out, "rocmfp2-strix", threads=1, split_max_size="2M")
    parts = sorted(out.glob("*.gguf"))
    assert len(parts) == 3
    rep = verify(out, source=SAMPLE)
    assert rep.ok and [p.name for p in rep.files] == [p.name for p in parts]
    g = read_gguf_set(parts[0])
    name, info = next((n, i) for n, i in g.tensors.items() if i.path == parts[1])
    flip(parts[1], info.offset + 3)
    bad = verify(out).failed
    assert {c.file for c in bad} == {parts[1].name} and {c.tensor for c in bad} == {None, name}
    flip(parts[1], info.offset + 3)
    parts[2].unlink()
    with pytest.raises(CorruptDataError, match="split 3 of 3 is missing"):
        verify(out)


def test_untagged_107_needs_the_variant_and_reports_stay_outside_the_artifact(arts, tmp_path):
    corpus = Path(__file__).resolve().parent / "data" / "hostile" / "gguf" / "untagged_107.gguf"
    runner = CliRunner()
    res = runner.invoke(cli, ["verify", str(corpus)])
    assert res.exit_code == 2 and "name the variant" in res.output
    res = runner.invoke(cli, ["verify", str(corpus), "--variant-107", "rocmfp2", "--json"])
    assert res.exit_code == 1  # readable, but not a DS4 artifact
    checks = json.loads(res.output)["checks"]
    assert any(c["name"] == "types" and c["ok"] and "untagged" in c["detail"] for c in checks)
    assert any(c["name"] == "ds4_keys" and not c["ok"] for c in checks)
    strix, _ = arts
    with pytest.raises(BadInputError, match="inside the artifact"):
        check_report_dir(strix / "report", strix)


def test_a_foreign_lucebox_style_gguf_decodes_with_its_sidecar_books(arts, tmp_path):
    strix, _ = arts
    full = mix_artifact(strix, tmp_path / "full", compact=False)
    # as Lucebox's converter writes it: no ds4quant tags, no own table, P4MIX/GUMIX embedded
    art = rewrite(full, tmp_path / "foreign", kv={"ds4quant.codebooks": None}, tags=False)
    with pytest.raises(Ds4quantError, match="has ggml type 107 and no tag"):
        verify(gguf_of(art))
    rep = verify(gguf_of(art), source=SAMPLE, variant_107="rocmfp2")
    assert rep.ok, [c.one_line() for c in rep.failed]
    by = {t.name: t for t in rep.tensors}
    assert by["blk.1.ffn_up_exps.weight"].qtype == "rocmfp2_mix" and rep.lucebox_mix
    ref = {t.name: t for t in verify(full, source=SAMPLE).tensors}
    for n in ("blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight", "blk.2.ffn_down_exps.weight"):
        assert by[n].errors.expert_sqnr_db == ref[n].errors.expert_sqnr_db
    assert any("untagged" in c.detail for c in rep.checks if c.name == "types")


def test_a_recorded_plan_entry_that_is_no_tensor_choice_is_named(arts, tmp_path):
    """recipe.plan reads back as TensorChoice records (``ds4quant.plan.plan_from_json``):
    an entry that is none fails manifest.consistency with its index and field."""
    _, mix = arts

    def edit(o):
        plan = o["recipe"]["plan"]
        plan[0] = {**plan[0], "shape": "wide"}
        plan.append(7)

    art = rewrite(mix, tmp_path / "plan", manifest_edit=edit)
    bad = [c.detail for c in verify(art).failed if c.name == "manifest.consistency"]
    n = len(read_manifest(mix / "manifest.json").recipe["plan"])
    assert bad == ["recipe.plan has an entry that is no tensor choice: entry 0 "
                   f"({read_manifest(mix / 'manifest.json').recipe['plan'][0]['name']}): plan entry field 'shape' "
                   "is 'wide'",
                   f"recipe.plan has an entry that is no tensor choice: entry {n}: a plan entry must be an object, "
                   "got int"], bad
