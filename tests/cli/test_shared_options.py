"""The shared options and output helpers of ds4quant.cli: the SIZE and owner-budget
types refuse bad input as one line (exit 2) before any work, messages quote a
size as it was typed, tables align, and both entry points run."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from ds4quant import __version__
from ds4quant.cli import cli
from ds4quant.cli.options import Size
from ds4quant.cli.output import table_lines


def _one_line_error(res, needle: str) -> None:
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4quant: error: ") and needle in lines[0], res.output


def test_bad_sizes_are_one_line_errors_naming_the_option(tmp_path):
    out = tmp_path / "out"
    _one_line_error(CliRunner().invoke(cli, ["convert", str(tmp_path), str(out), "--split-max-size", "12Q"]),
                    "--split-max-size: bad size '12Q'")
    _one_line_error(CliRunner().invoke(cli, ["convert", str(tmp_path), str(out), "--split-max-size", "0"]),
                    "--split-max-size: size must be positive, got '0'")
    _one_line_error(CliRunner().invoke(cli, ["convert", str(tmp_path), str(out), "--recipe", "adaptive",
                                             "--max-bytes", "-1G"]), "--max-bytes: size must be positive")
    assert not out.exists()


def test_owner_budgets_are_sizes_checked_before_any_file_is_read(tmp_path):
    absent = str(tmp_path / "absent")
    base = ["place", absent, "--routing", absent, "--out", str(tmp_path / "p.json")]
    _one_line_error(CliRunner().invoke(cli, base + ["--owner", "cpu=lots"]), "--owner cpu: bad size 'lots'")
    _one_line_error(CliRunner().invoke(cli, base + ["--owner", "cpu=-5G"]), "--owner cpu: size must not be negative")
    _one_line_error(CliRunner().invoke(cli, base + ["--owner", "gpu:0=1G"]), "unknown owner name")
    assert not (tmp_path / "p.json").exists()


def test_a_size_keeps_the_users_text():
    s = Size(64 << 10, "64K")
    assert s == 65536 and s + 1 == 65537 and int(s) == 65536
    assert f"over --split-max-size {s}" == "over --split-max-size 64K" and str(s) == "64K"
    assert f"{s:,}" == "65,536"


def test_table_columns_align_to_the_widest_cell():
    lines = table_lines(("name", "bytes"), [("a", "1,024"), ("longer", "7")])
    assert lines == ["name    bytes", "a       1,024", "longer  7"]
    assert table_lines(("n", "x"), [("a", "1")], rstrip=False) == ["n  x", "a  1"]
    assert table_lines(("name", "x"), [("a", "")], rstrip=False)[1] == "a      "  # the padding stays


def test_python_m_ds4quant_and_python_m_ds4quant_cli():
    for mod in ("ds4quant", "ds4quant.cli"):
        out = subprocess.run([sys.executable, "-m", mod, "--version"], capture_output=True, text=True, check=True)
        assert __version__ in out.stdout and "ds4quant" in out.stdout
