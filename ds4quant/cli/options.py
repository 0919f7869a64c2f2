"""The options several commands share, each declared once, and the SIZE type.

A command that words an option's help its own way passes ``help=``; the
option's name, type, choices and default live here only.

    @json_option(help="Print the report as one JSON object.")
    @size_option("--max-bytes", help="cap on all tensor data (e.g. 90G)")
"""

from __future__ import annotations

from typing import Optional

import click

from ds4quant.runtime.mode import Mode

PATH = click.Path(path_type=str)
PROTOCOLS = ("exact-copy",)


class Size(int):
    """A byte count that remembers the user's text: ``str()`` gives it back, so a
    message quotes the size as it was typed (``--split-max-size 50G``)."""

    text: str

    def __new__(cls, n: int, text: str) -> "Size":
        obj = super().__new__(cls, n)
        obj.text = text
        return obj

    def __str__(self) -> str:
        return self.text

    def __format__(self, spec: str) -> str:
        return self.text if not spec else format(int(self), spec)


class SizeType(click.ParamType):
    """``1024``, ``512M``, ``50G``, ``1.5T`` (binary units) -> a ``Size`` in bytes;
    ``positive`` (``SIZE``) refuses 0.

    A bad size is a ``Ds4quantError`` naming the option, so it prints as one
    line and exits 2 like every other user error (not click's usage block)."""

    name = "size"

    def __init__(self, positive: bool = True):
        self.positive = positive

    def convert(self, value, param, ctx):
        if isinstance(value, Size):
            return value
        from ds4quant.sizes import parse_size

        where = param.opts[0] if param is not None else "size"
        return Size(parse_size(value, where, positive=self.positive), str(value))


SIZE = SizeType()


class OwnerBudgetType(click.ParamType):
    """``NAME=BYTES`` (``cuda:0=8G``) or ``NAME`` (no budget) -> ``(name, bytes or None)``;
    the bytes are a SIZE that may be 0."""

    name = "owner"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        from ds4quant.deploy.place import parse_owner

        return parse_owner(value)


OWNER_BUDGET = OwnerBudgetType()


def json_option(help: str = "Print one JSON object."):
    return click.option("--json", "as_json", is_flag=True, help=help)


def mode_option(default: str = "fast", help: Optional[str] = None):
    return click.option("--mode", type=click.Choice([m.value for m in Mode]), default=default, show_default=True, help=help)


def variant_107_option():
    return click.option("--variant-107", default=None, metavar="QTYPE",
                        help="Name the codec of untagged ggml type 107 tensors (rocmfp2, rocmfp2_affine, rocmfp2_s40).")


def source_option(help: str):
    return click.option("--source", default=None, type=PATH, help=help)


def imatrix_option(help: str):
    return click.option("--imatrix", default=None, type=PATH, help=help)


def fidelity_option(help: str):
    return click.option("--fidelity", "fidelity", is_flag=True, help=help)


def protocol_option(help: str):
    return click.option("--protocol", type=click.Choice(list(PROTOCOLS)), default=None, help=help)


def size_option(*decls: str, help: str):
    return click.option(*decls, type=SIZE, default=None, metavar="SIZE", help=help)


def device_option(help: str = "Where each layer and the hidden streams run (one layer in memory at a time)."):
    return click.option("--device", default="cpu", show_default=True, metavar="cpu|cuda[:N]", help=help)
