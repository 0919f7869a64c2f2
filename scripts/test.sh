#!/usr/bin/env bash
# The test command: sets up .venv on a fresh machine, then runs the suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k golden`.
source "$(dirname "$0")/_env.sh"
python -m pytest "$@"
