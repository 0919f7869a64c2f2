#!/usr/bin/env bash
# The main job on the shipped samples. Sets up .venv on a fresh machine first.
source "$(dirname "$0")/_env.sh"
python scripts/demo.py "$@"  # _env.sh has changed to the repository root
