"""The package's version: one place, read by the CLI's --version and written into
every artifact, journal and report this version makes."""

VERSION = "0.1.0"
