"""`ds4quant publish`: the release folder, its checksums, the model card, refusals, the hub."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ds4quant.artifact import read_gguf_set
from ds4quant.artifact.sums import SUMS_NAME, read_sums
from ds4quant.cli import cli
from ds4quant.publish import HubError, UnsoundArtifactError, publish, runtimes
from ds4quant.verify import verify
from tests._verify_util import SAMPLE, flip, gguf_of, mix_artifact, strix_artifact


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    root = tmp_path_factory.mktemp("publish")
    strix = strix_artifact(root / "strix")
    mix = mix_artifact(strix, root / "mix", loose_gumix=True)
    return strix, mix


@pytest.fixture(scope="module")
def release(arts, tmp_path_factory):
    _, mix = arts
    out = tmp_path_factory.mktemp("rel") / "ds4-tiny-mix"
    rep = publish(mix, out, source=SAMPLE)
    return out, rep


def test_release_folder_is_complete_and_sha256sum_accepts_it(arts, release):
    _, mix = arts
    out, rep = release
    gg = gguf_of(mix).name
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert files == {gg, gg + ".gumix.bin", "manifest.json", "README.md", SUMS_NAME, "report/report.md",
                     "report/verify.json", "report/error_per_layer.png", "report/bits_heatmap.png",
                     "report/error_histogram.png"}
    assert set(rep.files) == files
    for name in (gg, gg + ".gumix.bin", "manifest.json"):
        assert (out / name).read_bytes() == (mix / name).read_bytes()
    assert {n for n, _ in read_sums(out / SUMS_NAME)} == files - {SUMS_NAME}
    res = subprocess.run(["sha256sum", "-c", SUMS_NAME], cwd=out, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(": OK") == len(files) - 1
    assert not list(out.parent.glob("*.partial-*"))


def test_verify_passes_on_the_release_folder(release):
    out, _ = release
    rep = verify(out)
    assert rep.ok and rep.kind == "release", [c.one_line() for c in rep.failed]
    assert any(c.name == "sha256sums" and c.ok and "nothing unlisted" in c.detail for c in rep.checks)
    res = CliRunner().invoke(cli, ["verify", str(out)])
    assert res.exit_code == 0 and "sound" in res.output


def test_model_card_says_what_it_is_and_how_it_was_made(arts, release):
    out, rep = release
    card = (out / "README.md").read_text()
    man = rep.verify.manifest
    for section in ("## Source model", "## Recipe and command line", "## Size", "### Qtype per layer",
                    "## Fidelity", "## Plots", "## How to load it", "## Runtimes", "## Checksums"):
        assert section in card
    assert man.source["fingerprint"] in card
    assert " ".join(man.command) in card
    assert f"{rep.verify.summary['bpw_experts']:.4f} bpw" in card
    assert "Decoded and compared with the source" in card
    assert "rocmfp2 69% + rocmfp2_mix 31%" in card  # blk.3 gate: 5 of 16 experts MIX
    for f in man.files:
        assert f.sha256 in card
    for plot in ("report/error_per_layer.png", "report/bits_heatmap.png", "report/error_histogram.png"):
        assert f"]({plot})" in card and (out / plot).is_file()
    # compact per-expert stacks: only the bundled runtime loads them
    assert runtimes(rep.verify) == ("ds4quant",)
    assert "**ds4quant**." in card


def test_runtimes_follow_the_qtypes_and_the_lucebox_blobs(arts, tmp_path):
    strix, _ = arts
    assert runtimes(verify(strix)) == ("ds4quant", "lucebox")
    full = verify(mix_artifact(strix, tmp_path / "full", compact=False))
    # MIX tensors need a MIX-capable Lucebox build, and the card says what each runtime needs
    # (its p4mix blob is embedded only: loaders that read only the loose files cannot load it)
    assert full.ok and full.lucebox_mix and runtimes(full) == ("ds4quant", "lucebox-mix-embedded")
    bare = verify(mix_artifact(strix, tmp_path / "bare", compact=False, lucebox=False))
    assert bare.ok and not bare.lucebox_mix and runtimes(bare) == ("ds4quant",)


def test_publish_is_deterministic(arts, tmp_path):
    strix, _ = arts
    a = publish(strix, tmp_path / "a" / "rel").release
    b = publish(strix, tmp_path / "b" / "rel").release
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert fa == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in fa:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert "Convert-time figures from manifest.json" in (a / "README.md").read_text()


def test_a_flipped_byte_anywhere_in_a_release_is_caught(release, tmp_path):
    out, _ = release
    rel = tmp_path / "rel"
    shutil.copytree(out, rel)
    files = sorted(p for p in rel.rglob("*") if p.is_file())
    rng = np.random.default_rng(1)
    for p in files:
        size = p.stat().st_size
        for pos in sorted({0, size - 1, *map(int, rng.integers(0, size, 3))}):
            flip(p, pos)
            try:
                try:
                    rep = verify(rel)
                except Exception as e:  # unusable (a container no longer parses), with the file named
                    assert p.name in str(e), (p, pos)
                    continue
                assert not rep.ok, (p, pos)
                names = {c.file for c in rep.failed}
                rel_name = p.relative_to(rel).as_posix()
                assert rel_name in names or (p.name == SUMS_NAME and names), (p, pos, names)
            finally:
                flip(p, pos)
    assert verify(rel).ok


def test_an_unsound_artifact_is_refused(arts, tmp_path):
    strix, _ = arts
    bad = tmp_path / "bad"
    shutil.copytree(strix, bad)
    g = read_gguf_set(gguf_of(bad))
    info = g.tensors["blk.1.ffn_down_exps.weight"]
    flip(gguf_of(bad), info.offset + 77)
    with pytest.raises(UnsoundArtifactError, match="blk.1.ffn_down_exps.weight"):
        publish(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    res = CliRunner().invoke(cli, ["publish", str(bad), str(tmp_path / "out")])
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert "check(s) failed" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "out").exists()


def test_refusals_before_any_work(arts, tmp_path):
    strix, _ = arts
    runner = CliRunner()
    res = runner.invoke(cli, ["publish", str(strix), str(tmp_path / "o"), "--hf-repo", "no spaces/allowed"])
    assert res.exit_code == 2 and "--hf-repo" in res.output and not (tmp_path / "o").exists()
    res = runner.invoke(cli, ["publish", str(gguf_of(strix)), str(tmp_path / "o")])
    assert res.exit_code == 2 and "artifact folder" in res.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    res = runner.invoke(cli, ["publish", str(strix), str(tmp_path / "full")])
    assert res.exit_code == 2 and "not empty" in res.output
    assert (tmp_path / "full" / "x").read_text() == "keep"
    # --force replaces only a release publish wrote: a folder of the user's is refused, untouched
    res = runner.invoke(cli, ["publish", str(strix), str(tmp_path / "full"), "--force"])
    assert res.exit_code == 2 and "has no SHA256SUMS" in res.output, res.output
    assert (tmp_path / "full" / "x").read_text() == "keep"
    res = runner.invoke(cli, ["publish", str(strix), str(strix / "inside")])
    assert res.exit_code == 2 and "release folder is inside the artifact" in res.output


def test_a_full_disk_while_publishing_is_one_line_and_leaves_nothing(arts, tmp_path, monkeypatch):
    """The disk fills while the artifact is copied: one line naming the file, exit 2,
    no release folder and no partial one; the artifact untouched."""
    import errno

    import ds4quant.publish.release as release_mod

    strix, _ = arts
    before = {p.name: p.read_bytes() for p in strix.iterdir() if p.is_file()}

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(release_mod, "_copy_hashed", full)
    res = CliRunner().invoke(cli, ["publish", str(strix), str(tmp_path / "rel")])
    assert res.exit_code == 2, (res.output, res.exception)
    (line,) = [x for x in res.output.splitlines() if x.strip()]
    assert "No space left on device" in line and "rel.partial-" in line and "nothing was published" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert {p.name: p.read_bytes() for p in strix.iterdir() if p.is_file()} == before


def test_unreachable_hub_fails_cleanly_and_leaves_the_release_complete(arts, tmp_path, monkeypatch):
    import huggingface_hub.constants

    strix, _ = arts
    # a closed local port: refused at once, whatever the network of the machine running the tests
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_token_for_tests")
    out = tmp_path / "rel"
    res = CliRunner().invoke(cli, ["publish", str(strix), str(out), "--hf-repo", "someone/ds4-tiny"])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4quant: error: hub someone/ds4-tiny:")
    assert "nothing was uploaded" in lines[0] and str(out) in lines[0]
    assert subprocess.run(["sha256sum", "-c", "--quiet", SUMS_NAME], cwd=out).returncode == 0
    assert verify(out).ok


class _FakeApi:
    calls: list = []
    fail_upload = False

    def __init__(self, token=None):
        pass

    def create_repo(self, repo_id, repo_type=None, exist_ok=False):
        self.calls.append(("create_repo", repo_id, repo_type, exist_ok))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, repo_id, folder_path, repo_type=None, commit_message=None):
        self.calls.append(("upload_folder", repo_id, Path(folder_path).name, commit_message))
        if self.fail_upload:
            raise ConnectionError("connection reset\nby peer")


def test_upload_creates_the_repo_then_commits_the_folder_once(arts, tmp_path, monkeypatch):
    import huggingface_hub

    strix, _ = arts
    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeApi)
    _FakeApi.calls = []
    rep = publish(strix, tmp_path / "rel", hf_repo="me/ds4-tiny")
    assert rep.url == "https://huggingface.co/me/ds4-tiny"
    assert [c[0] for c in _FakeApi.calls] == ["create_repo", "upload_folder"]
    assert _FakeApi.calls[1][2] == "rel"
    _FakeApi.calls, _FakeApi.fail_upload = [], True
    with pytest.raises(HubError, match="upload failed .*one commit") as ei:
        publish(strix, tmp_path / "rel2", hf_repo="me/ds4-tiny")
    assert "\n" not in ei.value.one_line()
    assert (tmp_path / "rel2" / SUMS_NAME).is_file()


def test_publish_fidelity_needs_a_source(tmp_path):
    from click.testing import CliRunner

    from ds4quant.cli import cli

    r = CliRunner().invoke(cli, ["publish", str(tmp_path), str(tmp_path / "rel"), "--fidelity"])
    assert r.exit_code == 2 and "--source" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "rel").exists()
