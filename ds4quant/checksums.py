"""``SHA256SUMS`` of a release folder: moved to ``ds4quant.artifact.sums`` (the
container layer, which the artifact view reads it from); re-exported here."""

from ds4quant.artifact.sums import MAX_SUMS_BYTES, SUMS_NAME, format_sums, list_files, read_sums, write_sums

__all__ = ["MAX_SUMS_BYTES", "SUMS_NAME", "format_sums", "list_files", "read_sums", "write_sums"]
