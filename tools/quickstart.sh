#!/usr/bin/env bash
# Set up an isolated environment (.venv), fetch + convert the default model (its q4 copy answers on the
# CPU; tools/fetch_default_model.sh converts a float32 one too), answer one question.
# Usage: bash tools/quickstart.sh ["your prompt"]
# Each step says what it does before it starts: none of them waits in silence.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
step() { printf '==> %s\n' "$*" >&2; }
if [ ! -x .venv/bin/python ]; then
  step "creating the virtual environment .venv"
  "$PY" -m venv .venv
fi
step "installing rawinfer and its dependencies into .venv (a minute or two the first time)"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e .
step "fetching the default model into weights/ (once; later runs find it there)"
PYTHON=.venv/bin/python bash tools/fetch_default_model.sh
step "compiling the CPU kernels (once per machine, cached in ${RAWINFER_CACHE:-$HOME/.cache/rawinfer})"
.venv/bin/rawinfer warmup
step "asking the model; \`.venv/bin/rawinfer chat\` holds a conversation"
exec .venv/bin/rawinfer generate "${1:-What is the capital of France?}"
