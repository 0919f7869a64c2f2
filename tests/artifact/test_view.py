"""ArtifactView: the one reader, on every artifact kind the project writes and on the hostile corpus.

Each property is checked against an independent reading of the same files:
the stored plan (ids), the own codebook table read with ``read_table``,
bytes read with plain ``open``/``seek``, and ``formats.decode``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ds4quant import formats, names
from ds4quant.artifact import GGUFWriter, read_gguf_set
from ds4quant.artifact.view import open_artifact
from ds4quant.codebooks import read_table
from ds4quant.errors import BadInputError, Ds4quantError
from tests._verify_util import MIX_IDS, rewrite

CORPUS = Path(__file__).resolve().parents[1] / "data" / "hostile"
EXPECTED: dict = json.loads((CORPUS / "expected.json").read_text())
VIEW_KINDS = ("strix", "split", "handmade", "adaptive-tensor", "adaptive-expert-mix", "adaptive-expert-plain")


def _raw(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def _plan(v) -> dict:
    kv = v.kv.get(names.KEY_PLAN)
    return {} if kv is None else {c["name"]: c for c in json.loads(kv.value)}


@pytest.fixture(scope="module", params=VIEW_KINDS)
def art(request, kinds):
    return request.param, kinds(request.param)


def test_layout_and_containers(art):
    kind, path = art
    v = open_artifact(path)
    ggufs = sorted(p for p in path.iterdir() if p.suffix == ".gguf")
    assert sorted(v.gguf_paths) == ggufs and v.folder == path
    assert (len(ggufs) > 1) == (kind == "split")
    assert v.manifest is not None and {f.name for f in v.manifest.files} >= {p.name for p in ggufs}
    if (path / "SHA256SUMS").exists():
        assert v.kind == "release" and set(v.sums) >= {p.name for p in ggufs}
    # any file of the set opens the same set, as a bare GGUF (no manifest)
    w = open_artifact(ggufs[-1])
    assert w.kind == "gguf" and w.manifest is None and w.sums is None and sorted(w.gguf_paths) == ggufs
    assert [s.name for s in w.stacks] == [s.name for s in v.stacks]


def test_stacks_and_ids_are_what_convert_wrote(art):
    kind, path = art
    v = open_artifact(path)
    E, L = v.header.n_expert, v.header.n_layer
    assert (E, L, v.header.hidden, v.header.expert_ffn) == (16, 4, 256, 128)
    plan = _plan(v)
    exps = [n for n in v.tensors if "_exps" in n]
    assert sorted(s.name for s in v.stacks) == sorted(exps)
    for s in v.stacks:
        info = v.tensor(s.name)
        assert (s.cols, s.rows, s.n_experts) == tuple(info.shape) and s.qtype == info.qtype
        assert s.expert_nbytes * s.n_experts == info.nbytes
        assert s.compact == (names.parse_stack(s.name).qtype is not None)
        if s.compact:
            assert s.expert_ids == tuple(int(i) for i in v.kv[names.expert_ids_key(s.name)].value)
            if s.name in plan:
                assert list(s.expert_ids) == plan[s.name]["experts"]
        else:
            assert s.expert_ids == tuple(range(E))
    for layer in range(L):
        for proj in names.PROJS:
            got = sorted(i for s in v.stacks_for(layer, proj) for i in s.expert_ids)
            assert got == list(range(E)), (layer, proj)
    if kind == "handmade":
        (mix,) = [s for s in v.stacks_for(3, "gate") if s.qtype == "rocmfp2_mix"]
        assert mix.compact and mix.expert_ids == MIX_IDS
    compact = any(s.compact for s in v.stacks)
    assert compact == (kind in ("handmade", "adaptive-expert-mix", "adaptive-expert-plain"))


def test_expert_bytes_are_slices_of_the_tensor_bytes(art):
    _, path = art
    v = open_artifact(path)
    for s in v.stacks:
        info = v.tensor(s.name)
        row_bytes = s.expert_nbytes // s.rows
        whole = v.expert_data(s.name)
        assert whole.shape == (s.n_experts, s.rows, row_bytes) and not whole.flags.writeable
        assert whole.tobytes() == _raw(Path(info.path), info.offset, info.nbytes)
        ids = s.expert_ids
        picks = [ids[1:3], ids[::-1], [ids[-1], ids[0]]] if len(ids) > 2 else [ids[::-1]]
        for pick in picks:
            got = v.expert_data(s.name, pick)
            assert got.shape == (len(pick), s.rows, row_bytes) and not got.flags.writeable
            for k, gid in enumerate(pick):
                f, off, n = v.expert_span(s.name, gid)
                assert f == Path(info.path) and n == s.expert_nbytes
                assert off == info.offset + ids.index(gid) * n
                assert got[k].tobytes() == _raw(f, off, n)
        assert isinstance(v.expert_data(s.name, ids[:2]), np.memmap)  # contiguous run: no copy
        missing = next(i for i in range(v.header.n_expert + 1) if i not in ids)
        with pytest.raises(BadInputError, match=f"expert {missing} is not in this stack"):
            v.expert_data(s.name, [missing])


def test_expert_nbytes_sums_the_three_projections(art):
    _, path = art
    v = open_artifact(path)
    nb = v.expert_nbytes()
    assert nb.shape == (4, 16) and nb.dtype == np.int64
    assert int(nb.sum()) == sum(v.tensor(s.name).nbytes for s in v.stacks)
    for layer in range(4):
        for e in range(16):
            want = sum(s.expert_nbytes for p in names.PROJS for s in v.stacks_for(layer, p) if e in s.expert_ids)
            assert nb[layer, e] == want


def test_books_are_the_stored_table(art):
    kind, path = art
    v = open_artifact(path)
    mix = [n for n, i in v.tensors.items() if i.needs_codebooks]
    assert (len(mix) > 0) == (kind in ("handmade", "adaptive-tensor", "adaptive-expert-mix"))
    if not mix:
        assert v.codebook_tables == () and v.book_entry(v.stacks[0].name) is None
        return
    own = read_table(v.gguf.blob(names.KEY_CODEBOOKS))
    assert sorted(own.names) == sorted(mix)
    for n in mix:
        e = v.book_entry(n)
        assert e is not None and e == own[n]
        st = next((s for s in v.stacks if s.name == n), None)
        if st is not None:
            assert e.global_ids == st.expert_ids
    for n in v.tensors:
        if n not in mix:
            assert v.book_entry(n) is None
    if kind in ("handmade", "adaptive-tensor"):  # both carry a loose .gumix.bin
        assert any(t.endswith(".gumix.bin") for t in v.codebook_tables)
        assert [p.name for p in v.sidecars] == [t for t in v.codebook_tables if t.endswith(".bin")]
    # a Lucebox blob covers every MIX tensor only without compact stacks
    assert v.lucebox_books == (kind == "adaptive-tensor")


def test_runtimes_come_from_the_contents(art):
    kind, path = art
    v = open_artifact(path)
    compact = any(s.compact for s in v.stacks)
    mix = bool(v.mix_tensors)
    # rocmfp2 (107) needs the build without ROCMFP2_AFFINE; without 107 both builds load it. MIX books
    # that are also loose files (convert writes both) reach every Lucebox loader
    lucebox = ("lucebox-mix" if v.lucebox_loose_books else "lucebox-mix-embedded") if mix else "lucebox"
    builds = (lucebox,) if any(i.ggml_type == 107 for i in v.tensors.values()) else \
        (lucebox, lucebox.replace("lucebox", "lucebox-affine") if not mix else
         lucebox.replace("lucebox-mix", "lucebox-mix-affine"))
    assert v.runtimes == (("ds4quant",) if compact else ("ds4quant",) + builds)
    stored = tuple(str(x) for x in v.kv[names.KEY_RUNTIMES].value)
    assert v.stored_runtimes == stored
    runtime_problems = [p for p in v.problems() if p.check == "runtimes"]
    assert bool(runtime_problems) == (not set(stored) <= set(v.runtimes))
    assert [p for p in v.problems() if p.check != "runtimes"] == []


def test_dense_decodes_every_non_expert_tensor(art):
    _, path = art
    v = open_artifact(path)
    for n, info in v.tensors.items():
        if names.parse_stack(n) is not None:
            with pytest.raises(BadInputError, match="expert_data"):
                v.dense(n)
            continue
        x = v.dense(n)
        assert x.shape == tuple(reversed(info.shape))
        raw = np.frombuffer(_raw(Path(info.path), info.offset, info.nbytes), np.uint8)
        if info.qtype == "i32":
            assert np.array_equal(x.ravel(), raw.view("<i4"))
            continue
        assert x.dtype == np.float32
        e = v.book_entry(n)
        want = formats.decode(info.qtype, raw, info.shape[0], *((e.books[0], int(e.modes[0])) if e else ()))
        assert np.array_equal(x.reshape(-1).view(np.uint32), want.reshape(-1).view(np.uint32)), n
        if info.qtype == "f32":
            assert np.array_equal(x.ravel(), raw.view("<f4"))


# ----------------------------------------------------------------------------
# content problems: reported, not raised


def test_compact_stack_id_problems_are_listed(kinds, tmp_path):
    src = kinds("handmade")
    mix = "blk.3.ffn_gate_exps.rocmfp2_mix.weight"
    rest = "blk.3.ffn_gate_exps.rocmfp2.weight"
    from gguf import GGUFValueType as VT

    cases = {
        "no_ids": ({names.expert_ids_key(mix): None}, "has no ds4quant.expert_ids.<name> list"),
        "wrong_type": ({names.expert_ids_key(mix): (np.array(MIX_IDS, np.int32), VT.ARRAY, VT.INT32)},
                       "must be an ARRAY of UINT32"),
        "count": ({names.expert_ids_key(mix): (np.array(MIX_IDS[:-1], np.uint32), VT.ARRAY, VT.UINT32)},
                  "4 expert ids for a stack of 5 experts"),
        "order": ({names.expert_ids_key(mix): (np.array((2, 0, 5, 7, 11), np.uint32), VT.ARRAY, VT.UINT32)},
                  "strictly increasing"),
        "overlap": ({names.expert_ids_key(mix): (np.array((0, 1, 5, 7, 11), np.uint32), VT.ARRAY, VT.UINT32)},
                    "expert(s) in several stacks (1)"),
        "stray": ({names.expert_ids_key("blk.9.ffn_up_exps.q8_0.weight"): (np.array([0], np.uint32), VT.ARRAY,
                                                                           VT.UINT32)}, "names no tensor"),
    }
    for case, (kv, text) in cases.items():
        v = open_artifact(rewrite(src, tmp_path / case, kv=kv))
        bad = [p for p in v.problems() if p.check == "experts"]
        assert any(text in p.detail for p in bad), (case, v.problems())
        if case != "stray":
            assert mix not in [s.name for s in v.stacks] or case == "overlap"
            assert rest in [s.name for s in v.stacks]


def test_runtimes_key_that_claims_lucebox_for_compact_stacks_is_a_problem(kinds, tmp_path):
    from gguf import GGUFValueType as VT

    d = rewrite(kinds("handmade"), tmp_path / "lie",
                kv={names.KEY_RUNTIMES: (["ds4quant", "lucebox"], VT.ARRAY, VT.STRING)})
    v = open_artifact(d)
    assert v.runtimes == ("ds4quant",) and v.stored_runtimes == ("ds4quant", "lucebox")
    (p,) = v.problems()
    assert p.check == "runtimes" and "lucebox" in p.detail and p.file == v.first_file


# ----------------------------------------------------------------------------
# the hostile corpus


def _gguf_cases():
    return sorted(k for k, e in EXPECTED.items() if e["reader"] == "gguf")


@pytest.mark.parametrize("rel", _gguf_cases())
def test_hostile_gguf_is_refused_with_its_one_line_error(rel):
    exp = EXPECTED[rel]
    with pytest.raises(Ds4quantError) as ei:
        open_artifact(CORPUS / rel)
    assert type(ei.value).__name__ == exp["error"]
    line = ei.value.one_line()
    assert exp["message"] in line and "\n" not in line


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ds4quant.artifact import FileEntry, Manifest, tensor_entries, write_manifest

    root = tmp_path_factory.mktemp("tiny")
    w = GGUFWriter(root / "m.gguf")
    w.add_string("general.architecture", "deepseek4")
    w.add_tensor("t", "f32", (8,), np.arange(8, dtype="<f4"))
    files = w.write()
    write_manifest(root / "manifest.json", Manifest("0.1.0", ("ds4quant", "test"), {}, {}, (FileEntry.of(files[0]),),
                                                    tensor_entries(read_gguf_set(files[0]))))
    return root


def test_hostile_manifests_and_sums_are_refused(tiny, tmp_path):
    cases = sorted(k for k, e in EXPECTED.items() if e["reader"] in ("manifest", "sums"))
    assert cases
    for rel in cases:
        d = tmp_path / rel.replace("/", "_")
        shutil.copytree(tiny, d)
        name = "manifest.json" if EXPECTED[rel]["reader"] == "manifest" else "SHA256SUMS"
        (d / name).write_bytes((CORPUS / rel).read_bytes())
        with pytest.raises(Ds4quantError) as ei:
            open_artifact(d)
        assert EXPECTED[rel]["message"] in ei.value.one_line(), rel


def test_hostile_sidecars_and_tables_are_problems_of_a_readable_artifact(tiny, tmp_path):
    cases = sorted(k for k, e in EXPECTED.items() if e["reader"] in ("gumix", "p4mix", "dmix", "table"))
    assert len(cases) > 30
    for rel in cases:
        d = tmp_path / rel.replace("/", "_")
        kind = EXPECTED[rel]["reader"]
        data = (CORPUS / rel).read_bytes()
        if kind == "table":
            d.mkdir()
            w = GGUFWriter(d / "m.gguf")
            w.add_string("general.architecture", "deepseek4")
            w.add_blob(names.KEY_CODEBOOKS, data)
            w.add_tensor("t", "f32", (8,), np.arange(8, dtype="<f4"))
            w.write()
            where = "m.gguf"
        else:
            shutil.copytree(tiny, d)
            (d / f"m.gguf.{kind}.bin").write_bytes(data)
            where = f"m.gguf.{kind}.bin"
        v = open_artifact(d)
        bad = [p for p in v.problems() if p.check == "codebooks"]
        assert any(p.file == where and EXPECTED[rel]["message"] in p.detail for p in bad), (rel, v.problems())


def test_damaged_gguf_error_says_the_recorded_hash_differs(kinds, tmp_path):
    d = tmp_path / "cut"
    shutil.copytree(kinds("strix"), d)
    g = next(p for p in d.iterdir() if p.suffix == ".gguf")
    g.write_bytes(g.read_bytes()[:-4096])
    with pytest.raises(Ds4quantError, match="sha256 also differs from manifest.json and SHA256SUMS"):
        open_artifact(d)
