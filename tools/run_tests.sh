#!/usr/bin/env bash
# Set up an isolated environment (.venv), fetch + convert the default model and Gemma 3 270M (its golden
# tests), run the whole test suite. Both are cached: a second run downloads and converts nothing.
# Usage: bash tools/run_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[dev,ray]'
PYTHON=.venv/bin/python bash tools/fetch_default_model.sh
PYTHON=.venv/bin/python bash tools/fetch_model.sh gemma3-270m
exec .venv/bin/python -m pytest -q "$@"
