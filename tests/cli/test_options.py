"""Every command keeps its options: names, flags, defaults, choices and metavars
as tests/cli/data/options.json records them (captured from the CLI before it
became a package). A change to the CLI's surface shows up here as a diff.

To record a deliberate change: python -m tests.cli.test_options > tests/cli/data/options.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ds4quant.cli import cli

PINNED = Path(__file__).resolve().parent / "data" / "options.json"


def describe(param: click.Parameter) -> dict:
    """What a user sees of one parameter, as plain JSON."""
    d = {"kind": "argument" if isinstance(param, click.Argument) else "option",
         "opts": sorted(param.opts), "secondary_opts": sorted(param.secondary_opts),
         "multiple": bool(param.multiple), "required": bool(param.required)}
    if isinstance(param, click.Option):
        d["flag"] = bool(param.is_flag)
        d["metavar"] = param.metavar
        d["show_default"] = param.show_default
        default = param.get_default(click.Context(click.Command("x")), call=False)
        # click marks "no default" with a sentinel object: recorded as null
        d["default"] = (default if isinstance(default, (str, int, float, bool, type(None)))
                        else list(default) if isinstance(default, (list, tuple)) else None)
    if isinstance(param.type, click.Choice):
        d["choices"] = list(param.type.choices)
    return d


def surface() -> dict:
    out = {name: {p.name: describe(p) for p in cmd.params} for name, cmd in cli.commands.items()}
    out[""] = {p.name: describe(p) for p in cli.params}
    return out


def test_every_command_keeps_its_options():
    want = json.loads(PINNED.read_text(encoding="utf-8"))
    got = surface()
    assert sorted(got) == sorted(want), "commands differ"
    for cmd in sorted(want):
        assert got[cmd] == want[cmd], f"ds4quant {cmd or '(group)'}: options differ"


if __name__ == "__main__":
    json.dump(surface(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
