"""Errors a user can cause. The CLI prints them on one line and exits 2.

This module imports nothing, so every layer (formats, codebooks, sources,
artifact, runtime, pipeline) can raise these without importing upward.
"""

from __future__ import annotations


class Ds4quantError(Exception):
    """Base of every user-facing error.

    ``where`` names the file, tensor or argument at fault; it is prefixed to
    the message so one line tells the user what and where.
    """

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        self.message = message
        self.where = where
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.hint:
            text = f"{text} ({self.hint})"
        return " ".join(text.split())


class BadInputError(Ds4quantError, ValueError):
    """Input values or arguments are invalid (NaN, wrong shape, bad option)."""


class ShapeError(BadInputError):
    """An array or tensor has a shape the operation cannot take."""


class CorruptDataError(Ds4quantError):
    """A file's bytes are malformed: truncated, bad magic, out-of-file spans."""


class UnsupportedFormatError(Ds4quantError):
    """A qtype, dtype, version or variant this build does not handle."""


class UnknownQTypeError(UnsupportedFormatError, KeyError):
    """A qtype name that is not in the registry."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.one_line()


class CodebookError(BadInputError):
    """MIX codebooks or modes are invalid, missing, or not covered exactly once."""


class EncodeRejectedError(BadInputError):
    """The encoder refused the input, as the reference encoder does."""


class IntegrityError(Ds4quantError):
    """A checksum, manifest entry or tag disagrees with the data."""


class ResumeMismatchError(Ds4quantError):
    """--resume found a journal whose inputs or recipe differ from this run."""


class OutputError(Ds4quantError):
    """The output location cannot be written: read-only, full, no permission.
    A user error (exit 2): the message names the path, the cause, and what
    was done with the work folder."""


class OutputLockedError(OutputError):
    """Another process holds the output folder's lock (the message names its pid)."""


class BudgetError(BadInputError):
    """A size or bpw budget that no plan can meet."""


class MissingDependencyError(Ds4quantError):
    """An optional package a command needs is not installed."""


class WorkerError(Ds4quantError):
    """A worker-process owner died, raised, or did not answer in time.

    ``op`` is the call that failed, ``remote_type`` the exception class the
    worker raised (None when it died or hung), ``remote_traceback`` the
    worker's full traceback text (the message carries a one-line summary).
    """

    def __init__(
        self,
        message: str,
        *,
        where: str | None = None,
        hint: str | None = None,
        op: str | None = None,
        remote_type: str | None = None,
        remote_traceback: str | None = None,
    ):
        self.op = op
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        super().__init__(message, where=where, hint=hint)


class UnregisteredTableError(CodebookError):
    """A MIX tensor's decode table is not registered with the owner that asks
    (never registered, unregistered, or registered with another owner)."""
