"""The CLI surface that exists from day one: --help, --version, formats."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from ds4quant import __version__
from ds4quant.cli import cli


def test_version():
    res = CliRunner().invoke(cli, ["--version"])
    assert res.exit_code == 0
    assert __version__ in res.output


def test_help_does_not_import_torch():
    # A fresh interpreter: --help must stay light (no torch, no transformers).
    code = (
        "import sys\n"
        "from ds4quant.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "import ds4quant.formats\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False False"


def test_formats_json_lists_every_qtype_with_its_facts():
    from ds4quant.formats import QTYPES

    res = CliRunner().invoke(cli, ["formats", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.output)["qtypes"]}
    assert set(rows) == set(QTYPES)
    for name, r in rows.items():
        q = QTYPES[name]
        assert r["ggml_type"] == q.ggml_type
        assert r["variant"] == q.variant
        assert r["block_size"] == q.block_size and r["block_bytes"] == q.block_bytes
        assert abs(r["bpw"] - 8 * q.block_bytes / q.block_size) < 1e-6
        assert isinstance(r["runtimes"], list) and r["runtimes"]


def test_formats_table_names_every_qtype():
    from ds4quant.formats import QTYPES

    res = CliRunner().invoke(cli, ["formats"])
    assert res.exit_code == 0
    for name in QTYPES:
        assert name in res.output


def test_user_error_is_one_line_and_exit_2(tmp_path):
    # An unknown subcommand is click's own usage error (exit 2 too).
    res = CliRunner().invoke(cli, ["no-such-command"])
    assert res.exit_code == 2


def test_a_file_system_error_no_command_named_is_still_one_line_and_exit_2(monkeypatch):
    """The group's last resort: an OSError (a full disk, say) that a command let through
    becomes one line naming the file and the user-error code, not a traceback."""
    import errno

    import ds4quant.cli.formats as formats_cmd

    def full(obj):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/result.json")

    monkeypatch.setattr(formats_cmd, "emit_json", full)
    res = CliRunner().invoke(cli, ["formats", "--json"])
    assert res.exit_code == 2, (res.output, res.exception)
    assert res.output.strip().splitlines() == ["ds4quant: error: /data/result.json: No space left on device"]
