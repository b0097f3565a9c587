#!/usr/bin/env bash
# Set up an isolated environment (.venv), fetch + convert the default model, answer one question.
# Usage: bash tools/quickstart.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e .
PYTHON=.venv/bin/python bash tools/fetch_default_model.sh
.venv/bin/rawinfer warmup                 # compiles the CPU kernels once per machine (cached in ~/.cache/rawinfer)
exec .venv/bin/rawinfer generate "${1:-What is the capital of France?}"
